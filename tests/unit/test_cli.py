"""The chorus command line, the process supervisor of `chorus up`, plotting and the run summary."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from shared.kernel.config import load_config
from shared.launcher.cli import app
from shared.launcher.progress import RunTracker
from shared.launcher.supervisor import (
    ChildSpec,
    Restarts,
    Supervisor,
    plan_services,
    resolve_run,
    unique_run_id,
)
from shared.launcher.views import eval_line
from shared.results.plotting import summarize
from tests.waits import wait_until, wait_until_sync

CHORUS = str(Path(sys.executable).parent / "chorus")
CONFIG = "run: {{id: {run}, dir: {dir}}}\nmodels: {{a: {{rollouter: {{instances: 2}}}}, b: {{}}}}\n" \
         "agents: {{solver: {{model: a}}, verifier: {{model: b}}}}\n"


def _chorus(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CHORUS, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_serve_unknown_service_fails_with_the_list_of_services() -> None:
    r = _chorus("serve", "nosuch", "--config", "x.yaml")
    assert r.returncode == 2
    assert "unknown service 'nosuch'" in r.stderr
    assert "coordinator" in r.stderr and "rollouter" in r.stderr


def test_up_with_invalid_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(CONFIG.format(run="r", dir=tmp_path) + "train: {max_versionz: 3}\n")
    r = _chorus("up", str(p))
    assert r.returncode == 2
    assert "train.max_versionz" in r.stderr


def test_status_of_a_run_with_nothing_running_says_so(nats_url: str, run_id: str, tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(CONFIG.format(run=run_id, dir=tmp_path))
    r = _chorus("status", "--config", str(p), "--nats", nats_url)
    assert r.returncode == 0, r.stderr
    assert "no service of this run answered" in r.stdout
    assert "no KV bucket" in r.stdout


def test_status_of_a_finished_run_whose_server_is_gone_reads_the_run_directory(tmp_path: Path) -> None:
    from shared.launcher.runfiles import write_summary

    run_dir = tmp_path / "r-1"
    run_dir.mkdir()
    cfg = run_dir / "config.yaml"
    cfg.write_text(CONFIG.format(run="r-1", dir=tmp_path) + "train: {max_versions: 3}\n"
                   "nats: {url: nats://127.0.0.1:1, connect_timeout_s: 1}\n")
    status = ["status", "--config", str(cfg)]
    r = _chorus(*status)  # no server, and the directory holds nothing yet: the bus error
    assert r.returncode == 1 and "cannot reach NATS at nats://127.0.0.1:1" in r.stderr, r.stderr
    steps = [{"model": m, "version": v, "reward_mean": v / 10} for m in ("a", "b") for v in (1, 2, 3)]
    evals = [{"kind": "eval", "version": v, "final": f, "pass1": {"solver": f}, "failed": 0, "last": v == 3}
             for v, f in ((0, 0.25), (3, 0.75))]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in steps + evals))
    write_summary(run_dir, code=0, models={"a": {"version": 3, "trained": 48, "dropped": {"stale": 2}},
                                           "b": {"version": 3, "trained": 40, "dropped": {}}},
                  started=time.time() - 65.0)
    r = _chorus(*status, env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stdout + r.stderr
    text = " ".join(r.stdout.split())
    assert "no NATS server at nats://127.0.0.1:1" in text
    assert "run r-1 finished at" in text and "every model reached train.max_versions (3)" in text
    assert "| a | 3/3 | 3 |" in text.replace("│", "|") and "2 stale" in text and "0.750" in text, r.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_final"]["final"] == 0.75 and summary["eval_best"]["version"] == 3, summary
    assert summary["ended_utc"].endswith("Z") and summary["evals"] == 2 and summary["duration_s"] >= 65, summary
    r = _chorus("status", str(run_dir), env={"COLUMNS": "200"})  # the run directory, as plot and export take it
    assert r.returncode == 0 and "run r-1 finished at" in " ".join(r.stdout.split()), r.stdout + r.stderr
    (run_dir / "summary.json").unlink()  # a run started service by service: its steps and evaluations say it
    r = _chorus(*status)
    assert r.returncode == 0 and "run r-1 finished" in r.stdout, r.stdout


def _write_metrics(path: Path) -> None:
    lines = []
    for v in range(1, 11):  # model a: reward 0.1 .. 1.0
        lines.append({"model": "a", "version": v, "reward_mean": v / 10, "staleness_mean": 0.5,
                      "agent_reward": {"solver": v / 10}})
    for v in range(1, 4):  # model b: 3 steps -> first/last use one step each
        lines.append({"model": "b", "version": v, "reward_mean": [0.2, 0.0, 0.8][v - 1], "staleness_mean": 1.0})
    text = "\n".join(json.dumps(x) for x in reversed(lines)) + "\n{truncated line\n"
    path.write_text(text)


def test_summarize_uses_first_and_last_fifth_of_steps_per_model(tmp_path: Path) -> None:
    m = tmp_path / "metrics.jsonl"
    _write_metrics(m)
    s = summarize(m)
    assert s["a"]["steps"] == 10
    assert s["a"]["first"] == pytest.approx(0.15)  # versions 1, 2
    assert s["a"]["last"] == pytest.approx(0.95)  # versions 9, 10
    assert s["a"]["delta"] == pytest.approx(0.8)
    assert s["b"] == pytest.approx({"steps": 3, "first": 0.2, "last": 0.8, "delta": 0.6})


def test_plot_command_writes_a_png_and_prints_the_summary(tmp_path: Path) -> None:
    _write_metrics(tmp_path / "metrics.jsonl")
    r = CliRunner().invoke(app, ["plot", str(tmp_path)])
    assert r.exit_code == 0, r.output
    png = tmp_path / "reward.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "+0.800" in r.output


def test_eval_records_are_plotted_and_summarised_but_not_counted_as_steps(tmp_path: Path) -> None:
    m = tmp_path / "metrics.jsonl"
    _write_metrics(m)
    with m.open("a") as fh:
        for v, (p, f) in zip((0, 5, 10), ((0.25, 0.2), (0.5, 0.4), (0.75, 0.7)), strict=True):
            fh.write(json.dumps({"kind": "eval", "version": v, "n": 20, "pass1": {"solver": p}, "final": f}) + "\n")
    assert summarize(m)["a"]["steps"] == 10
    r = CliRunner().invoke(app, ["plot", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "held-out pass@1" in r.output
    assert "0.250 │ 0.750 │ +0.500" in r.output  # solver
    assert "0.200 │ 0.700 │ +0.500" in r.output  # final answer
    assert (tmp_path / "reward.png").stat().st_size > 0


def test_an_eval_event_prints_as_one_line_of_rounded_figures() -> None:
    ev = {"kind": "eval", "version": 20, "final": 5 / 12, "pass1": {"solver": 5 / 12, "verifier": 0.5}}
    assert eval_line(ev) == "held-out pass@1 at version 20: final answer 0.417 (solver 0.417, verifier 0.500)"
    assert eval_line({"version": 3, "pass1": "junk"}) == "held-out pass@1 at version 3: final answer ?"
    # a mid-run evaluation whose rollouts spanned the versions the trainer reached meanwhile says so
    assert eval_line({**ev, "version_max": 25}).startswith("held-out pass@1 at versions 20-25: final answer 0.417")
    assert eval_line({**ev, "version_max": 20}).startswith("held-out pass@1 at version 20:")


def test_the_loss_statistics_and_the_evaluation_figures_are_plotted_and_tabled(tmp_path: Path) -> None:
    from shared.results.plotting import training_panels

    m = tmp_path / "metrics.jsonl"
    steps = [{"model": "a", "version": v, "reward_mean": 0.1, "grad_norm": 1.0 / v, "clip_frac": 0.01 * v,
              "approx_kl_mu": 0.001, "kl_ref": 0.002 * v, "entropy": 2.0, "is_weight_mean": 1.0,
              "is_weight_max": 1.5, "steps_skipped": 0} for v in range(1, 4)]
    evals = [{"kind": "eval", "version": v, "n": 8, "samples": 4, "pass1": {"solver": p}, "final": p,
              "pass_at_k": {"final": {"1": p, "2": p + 0.1, "4": p + 0.2}, "solver": {"1": p}},
              "maj": {"final": p + 0.05, "solver": p}, "tokens_per_question": {"solver": t, "total": t}}
             for v, p, t in ((0, 0.25, 6.0), (3, 0.5, 4.0))]
    m.write_text("\n".join(json.dumps(x) for x in [*steps, *evals]) + "\n")
    panels = dict(training_panels(m))
    assert [(lab, ys) for lab, _, _, ys in panels["KL estimates (token mean)"]] == [
        ("to mu (k1)", [0.001] * 3), ("to the reference", pytest.approx([0.002, 0.004, 0.006]))]
    assert panels["held-out tokens generated per question (one rollout)"][-1] == ("total", None, [0, 3], [6.0, 4.0])
    assert "gradient norm (before clipping)" in panels and "entropy (token mean)" in panels
    r = CliRunner().invoke(app, ["plot", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for row in ("final answer pass@4", "final answer Maj@4", "tokens per question", "mean of 4 samples"):
        assert row in r.output, row
    assert "0.700 │ +0.250" in r.output  # pass@4 0.45 -> 0.70


def test_an_eval_of_n_samples_prints_maj_at_n_and_the_tokens() -> None:
    ev = {"version": 5, "samples": 4, "final": 0.5, "pass1": {"solver": 0.25}, "maj": {"final": 0.75},
          "tokens_per_question": {"total": 12.25}}
    assert eval_line(ev) == ("held-out pass@1 (mean of 4) at version 5: final answer 0.500 (solver 0.250); "
                             "Maj@4 0.750; 12.2 tokens per question")


def test_plot_of_a_directory_without_metrics_fails(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["plot", str(tmp_path)])
    assert r.exit_code == 2


def test_plan_starts_services_in_dependency_order(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(CONFIG.format(run="r", dir=tmp_path))
    keys = [s.key for s in plan_services(load_config(p))]
    assert keys == ["actions-0", "mq-a-0", "trainer-a-0", "rollouter-a-0", "rollouter-a-1", "paramsync-a-0",
                    "mq-b-0", "trainer-b-0", "rollouter-b-0", "paramsync-b-0", "coordinator-0"]
    argv = ChildSpec("rollouter", "a", "1").argv(p, "nats://h:1")
    assert argv[1:3] == ["-m", "services.rollouter"]
    assert argv[argv.index("--model") + 1] == "a" and argv[argv.index("--instance") + 1] == "1"


def test_a_rollouter_pool_starts_on_the_model_most_agents_use(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(CONFIG.format(run="r", dir=tmp_path).replace("verifier: {model: b}", "verifier: {model: b}, "
                                                              "critic: {model: b}")
                 + "workflow: {name: chain, agents: [solver, verifier, critic]}\nrollouter: {pool: 2}\n")
    keys = [s.key for s in plan_services(load_config(p))]
    assert keys[-3:] == ["rollouter-b-pool0", "rollouter-b-pool1", "coordinator-0"]  # b: two agents, a: one


def test_resolved_run_gets_a_unique_id_and_absolute_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    p = tmp_path / "c.yaml"
    p.write_text(CONFIG.format(run="base", dir="runs"))
    cfg = resolve_run(p)
    assert cfg.run.id.startswith("base-") and len(cfg.run.id) == len(unique_run_id("base"))
    assert cfg.run_dir == tmp_path / "runs" / cfg.run.id
    assert load_config(p).run.id == "base"  # the override did not leak into this process


async def test_supervisor_stops_children_and_reports_one_that_dies(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs")
    sleeper = sup.start("sleeper-0", [sys.executable, "-c", "import time; time.sleep(60)"])
    crasher = sup.start("crasher-0", [sys.executable, "-c", "import sys; print('boom: bad weights'); sys.exit(3)"])
    crasher.popen.wait(timeout=20)
    dead = sup.exited()
    assert [c.key for c in dead] == ["crasher-0"]
    assert dead[0].popen.returncode == 3
    assert "boom: bad weights" in dead[0].tail()
    assert sleeper.alive()
    codes = await sup.stop_all(grace_s=600)
    assert codes == {"sleeper-0": -15, "crasher-0": 3}  # ended by the SIGTERM itself, not a SIGKILL after the grace
    assert sup.exited() == []  # exits after stop are expected


def test_restarts_wait_their_delay_and_a_crash_loop_is_refused() -> None:
    r = Restarts(max_restarts=2, window_s=10.0, delay_s=1.0)
    assert r.exited("mq-a-0", now=0.0)
    assert r.ready(0.5) == [] and r.ready(1.0) == ["mq-a-0"] and r.ready(2.0) == []
    assert r.exited("mq-a-0", now=3.0)
    assert not r.exited("mq-a-0", now=4.0)  # a third exit within 10 s
    assert r.exited("trainer-a-0", now=4.0)  # counted per service
    assert r.exited("mq-a-0", now=20.0)  # the window moved on: the old exits no longer count
    assert sorted(r.ready(30.0)) == ["mq-a-0", "trainer-a-0"]


async def test_supervisor_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs")
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    child = sup.start("stubborn-0", [sys.executable, "-c", code])
    wait_until_sync(lambda: "ready" in child.tail(), "the child ready")
    codes = await sup.stop_all(grace_s=0.5)
    assert codes == {"stubborn-0": -9}


def test_tracker_finishes_when_every_model_reaches_max_versions() -> None:
    t = RunTracker.for_models(["a", "b"], max_versions=3)
    t.on_event({"kind": "step", "model": "a", "version": 3, "reward_mean": 0.5})
    t.on_event({"kind": "step", "model": "zzz", "version": 9})
    t.on_event("not a dict")
    assert not t.finished
    assert t.models["a"].reward_mean == 0.5
    t.on_trained_version("b", 2)
    assert not t.finished
    t.on_trained_version("b", 3)
    assert t.finished


# --- `chorus up` against stand-in services ------------------------------------------------------
# `python -m services.<name>` puts the working directory first on sys.path, so a `services/` package in
# the directory `chorus up` runs from stands in for the real ones: the supervisor itself is under test.
FAKE_SERVICE = '''
import argparse, asyncio, json, os, sys, time
from pathlib import Path
import nats
from shared.kernel.config import load_config
from shared.kernel.subjects import Names
p = argparse.ArgumentParser()
for a in ("--config", "--nats", "--model", "--instance"):
    p.add_argument(a)
args = p.parse_args()
cfg = load_config(args.config)
Path("pids").mkdir(exist_ok=True)
Path("pids", f"{os.getpid()}").write_text(cfg.run.id)
async def finish() -> None:
    from shared.launcher.supervisor import plan_services
    # every service of the run is up before the run finishes; not the coordinator: `chorus up` starts it once
    # every other service answers a ping, which stand-ins never do
    others = [s for s in plan_services(cfg) if s.service != "coordinator"]
    deadline = time.monotonic() + 30
    while len(list(Path("pids").iterdir())) < len(others) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    nc = await nats.connect(args.nats)
    kv = await nc.jetstream().key_value(Names(cfg.run.id).kv_bucket)
    with open(cfg.run_dir / "metrics.jsonl", "a") as fh:
        for v in range(1, cfg.train.max_versions + 1):
            fh.write(json.dumps({"model": args.model, "version": v, "reward_mean": v / 10, "staleness_mean": 0.0}) + "\\n")
    await kv.put(Names.trained_key(args.model), str(cfg.train.max_versions).encode())
    await nc.close()
if os.environ.get("FAKE_CRASH") == f"{__package__}:{args.model}":
    print("fake failure: weights checksum mismatch", flush=True)
    sys.exit(3)
if os.environ.get("FAKE_CRASH_ONCE") == f"{__package__}:{args.model}":
    if not Path("crashed-once").exists():
        Path("crashed-once").write_text("")
        print("fake failure: lost the broker", flush=True)
        sys.exit(4)
    Path("restarted").write_text("")
if os.environ.get("FAKE_TRAINER_FINISHES") and __package__ == "services.trainer":
    while os.environ.get("FAKE_CRASH_ONCE") and not Path("restarted").exists():
        time.sleep(0.1)  # finish only once the crashed service is back
    asyncio.run(finish())
time.sleep(120)
'''
SERVICES = ("coordinator", "rollouter", "mq", "trainer", "paramsync", "actions")


def _fake_tree(tmp_path: Path, run_id: str) -> Path:
    for svc in SERVICES:
        d = tmp_path / "services" / svc
        d.mkdir(parents=True)
        (d / "__init__.py").write_text("")
        (d / "__main__.py").write_text(FAKE_SERVICE)
    (tmp_path / "services" / "__init__.py").write_text("")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG.format(run=run_id, dir=tmp_path / "runs") + "train: {max_versions: 5}\n")
    return cfg


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited already


def _up(tmp_path: Path, cfg: Path, nats_url: str, **env: str) -> subprocess.Popen[str]:
    full_env = {**os.environ, "CHORUS_NATS__URL": nats_url, **env}
    return subprocess.Popen([CHORUS, "up", str(cfg), "--timeout-s", "150"], cwd=tmp_path, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_up_exits_0_when_every_model_is_trained_and_writes_plot(nats_url: str, run_id: str, tmp_path: Path) -> None:
    cfg = _fake_tree(tmp_path, run_id)
    proc = _up(tmp_path, cfg, nats_url, FAKE_TRAINER_FINISHES="1")
    out, _ = proc.communicate(timeout=200)
    assert proc.returncode == 0, out
    run_dir = next((tmp_path / "runs").glob(f"{run_id}-*"))
    assert (run_dir / "reward.png").stat().st_size > 0
    assert (run_dir / "config.yaml").exists() and (run_dir / "logs" / "rollouter-a-1.log").exists()
    assert "+0.400" in out  # summary: versions 1..5, first 0.1, last 0.5
    pids = [int(p.name) for p in (tmp_path / "pids").iterdir()]
    assert len(pids) >= 10 and {p.read_text() for p in (tmp_path / "pids").iterdir()} == {run_dir.name}
    assert not any(_alive(p) for p in pids)


def test_up_restarts_a_service_that_crashes_and_the_run_finishes(nats_url: str, run_id: str, tmp_path: Path) -> None:
    cfg = _fake_tree(tmp_path, run_id)
    proc = _up(tmp_path, cfg, nats_url, FAKE_CRASH_ONCE="services.paramsync:a", FAKE_TRAINER_FINISHES="1")
    out, _ = proc.communicate(timeout=200)
    assert proc.returncode == 0, out
    assert "paramsync-a-0 exited unexpectedly with code 4; restarting it" in " ".join(out.split())
    assert "lost the broker" in out
    run_dir = next((tmp_path / "runs").glob(f"{run_id}-*"))
    log = (run_dir / "logs" / "paramsync-a-0.log").read_text()
    assert "lost the broker" in log  # the restarted one writes on in the same log
    assert len(list((tmp_path / "pids").iterdir())) >= 11  # ten services and the restarted paramsync
    assert not any(_alive(int(p.name)) for p in (tmp_path / "pids").iterdir())


def test_up_stops_a_crash_loop_with_its_log_and_exits_1(nats_url: str, run_id: str, tmp_path: Path) -> None:
    cfg = _fake_tree(tmp_path, run_id)
    # only model a's paramsync: with two crash loops, either could be the one that ends the run
    proc = _up(tmp_path, cfg, nats_url, FAKE_CRASH="services.paramsync:a")
    out, _ = proc.communicate(timeout=200)
    assert proc.returncode == 1, out
    # the console wraps long lines, also after a hyphen ("paramsync-a-" / "0")
    text = re.sub(r"-\s+", "-", " ".join(out.split()))
    assert text.count("paramsync-a-0 exited unexpectedly with code 3; restarting it") == 5
    assert "paramsync-a-0 exited unexpectedly with code 3, 6 times within 300s (run.max_restarts 5)" in text
    assert "weights checksum mismatch" in out
    assert not any(_alive(int(p.name)) for p in (tmp_path / "pids").iterdir())


def test_up_stops_everything_on_ctrl_c_and_exits_130(nats_url: str, run_id: str, tmp_path: Path) -> None:
    cfg = _fake_tree(tmp_path, run_id)
    proc = _up(tmp_path, cfg, nats_url)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(list((tmp_path / "pids").glob("*"))) < 9:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    pids = [int(p.name) for p in (tmp_path / "pids").iterdir()]
    assert len(pids) >= 9 and not any(_alive(p) for p in pids)


# --- `chorus status`: the experience-store tables of mq ---------------------------------------------


def _render(renderable: object) -> str:
    import io

    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=160, color_system=None).print(renderable)
    return out.getvalue()


def _table_rows(text: str) -> list[list[str]]:
    """The cells of every header and body line of rendered tables."""
    return [[c.strip() for c in line.strip("│┃ ").replace("┃", "│").split("│")]
            for line in text.splitlines() if line.startswith(("│", "┃"))]


def test_status_table_has_one_row_per_model_and_agent_table() -> None:
    from shared.launcher.views import agent_table

    filled = {"prompt": 5, "response": 4, "reward": 3, "advantage": 2}
    metrics = {
        "b": {"agents": {"verifier": {"held": 2, "processing": 2, "dispatchable": 0, "filled": dict.fromkeys(filled, 2)}}},
        "a": {"agents": {"solver": {"held": 5, "processing": 1, "dispatchable": 2, "filled": filled},
                         "critic": {"held": 1, "processing": 0}, "junk": "not counts"}},
        "c": {"agents": "junk"},
    }
    text = _render(agent_table(metrics))
    assert _table_rows(text) == [
        ["model", "agent", "held", "processing", "dispatchable", "prompt", "response", "reward", "advantage"],
        ["a", "critic", "1", "0", "-", "-", "-", "-", "-"],  # an mq without the per-column counts
        ["a", "solver", "5", "1", "2", "5", "4", "3", "2"],
        ["b", "verifier", "2", "2", "0", "2", "2", "2", "2"],
    ]
    assert "rows with that column filled" in text
    assert agent_table({}) is None
    assert "no rows held by the mq of a" in _render(agent_table({"a": {"agents": {}}}))


def test_status_balance_table_shows_queues_instances_and_the_last_migration() -> None:
    from shared.launcher.views import balance_table

    metrics = {"0": {"balance": {
        "dispatch": "least_loaded", "queues": {"a": 7, "b": 1},
        "instances": {"a": {"0": {"load": 16, "requests": 4, "draining": False},
                            "b--1": {"load": 8, "requests": 2, "draining": False}},
                      "b": {"0": {"load": 4, "requests": 1, "draining": True}}},
        "counters": {"dispatched": 40, "requeued": 1},
        "migrations": [{"from": "b", "to": "a", "instance": "1", "queues": {"a": 12, "b": 2}}]}}}
    text = _render(balance_table(metrics))
    assert _table_rows(text) == [
        ["coordinator", "model", "queue", "instance", "load rows", "requests", "state"],
        ["0", "a", "7", "0", "16", "4", "routing"],
        ["b--1", "8", "2", "routing"],
        ["0", "b", "1", "0", "4", "1", "draining"],
    ]
    flat = " ".join(text.split())  # the caption wraps at the console width
    assert "dispatched 40" in flat and "last migration 1 b -> a" in flat
    assert balance_table({}) is None and balance_table({"0": {"counters": {}}}) is None


def test_status_pool_table_shows_each_slots_holder_and_the_swap_costs() -> None:
    from shared.launcher.views import pool_table

    pool = {"slots": [{"slot": 0, "holder": "a", "call": "micro_batch", "busy_s": 12.5, "grants": 9, "cores": [0],
                       "starts": 1},
                      {"slot": 1, "holder": None, "call": None, "busy_s": 3.0, "grants": 4, "cores": [1], "starts": 2}],
            "waiting": ["c"], "utilisation": 0.61, "swap": {"control_s": 5.5, "data_s": 0.25, "sets": 7, "gets": 3},
            "resident_bytes": 3 * 2**20, "spilled_bytes": 0}
    rows = _table_rows(_render(pool_table({"0": {"pool": pool}})))
    assert rows[0][:2] == ["pool", "slot"]
    assert rows[1] == ["0", "0", "0", "a", "micro_batch", "12.5", "9", "1", "c", "0.61", "5.50", "0.25", "7/3",
                       "3.0", "0.0"]
    assert rows[2] == ["1", "1", "-", "-", "3.0", "4", "2"]
    assert pool_table({}) is None and pool_table({"0": {"pool": {"instances": 2}}}) is None  # a rollouter's pool


@contextlib.asynccontextmanager
async def _serving(svc: Any, ready: str, nats_url: str) -> AsyncIterator[Any]:
    """``svc`` serving in a task (waited for until its attribute ``ready`` is set) and a client connection; on the
    way out the connection closes and the service must stop with exit code 0."""
    import asyncio

    import nats

    task = asyncio.create_task(svc.serve())
    nc = await nats.connect(nats_url)
    try:
        await wait_until(lambda: getattr(svc, ready, None) is not None or task.done(), f"{svc.name} started",
                         interval_s=0.02)
        if not task.done():  # its subscriptions are at the server before the first request (a busy machine)
            await svc.nc.flush(timeout=10)
        yield nc
    finally:
        await nc.close()
        svc.stop()
        assert await asyncio.wait_for(task, 30) == 0


async def test_status_shows_the_table_counts_of_a_live_mq(nats_url: str, run_id: str, tmp_path: Path) -> None:

    from services.mq.service import MqService
    from shared.kernel.codec import encode
    from shared.kernel.schemas import Array, Sample
    from shared.kernel.subjects import Names
    from shared.launcher.cli import _status

    p = tmp_path / "c.yaml"
    p.write_text(CONFIG.format(run=run_id, dir=tmp_path) + "workflow: {group_size: 2}\n"
                 "train: {global_batch: 4, micro_batch: 4}\n")
    cfg = load_config(p)
    svc = MqService(cfg, nats_url=nats_url, model="a")
    async with _serving(svc, "sub", nats_url) as nc:
        half = Sample(run=run_id, episode="t", sample_id="t_0_0", env_idx=0, rollout_idx=0, agent="solver", model="a",
                      turn=0, prompt_ids=Array.of([1, 2]), response_ids=Array.of([3]),
                      behavior_logprobs=Array.of([-0.5], "float32"), reward=1.0, group_key="t:solver:0", group_size=2,
                      version=0)
        await nc.jetstream().publish(Names(run_id).traj("a"), encode(half))
        await wait_until(lambda: svc.store.depth() == 1, "one sample held", interval_s=0.02)
        text = _render(await _status(cfg, nats_url))
    assert "1 service instance(s) answered" in text
    # half a group: held and dispatchable as a row, waiting for its group
    assert [r for r in _table_rows(text) if "solver" in r] == [["a", "solver", "1", "0", "1", "1", "1", "1", "1"]]


async def test_status_shows_the_action_completion_times_of_a_live_actions_service(nats_url: str, run_id: str,
                                                                                 tmp_path: Path) -> None:


    from services.actions.service import ActionsService
    from shared.kernel.codec import decode, encode
    from shared.kernel.schemas import ActionRequest, ActionResult
    from shared.launcher.cli import _status

    p = tmp_path / "c.yaml"
    p.write_text(CONFIG.format(run=run_id, dir=tmp_path) + "actions: {cores: 2, timeout_s: 10, memory_mb: 256}\n")
    cfg = load_config(p)
    svc = ActionsService(cfg, nats_url=nats_url)
    async with _serving(svc, "_sub", nats_url) as nc:
        req = ActionRequest(action_id="s1", kind="cpu_tests", payloads=[{"cases": 2, "case_s": 0.05}] * 3)
        res = decode(ActionResult, (await nc.request(svc.names.actions_submit(), encode(req), timeout=30)).data)
        assert res.errors == [None] * 3
        text = _render(await _status(cfg, nats_url))
    rows = _table_rows(text)
    assert ["0", "chorus", "0", "0/2", "resource cpu", "3"] == [c for c in rows if "resource cpu" in c][0][:6]
    row = [r for r in rows if "cpu_tests" in r][0]
    kind = row[row.index("cpu_tests"):]  # the leading empty cells of a continuation row are stripped
    mean, p50, p99, queue, exe, overhead = (float(x) for x in kind[2:8])
    assert kind[1] == "3" and p50 <= p99 and exe > 0 and queue >= 0 and overhead >= 0
    assert abs(queue + exe + overhead - mean) < 2e-3  # the three parts add up to the ACT


def test_the_run_tracker_counts_trained_and_dropped_samples_once_each() -> None:
    from shared.launcher.progress import RunTracker

    t = RunTracker.for_models(["m"], 10)
    for ev in ({"kind": "step", "model": "m", "version": 1, "samples": 16},
               {"kind": "step", "model": "m", "version": 1, "samples": 16},  # redelivered
               {"kind": "step", "model": "m", "version": 2, "samples": 16},
               {"kind": "drop", "model": "m", "reason": "stale", "count": 2, "sample_ids": ["a", "b"]},
               {"kind": "drop", "model": "m", "reason": "stale", "count": 2, "sample_ids": ["b", "a"]},
               {"kind": "drop", "model": "m", "reason": "invalid", "count": 1, "sample_ids": ["c"]},
               {"kind": "drop", "model": "other", "reason": "stale", "count": 9, "sample_ids": ["d"]}):
        t.on_event(ev)
    assert t.sample_lines() == ["m: 32 samples trained; 3 dropped: 2 too stale to train (train.max_staleness), "
                                "5.9% of trained + stale; 1 invalid (see the DLQ)"]
    t.on_event({"kind": "drop", "model": "m", "reason": "finished", "count": 4, "sample_ids": ["e", "f", "g", "h"],
                "detail": "finished: arrived after train.max_versions (10)"})
    assert t.sample_lines()[0].startswith("m: 32 samples trained; 7 dropped: 4 arrived after the last version")
    assert RunTracker.for_models(["n"], 10).sample_lines() == ["n: 0 samples trained, none dropped"]
