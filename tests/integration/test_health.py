"""`chorus health` against a real nats-server and a real service, `chorus serve --run-file` and `chorus new-run`,
as a container or a Kubernetes probe runs them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHORUS = [sys.executable, "-m", "shared.launcher.cli"]


def chorus(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CHORUS, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def config(tmp_path: Path, run_id: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(f"run: {{id: {run_id}, dir: {tmp_path / 'runs'}}}\nmodels: {{a: {{}}}}\n"
                 "agents: {solver: {model: a}, verifier: {model: a}}\nactions: {cores: 1}\n")
    return p


def test_health_answers_for_a_live_service_of_the_run_and_fails_with_a_reason_otherwise(nats_url, run_id, tmp_path):
    cfg = config(tmp_path, run_id)
    run_file = tmp_path / "runs" / ".run-id"
    probe = ["health", "actions", "--config", str(cfg), "--nats", nats_url, "--timeout", "1"]
    # the services wait for the run id of the deployment; SIGTERM ends that wait at once
    waiting = subprocess.Popen([*CHORUS, "serve", "actions", "--config", str(cfg), "--nats", nats_url,
                                "--run-file", str(run_file)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    svc = subprocess.Popen([*CHORUS, "serve", "actions", "--config", str(cfg), "--nats", nats_url, "--instance", "7",
                            "--run-file", str(run_file)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert "waiting for the run id" in waiting.stderr.readline()  # (or "" if it exited)
        waiting.send_signal(signal.SIGTERM)
        assert waiting.wait(timeout=120) == 0  # exit 0: the signal ended the wait (unhandled, it would be -15)

        out = chorus(*probe, "--run-file", str(run_file))
        assert out.returncode == 1 and "no run id in" in out.stderr

        made = chorus("new-run", "--config", str(cfg), "--out", str(run_file))
        assert made.returncode == 0, made.stderr
        new_id = made.stdout.strip()
        assert new_id.startswith(run_id + "-") and run_file.read_text().strip() == new_id

        deadline = time.monotonic() + 60
        while True:
            ok = chorus(*probe, "--instance", "7", "--run-file", str(run_file))
            if ok.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert ok.returncode == 0, ok.stderr
        assert f"actions[-/7] of run {new_id} answered" in ok.stdout
        # another instance (of any run made from the config's run.id): no answer, and the reason names who did
        other = chorus(*probe, "--instance", "8")
        assert other.returncode == 1
        assert f"no answer from actions[-/8] of run {run_id}*" in other.stderr and f"{new_id}/-/7" in other.stderr
    finally:
        for p in (waiting, svc):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        assert svc.wait(timeout=30) == 0


def test_health_fails_with_its_reason_on_an_unreachable_broker_and_imports_nothing_heavy(tmp_path):
    cfg = config(tmp_path, "hc")
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "shared.launcher.cli", "health", "actions", "--config",
                          str(cfg), "--nats", "nats://127.0.0.1:1", "--timeout", "1"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 1
    reason = [line for line in out.stderr.splitlines() if line.startswith("unhealthy:")]
    assert len(reason) == 1 and "cannot reach NATS at nats://127.0.0.1:1" in reason[0], out.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "shared.launcher.deploy" in imported
    assert not {"torch", "transformers", "peft"} & imported  # a probe runs every few seconds in every container


def test_a_service_whose_teardown_left_a_thread_working_exits_without_waiting_for_it(nats_url, run_id, tmp_path):
    # the teardown is cut at the stop grace (2 s) with a call of the default executor still in its 600 s sleep: the
    # process ends without it (the loop's shutdown would wait for it, past a supervisor's grace, to a SIGKILL)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: {{id: {run_id}, dir: {tmp_path / 'runs'}, stop_grace_s: 2}}\nmodels: {{a: {{}}}}\n"
                   "agents: {solver: {model: a}, verifier: {model: a}}\n")
    mark = tmp_path / "mark"
    svc = subprocess.Popen([sys.executable, "-m", "tests.integration.lingering_thread_service", "--config", str(cfg),
                            "--nats", nats_url], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT), "LINGER_MARK": str(mark)})
    try:
        deadline = time.monotonic() + 300
        while not Path(str(mark) + ".ready").exists():
            assert svc.poll() is None and time.monotonic() < deadline, svc.communicate()[0]
            time.sleep(0.1)
        svc.send_signal(signal.SIGTERM)
        out, _ = svc.communicate(timeout=300)  # the sleep is 600 s: waiting for it fails here
        assert svc.returncode == 0, out
        assert "a thread still works after the service stopped; exiting without it" in out, out
        assert not mark.exists()  # the call never ended: the process did not wait for it
    finally:
        if svc.poll() is None:
            svc.kill()
            svc.wait()
