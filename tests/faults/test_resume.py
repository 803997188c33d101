"""A whole `chorus up` run SIGKILLed (every service and the embedded nats-server at once) and resumed with
`chorus up --resume runs/<id>`: versions continue from the last commit and no sample is trained twice."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from shared.kernel.bus import kv_get_int
from shared.kernel.subjects import Names
from shared.launcher.natsserver import NatsServer
from shared.launcher.supervisor import descendants
from shared.results.plotting import load_metrics
from tests.faults.harness import MODELS, fault_config
from tests.faults.ledger import Ledger, violations
from tests.waits import connect

CHORUS = str(Path(sys.executable).parent / "chorus")
MAX_VERSIONS = 40  # far enough for the kill to land mid-run (the tiny run makes a few versions a second)
KILL_AT = 10


def kill_everything(pid: int) -> int:
    """Freeze the whole tree first (nobody gets to react), then SIGKILL it: a power cut, for the processes."""
    pids = [pid, *descendants(pid)]
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGSTOP)
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return len(pids)


async def wait_for(cond, timeout_s: float, what: str, proc: subprocess.Popen[bytes] | None = None) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if await asyncio.wait_for(cond(), max(0.1, deadline - time.monotonic())):
                return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"chorus up exited with {proc.returncode} while waiting for {what}")
        await asyncio.sleep(0.3)
    raise AssertionError(f"no {what} within {timeout_s:.0f}s")


# CI runs it in `make test-long` (and `make faults`), beside `make test`
@pytest.mark.full
async def test_a_killed_run_resumes_from_its_last_commit_and_trains_nothing_twice(tmp_path, run_id):
    await killed_and_resumed(tmp_path, run_id, fault_config(tmp_path, run_id, max_versions=MAX_VERSIONS))


# one slot for both models' trainers: each model's weights, AdamW state and accumulated gradients live in the pool's
# host-memory store between its turns, and a commit is what a resumed run starts from
@pytest.mark.full
async def test_a_killed_run_with_a_training_pool_resumes_from_its_last_commit(tmp_path, run_id):
    config = fault_config(tmp_path, run_id, max_versions=MAX_VERSIONS)
    cfg = yaml.safe_load(config.read_text())
    cfg["train"]["pool"] = {"slots": 1, "mode": "warm"}
    config.write_text(yaml.safe_dump(cfg))
    await killed_and_resumed(tmp_path, run_id, config, services=10)  # the pool and its slot for two trainers
    logs = next((tmp_path / "runs").glob(f"{run_id}-*/logs"))
    assert not list(logs.glob("trainer-*_lm-*.log")), "a model had a trainer of its own"
    steps = [json.loads(line) for line in (logs / "trainer-0.log").read_text().splitlines() if '"step"' in line]
    assert {s["model"] for s in steps if s.get("event") == "step"} == set(MODELS)  # the pool's trainer trained both


async def killed_and_resumed(tmp_path: Path, run_id: str, config: Path, services: int = 11) -> None:
    """`chorus up config` killed whole (``services`` service processes and more) at version KILL_AT of both models,
    then resumed to MAX_VERSIONS: the ledger's invariants, versions continuing from the last commit."""
    first = subprocess.Popen([CHORUS, "up", str(config), "--timeout-s", "3600"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.STDOUT, start_new_session=True)
    ledgers: list[Ledger] = []
    try:
        run_dir: Path | None = None

        async def started() -> bool:
            nonlocal run_dir
            found = sorted((tmp_path / "runs").glob(f"{run_id}-*/config.yaml"))
            run_dir = found[-1].parent if found else None
            return run_dir is not None

        await wait_for(started, 600, "run directory", first)
        assert run_dir is not None
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        full_id, url = cfg["run"]["id"], cfg["nats"]["url"]
        ledgers.append(await Ledger(full_id, MODELS, url).start())
        await wait_for(lambda: _trained_at_least(ledgers[0], KILL_AT), 1800, f"version {KILL_AT} on both models",
                       first)
        before = await ledgers[0].trained()
        assert first.poll() is None and max(before.values()) < MAX_VERSIONS, "the run finished before the kill"
        killed_at = time.time()
        killed = kill_everything(first.pid)
        first.wait(timeout=10)
        await ledgers[0].close()
        assert killed >= services + 1  # chorus up, nats-server, the services

        resumed = await asyncio.create_subprocess_exec(
            CHORUS, "up", "--resume", str(run_dir), "--timeout-s", "3600",
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

        async def relisten() -> bool:
            # The first broker is dead: whatever answers at the URL in config.yaml is the resumed run's.
            url2 = yaml.safe_load((run_dir / "config.yaml").read_text())["nats"]["url"]
            ledgers.append(await Ledger(full_id, MODELS, url2).start())
            return True

        await wait_for(relisten, 600, "the resumed run's broker")
        out, _ = await asyncio.wait_for(resumed.communicate(), 3600)
        text = out.decode(errors="replace")
        assert resumed.returncode == 0, text[-3000:]
        assert "resuming run" in text
        # the resumed run's summary counts every sample trained since the run started, as metrics.jsonl has them
        steps = {(r["model"], r["version"]): r["samples"] for r in load_metrics(run_dir / "metrics.jsonl")}
        for m in MODELS:
            trained = sum(n for (model, _), n in steps.items() if model == m)
            assert f"{m}: {trained} samples trained" in text, (m, trained, text[-2000:])
        await ledgers[-1].close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            kill_everything(first.pid)
        for ledger in ledgers:
            await ledger.close()

    # Read the run's books from its own store, with the run stopped.
    server = NatsServer(run_dir / "nats").start()
    try:
        ledger = await Ledger(full_id, MODELS, server.url).start()
        for earlier in ledgers:
            for m in MODELS:
                ledger.published[m] |= earlier.published[m]
            for sid, t in earlier.published_at.items():
                ledger.published_at[sid] = min(t, ledger.published_at.get(sid, t))
        reports = await ledger.report(killed_at=killed_at)
        nc = await connect(server.url)
        kv = await nc.jetstream().key_value(Names(full_id).kv_bucket)
        after = {m: await kv_get_int(kv, Names.trained_key(m)) for m in MODELS}
        await nc.close()
        await ledger.close()
    finally:
        server.stop()
    problems = violations(reports, MAX_VERSIONS)
    assert not problems, problems
    for m in MODELS:
        assert before[m] >= KILL_AT and after[m] == MAX_VERSIONS
        r = reports[m]
        assert r.versions == list(range(1, MAX_VERSIONS + 1))  # versions continue: none skipped, none twice
        assert not r.trained_twice and not r.conflicting_versions
        assert r.published > 0 and not r.missing
        # At most the samples in flight at the kill (a few episodes), never acknowledged to the dead coordinator.
        assert len(r.unstored_at_kill) <= 64, r.unstored_at_kill[:5]


async def _trained_at_least(ledger: Ledger, version: int) -> bool:
    return all(v >= version for v in (await ledger.trained()).values())
