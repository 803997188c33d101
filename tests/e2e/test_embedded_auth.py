"""The embedded nats-server of `chorus up` has a generated password per client kind: a local process without one
cannot connect, the read-only observer (its password in the run directory) cannot write the run's KV, and the run
finishes. Before, any local process could write `trained.<model>` and freeze that model's training."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

import nats
import nats.errors
import pytest

from shared.kernel.subjects import Names
from tests.conftest import ROOT
from tests.e2e.conftest import small_run_config
from tests.waits import connect, wait_until

CHORUS = str(Path(sys.executable).parent / "chorus")
VERSIONS = 30


async def _up(config: Path, env: dict[str, str]) -> tuple[asyncio.subprocess.Process, list[str], asyncio.Task[None]]:
    proc = await asyncio.create_subprocess_exec(CHORUS, "up", str(config), "--timeout-s", "600", cwd=ROOT, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    lines: list[str] = []

    async def read() -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            lines.append(raw.decode().rstrip("\n"))

    return proc, lines, asyncio.create_task(read())


async def _live(lines: list[str], trained: bool = True) -> tuple[str, str]:
    """The embedded server's URL and the run id (``trained``: once a first version is trained)."""
    try:
        head = await wait_until(lambda: [m for line in lines if (m := re.search(
            r"embedded nats-server at (nats://\S+)", line))], "the embedded server's URL printed")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; chorus up printed:\n" + "\n".join(lines)) from None
    run_id = next(m.group(1) for line in lines if (m := re.match(r"run (\S+) in ", line)))
    if trained:
        await wait_until(lambda: any(re.search(r"solver_lm [1-9]\d*/", line) for line in lines), "a first version",
                         timeout_s=300)
    return head[0].group(1), run_id


async def _refused(coro) -> str:  # noqa: ANN001 - a coroutine
    try:
        await coro
    except (nats.errors.Error, TimeoutError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


async def test_only_the_runs_own_services_may_write_its_kv_on_the_embedded_server(tmp_path: Path) -> None:
    config = small_run_config(tmp_path, "authrun", max_versions=VERSIONS, global_batch=16, micro_batch=16)
    env = {**os.environ, "CHORUS_RUN__DIR": str(tmp_path / "runs"), "COLUMNS": "400"}  # one line per message
    env = {k: v for k, v in env.items() if not k.startswith("CHORUS_NATS")}
    proc, lines, reader = await _up(config, env)
    try:
        url, run_id = await _live(lines)
        names = Names(run_id)
        # A local process with no credentials: the server does not let it in.
        why = await _refused(nats.connect(url, allow_reconnect=False, connect_timeout=5, max_reconnect_attempts=0))
        assert "authorization" in why.lower(), why
        # The observer (password in the run directory) reads the run, and may not write its KV.
        password = (tmp_path / "runs" / run_id / "nats" / "observer.password").read_text().strip()
        assert oct((tmp_path / "runs" / run_id / "nats" / "observer.password").stat().st_mode & 0o777) == "0o600"
        denied: list[str] = []

        async def on_error(exc: Exception) -> None:
            denied.append(str(exc))

        nc = await connect(url, user="observer", password=password, error_cb=on_error,
                           inbox_prefix=b"_INBOX.observer")
        try:
            js = nc.jetstream(timeout=5)
            kv = await js.key_value(names.kv_bucket)
            assert int((await kv.get(Names.trained_key("solver_lm"))).value) >= 1  # reads work
            why = await _refused(kv.put(Names.trained_key("solver_lm"), b"1000000000"))
            assert why, "the observer wrote trained.solver_lm"
            await wait_until(lambda: denied, "the server's permissions violation")
            assert "permissions violation" in denied[0].lower(), denied
        finally:
            await nc.close()
        # `chorus status` from the run directory, live, as the observer
        status = await asyncio.create_subprocess_exec(
            CHORUS, "status", "--config", str(tmp_path / "runs" / run_id / "config.yaml"), env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(status.communicate(), 120)
        assert status.returncode == 0, out.decode()
        assert "solver_lm" in out.decode(), out.decode()
        assert await asyncio.wait_for(proc.wait(), 600) == 0, "\n".join(lines[-40:])
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await reader
    assert any(re.search(rf"solver_lm {VERSIONS}/{VERSIONS}", line) for line in lines), "\n".join(lines[-20:])
    logs = "".join(p.read_text() for p in (tmp_path / "runs" / run_id / "logs").glob("*.log"))
    assert "permission denied" not in logs  # every service within its kind's permissions


async def test_nats_embedded_auth_false_leaves_the_embedded_server_open(tmp_path: Path) -> None:
    config = small_run_config(tmp_path, "openrun", max_versions=4, global_batch=8, micro_batch=8)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHORUS_NATS")}
    env.update({"CHORUS_RUN__DIR": str(tmp_path / "runs"), "CHORUS_NATS__EMBEDDED_AUTH": "false", "COLUMNS": "400"})
    proc, lines, reader = await _up(config, env)
    try:
        url, run_id = await _live(lines, trained=False)
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=5)
        await nc.close()
        assert not (tmp_path / "runs" / run_id / "nats" / "observer.password").exists()
        assert await asyncio.wait_for(proc.wait(), 600) == 0, "\n".join(lines[-40:])
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await reader


# in `make test-long` (CI), beside make test's 20 minutes
pytestmark = [pytest.mark.e2e, pytest.mark.full]
