"""A DeepSpeed model in the training pool (FlexMARL §6.1): its 2-rank group is a gang that takes two slots at once,
waits behind a torch model holding one of them, gives both back together, and swaps its state out and back (every
rank its own shard, in host memory) between tenancies. A rank killed in the middle of a micro-batch and rank 0
killed in the middle of a step cost nothing: the gang starts afresh from the stored state, the logged calls run
again, and the weights equal a group that never left its processes (tests/deepspeed/cases.py's run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from services.trainer.pool import PooledLearner, TrainingPool
from shared.kernel.config import load_config
from tests.deepspeed.cases import STEPS, case_config, micro_batches
from tests.e2e.conftest import ROOT
from tests.unit.test_swap import _micro_batches
from tests.waits import WAIT_S

pytestmark = pytest.mark.deepspeed


def gang_config(tmp_path: Path, stage: int) -> Path:
    """cases.py's model m (a 2-rank ZeRO group) beside a torch model n, in a pool of two one-core slots."""
    path = case_config(tmp_path, stage=stage, lora=False, kl=False)
    raw = yaml.safe_load(path.read_text())
    raw["models"]["n"] = {"arch": dict(raw["models"]["m"]["arch"]), "optim": {"lr": 0.01, "grad_clip": 1.0}}
    raw["agents"]["verifier"] = {"model": "n"}
    raw["train"]["pool"] = {"slots": 2, "cores": 1, "mode": "warm"}
    path.write_text(yaml.safe_dump(raw))
    return path


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _when(cond, what: str) -> None:  # noqa: ANN001 - a predicate
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.005)


def test_a_gang_waits_for_two_slots_swaps_by_shards_and_survives_its_ranks_killed(tmp_path) -> None:
    config = gang_config(tmp_path, stage=3)  # ZeRO-3: weights, gradients and AdamW all sharded (stage 2 by the run below)
    cfg = load_config(config)
    pool = TrainingPool(cfg)
    try:
        gang, solo = PooledLearner(pool, "m"), PooledLearner(pool, "n")
        assert pool.sched.holding("m") is None and pool.free_cores() == sorted(pool.workers[0].cores
                                                                                + pool.workers[1].cores)
        solo_batches = _micro_batches([None], 2 * STEPS, 8)
        kills = []
        for step in range(STEPS):
            # n holds one slot: the gang waits for both
            solo.micro_batch(solo_batches[2 * step], list(range(8)), "grpo")
            first = micro_batches(cfg, step)[0]
            done: list[float] = []
            t = threading.Thread(target=lambda mb=first, done=done: done.append(gang.micro_batch(mb, list(range(len(mb))),
                                                                                      cfg.train.advantage)))
            t.start()
            _when(lambda: list(pool.sched.waiting) == ["m"], "the gang waiting for its second slot")
            solo.release()
            t.join(WAIT_S)
            assert done and sorted(pool.sched.gang("m")) == [0, 1]
            lead = pool.workers[pool.sched.holding("m")]
            ranks = _children(lead.pid or 0)
            assert len(ranks) == 1, ranks  # rank 1, pinned to the other slot's cores
            assert sorted(os.sched_getaffinity(ranks[0])) == pool.workers[1 - lead.index].cores
            for mb in micro_batches(cfg, step)[1:]:
                if step == 1:  # rank 1 killed while rank 0 records the micro-batch: the step's collective fails
                    os.kill(ranks[0], signal.SIGKILL)
                    kills.append("rank 1")
                gang.micro_batch(mb, list(range(len(mb))), cfg.train.advantage)
            if step == 2:  # rank 0 (the slot's process) killed in the middle of the step
                t = threading.Thread(target=gang.step)
                t.start()
                _when(lambda w=lead: w.calling == "step", "the gang's step")
                time.sleep(0.05)
                os.kill(lead.pid or 0, signal.SIGKILL)
                kills.append("rank 0")
                t.join(WAIT_S)
            else:
                gang.step()
            assert gang.version == step + 1
            gang.release()  # both slots back, its processes gone
            assert pool.sched.holding("m") is None and not lead.alive()
            solo.micro_batch(solo_batches[2 * step + 1], list(range(8)), "grpo")
            solo.step()
            solo.release()
        assert kills == ["rank 1", "rank 0"]
        snap = pool.snapshot()
        assert snap["swap"]["lost"] == 2 and snap["swap"]["replayed"] >= 2, snap["swap"]
        got = gang.named_tensors()
        gang.release()
    finally:
        pool.close()
    out = tmp_path / "reference.pt"
    proc = subprocess.run([sys.executable, "-m", "tests.deepspeed.cases", str(config), str(out), "train"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    want = torch.load(out)
    assert want["version"] == STEPS
    for name, t in want["tensors"].items():
        torch.testing.assert_close(got[name], t, atol=1e-5, rtol=1e-4, msg=name)


GANG_VERSIONS = 8  # the last kill at 4: a killed gang is training fresh samples again about three versions later


async def test_chorus_up_with_a_gang_and_two_torch_models_on_two_slots_loses_nothing_when_a_rank_dies(
        tmp_path, run_id) -> None:
    """`chorus up`: configs/pool-tiny.yaml with three models, the first a 2-rank ZeRO-2 group, on two slots. The
    fault gauntlet SIGKILLs rank 1 of the gang while the gang's slot runs a micro-batch or its step (rank 0 only
    records a micro-batch's samples; the ranks compute them in the step), twice: every model reaches max_versions,
    every sample is trained once or dropped with a reason."""
    from tests.faults.harness import SLOT, Broker, Fault, FaultRun, describe, shipped_fault_config, table

    config = shipped_fault_config(tmp_path, run_id, "pool-tiny", max_versions=GANG_VERSIONS)
    raw = yaml.safe_load(config.read_text())
    del raw["models"]["answer_lm"], raw["agents"]["answerer"]
    raw["workflow"]["agents"] = ["planner", "solver", "checker"]
    # a version's batch in one micro-batch: every tenancy of the gang starts its two ranks afresh (DeepSpeed's
    # process-wide state is not built twice), so fewer tenancies a version are most of this run's time
    raw["train"]["micro_batch"] = raw["train"]["global_batch"]
    raw["models"]["planner_lm"]["trainer"] = {"backend": "deepspeed", "deepspeed": {"ranks": 2, "zero_stage": 2}}
    config.write_text(yaml.safe_dump(raw))
    models = ["planner_lm", "solver_lm", "checker_lm"]
    broker = Broker.single(tmp_path / "nats")
    try:
        fault_run = FaultRun(tmp_path, run_id, broker, config, max_versions=GANG_VERSIONS, models=models, pool=True)
        outcome = await fault_run.run([Fault(SLOT, "kill", 2, model="planner_lm", rank=1),
                                       Fault(SLOT, "kill", 4, model="planner_lm", rank=1)])
    finally:
        broker.stop()
    print(table([("gang rank 1", outcome)]))
    assert not outcome.problems, describe(outcome)
    assert not outcome.unexpected_exits, describe(outcome)
    pool = fault_run.pool_status["pool"]
    assert pool["swap"]["lost"] >= 2, pool  # both calls ran again on a fresh gang
    for r in outcome.reports.values():
        assert r.trained > 0 and r.published > 0
