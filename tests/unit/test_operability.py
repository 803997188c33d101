"""Operability of the command line and the logs: --version, errors from environment overrides, JSON-only logs,
progress as lines, the service's --exit-when-done switch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from shared.kernel.config import ConfigError, load_config
from shared.kernel.service import Service, parse_args
from shared.launcher.progress import MonitorState, ProgressView, RunTracker

CHORUS = str(Path(sys.executable).parent / "chorus")
CONFIG = "run: {id: r}\nmodels: {a: {}}\nagents: {solver: {model: a}, verifier: {model: a}}\n"


def test_version_prints_the_package_version() -> None:
    r = subprocess.run([CHORUS, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert r.stdout.strip() == f"chorus {version('chorus')}"


def test_help_lists_flags_without_a_value_type() -> None:
    for args in ([], ["up"], ["serve"]):
        r = subprocess.run([CHORUS, *args, "--help"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "COLUMNS": "120"})
        assert r.returncode == 0, r.stderr
        assert "--help" in r.stdout and "<bool>" not in r.stdout and "BOOLEAN" not in r.stdout, r.stdout


def test_a_bad_environment_override_names_the_variable_not_the_file(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "run.yaml"
    p.write_text(CONFIG)
    monkeypatch.setenv("CHORUS_TRAIN__MAX_VERSIONS", "abc")
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert "CHORUS_TRAIN__MAX_VERSIONS='abc'" in str(exc.value)
    assert "train.max_versions" in str(exc.value)
    assert str(p) not in str(exc.value)


def test_a_section_override_that_is_not_json_names_the_variable(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "run.yaml"
    p.write_text(CONFIG)
    monkeypatch.setenv("CHORUS_NATS", "{not json")
    with pytest.raises(ConfigError, match="CHORUS_NATS='{not json'"):
        load_config(p)


def test_a_bad_key_in_the_file_still_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "run.yaml"
    p.write_text(CONFIG + "train: {max_versions: abc}\n")
    with pytest.raises(ConfigError, match=f"invalid config {p}:\n  train.max_versions: "):
        load_config(p)


LOGGING = """
import logging, warnings
from shared.kernel.logs import setup_logging
setup_logging(json=True, run="r").info("ours")
warnings.warn("a library warning", UserWarning)
logging.getLogger("nats.aio.client").warning("a stdlib record")
from transformers.utils import logging as hf
hf.get_logger("transformers.modeling_utils").warning("a transformers record")
from tqdm import tqdm
for _ in tqdm(range(3)):
    pass
"""


def test_json_logs_hold_only_json_lines_with_warnings_stdlib_and_transformers_records() -> None:
    r = subprocess.run([sys.executable, "-c", LOGGING], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stderr.splitlines()]  # a progress bar or plain text would fail here
    events = " ".join(str(x["event"]) for x in lines)
    for text in ("ours", "a library warning", "a stdlib record", "a transformers record"):
        assert text in events, r.stderr
    assert all(x["run"] == "r" and "level" in x for x in lines)


# A service's own order: its module imports torch, transformers and tqdm first, then main_for sets up the logs;
# transformers' GGUF loading draws a tqdm bar of its own.
SERVICE_ORDER = """
import sys
import services.trainer.service
from shared.kernel.logs import setup_logging
setup_logging(run="r").info("ours")
from tqdm.auto import tqdm
for _ in tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
    pass
"""


def test_a_service_logs_no_progress_bar_of_a_library_imported_before_its_logs() -> None:
    r = subprocess.run([sys.executable, "-c", SERVICE_ORDER], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if not k.startswith(("TQDM_", "HF_HUB_"))})
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["event"] for line in r.stderr.splitlines()] == ["ours"], r.stderr


def test_progress_as_a_log_line() -> None:
    tracker = RunTracker.for_models(["a", "b"], max_versions=4)
    tracker.on_event({"kind": "step", "model": "a", "version": 4, "reward_mean": 0.5})
    tracker.on_event({"kind": "step", "model": "b", "version": 2})
    assert ProgressView(tracker).log_line() == "progress: a 4/4 reward 0.500 done; b 2/4 reward -"
    state = MonitorState()
    assert state.line() == "monitor: 0 service instance(s) reporting: none"
    state.on_metrics("chorus.r.metrics.mq.a-0", {"time": 1e12})
    state.on_event("chorus.r.events.trainer", {"kind": "done", "model": "a"})
    assert state.line() == "monitor: 1 service instance(s) reporting: mq.a-0; last event trainer done (a)"


def test_exit_when_done_comes_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not parse_args(Service, ["--config", "c.yaml"]).exit_when_done
    assert parse_args(Service, ["--config", "c.yaml", "--exit-when-done"]).exit_when_done
    monkeypatch.setenv("CHORUS_EXIT_WHEN_DONE", "1")
    assert parse_args(Service, ["--config", "c.yaml"]).exit_when_done
