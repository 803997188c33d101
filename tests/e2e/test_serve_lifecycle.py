"""`chorus serve` pointed at a NATS URL where nothing listens: it gives up in time, and a signal ends it."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

from tests.e2e.conftest import CHORUS

DEAD_URL = "nats://127.0.0.1:1"  # port 1 on loopback: connection refused at once, every time


def _config(tmp_path: Path, connect_timeout_s: float) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(f"run: {{id: lifecycle, dir: {tmp_path / 'runs'}}}\n"
                 f"nats: {{connect_timeout_s: {connect_timeout_s}}}\n"
                 "models: {a: {}}\nagents: {solver: {model: a}, verifier: {model: a}}\n")
    return p


def _first_log_time(stderr: str) -> float:
    """The wall-clock time of the service's first JSON log line (its first connection attempt)."""
    for line in stderr.splitlines():
        if line.startswith("{"):
            return datetime.fromisoformat(json.loads(line)["timestamp"].replace("Z", "+00:00")).timestamp()
    raise AssertionError(f"no JSON log line in:\n{stderr}")


def test_serve_with_unreachable_nats_exits_nonzero_after_connect_timeout_naming_the_url(tmp_path: Path) -> None:
    timeout_s = 2.0
    r = subprocess.run([CHORUS, "serve", "mq", "--config", str(_config(tmp_path, timeout_s)), "--model", "a",
                        "--nats", DEAD_URL], capture_output=True, text=True, timeout=300)
    ended = time.time()
    assert r.returncode != 0
    errors = [json.loads(line) for line in r.stderr.splitlines()
              if line.startswith("{") and json.loads(line).get("level") == "error"]
    assert errors and DEAD_URL in errors[-1]["error"] and "connect_timeout_s" in errors[-1]["error"], r.stderr
    print(f"first connection attempt to exit: {ended - _first_log_time(r.stderr):.1f}s (connect timeout {timeout_s}s)")


def test_sigterm_while_connecting_ends_serve_with_exit_0(tmp_path: Path) -> None:
    proc = subprocess.Popen([CHORUS, "serve", "mq", "--config", str(_config(tmp_path, 120)), "--model", "a",
                             "--nats", DEAD_URL], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # retrying: one failed attempt logged
            if "nats error" in line:
                break
        else:
            raise AssertionError(f"serve exited before trying to connect (exit {proc.wait()})")
        proc.send_signal(signal.SIGTERM)  # its connect timeout is 120 s: only the signal ends it before that
        assert proc.wait(timeout=100) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_status_with_the_bus_gone_says_so_and_exits_1(tmp_path: Path) -> None:
    r = subprocess.run([CHORUS, "status", "--config", str(_config(tmp_path, 0.5)), "--nats", DEAD_URL],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert f"cannot reach NATS at {DEAD_URL}" in " ".join(r.stderr.split()), r.stderr


def test_sigusr1_prints_every_threads_stack_and_the_service_goes_on(tmp_path: Path) -> None:
    proc = subprocess.Popen([CHORUS, "serve", "mq", "--config", str(_config(tmp_path, 120)), "--model", "a",
                             "--nats", DEAD_URL], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # started and retrying: the handler is installed
            if "nats error" in line:
                break
        else:
            raise AssertionError(f"serve exited before trying to connect (exit {proc.wait()})")
        proc.send_signal(signal.SIGUSR1)
        dump = []
        for line in proc.stderr:
            dump.append(line)
            if line.startswith(("Current thread", "Thread 0x")) and "most recent call first" in line:
                break
        else:
            raise AssertionError(f"no stack dump after SIGUSR1 (exit {proc.wait()}):\n{''.join(dump[-20:])}")
        assert proc.poll() is None  # still serving (retrying its connection)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
