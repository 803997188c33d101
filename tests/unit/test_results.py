"""Results users can use, without a run: the errors of `chorus export`, the Prometheus exposition of metrics
messages and its HTTP server, the scalars that go to the tracking backends, and the `logging` config section.
(The whole path on a real run is tested in tests/e2e/test_specialisation.py.)"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shared.kernel.config import ChorusConfig, ConfigError, load_config
from shared.launcher.cli import app
from shared.results.promexport import Latest, metric_name, serve_http
from shared.results.tracking import scalars
from tests.e2e.results import parse_exposition

CONFIG = "run: {{id: r1, dir: {dir}}}\nmodels: {{a: {{}}, b: {{lora: {{r: 4}}}}}}\n" \
         "agents: {{solver: {{model: a}}, verifier: {{model: b, adapter: ver}}}}\n"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "runs" / "r1"
    (d / "checkpoints" / "a").mkdir(parents=True)
    (d / "config.yaml").write_text(CONFIG.format(dir=tmp_path / "runs"))
    for v in (2, 5):
        (d / "checkpoints" / "a" / f"v{v}.pt").write_bytes(b"")
    return d


@pytest.mark.parametrize(("args", "expected"), [
    (["--model", "zzz"], "the run has no model 'zzz': its models are a, b"),
    (["--model", "a", "--version", "3"], "no checkpoint v3 of model 'a': there are v2, v5"),
    (["--model", "b"], "no checkpoint of model 'b'"),
    (["--model", "a", "--version", "best"], "best.json: the best version is kept by the held-out evaluation"),
    (["--model", "a", "--version", "latest"], "--version 'latest': expected a version number or best"),
])
def test_export_errors_name_what_exists(run_dir: Path, tmp_path: Path, args: list[str], expected: str) -> None:
    res = CliRunner().invoke(app, ["export", str(run_dir), *args, "--out", str(tmp_path / "out")],
                             env={"COLUMNS": "400"})
    assert res.exit_code == 2, res.output
    assert expected in " ".join(res.output.split()), res.output
    if args == ["--model", "b"]:
        assert "a: v2, v5; b: none" in res.output
    assert not (tmp_path / "out").exists()


def test_export_of_a_missing_run_lists_the_runs_beside_it(run_dir: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["export", str(run_dir.parent / "r9"), "--model", "a", "--out", str(tmp_path / "o")],
                             env={"COLUMNS": "400"})
    assert res.exit_code == 2
    assert "no run directory" in res.output and "has r1" in res.output, res.output


def test_metrics_messages_become_labelled_gauges_with_help_and_type() -> None:
    latest = Latest()
    assert latest.update("chorus.r1.metrics.trainer.m-0", {
        "service": "trainer", "instance": "0", "model": "m", "run": "r1", "version": 7, "done": True,
        "epoch": "ab12", "counters": {"dropped_stale": 3, "odd-name.x": 1.5}, "ids": [1, 2],
        "weights": {"bytes": 2**40}, "loss": float("nan")})
    assert latest.update("chorus.r1.metrics.coordinator.0", {"service": "coordinator", "instance": "0",
                                                             "model": None, "run": "r1", "version": 1})
    assert not latest.update("chorus.r1.metrics.mq.x", [1, 2])  # not an object: counted, not served
    samples = parse_exposition(latest.exposition())
    trainer = frozenset({"run": "r1", "service": "trainer", "model": "m", "instance": "0"}.items())
    coordinator = frozenset({"run": "r1", "service": "coordinator", "model": "", "instance": "0"}.items())
    assert samples[("chorus_version", trainer)] == 7
    assert samples[("chorus_version", coordinator)] == 1
    assert samples[("chorus_counters_dropped_stale", trainer)] == 3
    assert samples[("chorus_counters_odd_name_x", trainer)] == 1.5
    assert samples[("chorus_weights_bytes", trainer)] == 2**40
    assert samples[("chorus_exporter_rejected_total", frozenset())] == 1
    assert samples[("chorus_exporter_messages_total", frozenset())] == 2
    names = {name for name, _ in samples}
    assert not names & {"chorus_done", "chorus_epoch", "chorus_ids"}  # booleans, strings, lists: skipped
    assert "chorus_loss NaN" not in latest.exposition() and 'instance="0"} NaN' in latest.exposition()
    assert metric_name("a.b-c/d") == "chorus_a_b_c_d"


def test_label_values_are_escaped() -> None:
    latest = Latest()
    latest.update("chorus.r.metrics.x.y", {"service": 'we"ird\\', "instance": "a\nb", "v": 1})
    text = latest.exposition()
    assert 'service="we\\"ird\\\\"' in text and 'instance="a\\nb"' in text
    parse_exposition(text)


async def test_the_http_server_answers_get_metrics_and_404_elsewhere() -> None:
    latest = Latest()
    latest.update("chorus.r.metrics.mq.m-0", {"service": "mq", "instance": "0", "model": "m", "run": "r", "held": 4})
    server = await serve_http(latest, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    def get(path: str) -> tuple[int, str, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.status, r.headers["Content-Type"], r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, "", ""

    try:
        status, ctype, body = await asyncio.to_thread(get, "/metrics")
        assert status == 200 and ctype == "text/plain; version=0.0.4; charset=utf-8"
        assert 'chorus_held{run="r",service="mq",model="m",instance="0"} 4' in body
        assert (await asyncio.to_thread(get, "/"))[0] == 404
    finally:
        server.close()
        await server.wait_closed()


def test_tracked_scalars_are_the_numeric_fields_flattened() -> None:
    record = {"model": "m", "version": 3, "loss": 0.5, "done": False, "sample_ids": ["a"],
              "adapter_samples": {"sol": 8, "ver": 0}, "staleness_max": 1}
    assert scalars(record) == {"version": 3.0, "loss": 0.5, "adapter_samples/sol": 8.0, "adapter_samples/ver": 0.0,
                               "staleness_max": 1.0}


def test_logging_defaults_to_tensorboard_and_refuses_a_missing_package(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    base = "models: {m: {}}\nagents: {solver: {model: m}, verifier: {model: m}}\n"
    (tmp_path / "c.yaml").write_text(base)
    assert load_config(tmp_path / "c.yaml").logging.backends == ["tensorboard"]
    (tmp_path / "c.yaml").write_text(base + "logging: {backends: [tensorboard, mlflow]}\n")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "mlflow" else object())
    with pytest.raises(ConfigError, match=r"logging.backends: mlflow is listed but the package 'mlflow' is not "
                                          r"installed: pip install 'chorus\[mlflow\]'"):
        load_config(tmp_path / "c.yaml")
    with pytest.raises(ValueError, match="names a backend twice"):
        ChorusConfig(models={"m": {}}, agents={"solver": {"model": "m"}, "verifier": {"model": "m"}}, logging={"backends": ["wandb", "wandb"]})
