"""A service whose start fails: a file the config names, or the config itself, stops the run (78) with the real cause;
only the broker's own failures are retried (75)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from shared.kernel.config import ConfigError, load_config
from shared.kernel.service import EX_RUN_FAILED, EX_TEMPFAIL, Service

ROOT = Path(__file__).resolve().parents[2]


def failing(exc: BaseException) -> Service:
    class Failing(Service):
        async def start(self) -> None:
            raise exc

    return Failing(load_config(ROOT / "configs" / "tiny-chain.yaml"), nats_url="nats://127.0.0.1:1")


@pytest.mark.parametrize(("exc", "code"), [
    (FileNotFoundError("models.m.path: /no/such/model is not a Hugging Face model directory (no config.json)"),
     EX_RUN_FAILED),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/no/such/model/config.json"), EX_RUN_FAILED),
    (PermissionError(errno.EACCES, "Permission denied", "/no/such/model/model.safetensors"), EX_RUN_FAILED),
    (OSError(errno.EIO, "Input/output error", "/no/such/model/model.safetensors"), EX_RUN_FAILED),
    (ConfigError("models.m.device is cuda but torch.cuda.is_available() is False"), EX_RUN_FAILED),
    (ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed"), EX_TEMPFAIL),
    (TimeoutError(), EX_TEMPFAIL),
])
async def test_a_start_error_exits_by_whether_a_restart_can_fix_it(
        exc: BaseException, code: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert await failing(exc).serve() == code
    out = capsys.readouterr()
    logged = out.out + out.err
    if code == EX_RUN_FAILED:
        assert "/no/such/model" in logged or "cuda" in logged, logged
        assert "the broker did not answer" not in logged, logged
    else:
        assert "the broker did not answer in time" in logged, logged
