"""The training pool's slots as real worker processes (no broker: the trainer service is tested end to end in
tests/e2e/test_training_pool.py): models swapping in and out of one slot, a slot SIGKILLed in the middle of a
micro-batch, and suspend-to-destroy, each training bit for bit as a learner that never left its process."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from services.trainer.learner import Learner
from services.trainer.pool import PooledLearner, TrainingPool
from shared.kernel.config import ChorusConfig, load_config
from tests.unit.test_swap import _micro_batches
from tests.waits import WAIT_S

ARCH = "{hidden_size: 64, num_layers: 2, num_heads: 4, intermediate_size: 128, max_position: 128}"


def pool_cfg(tmp_path: Path, slots: int, mode: str = "warm", lora: bool = False) -> ChorusConfig:
    p = tmp_path / "pool.yaml"
    lora_m = ", lora: {r: 4}" if lora else ""
    p.write_text(
        f"run: {{id: pool, dir: {tmp_path / 'runs'}}}\n"
        f"models: {{m: {{arch: {ARCH}{lora_m}, optim: {{lr: 0.01, grad_clip: 1.0}}}},"
        f" n: {{arch: {ARCH}, optim: {{lr: 0.01, grad_clip: 1.0}}}}}}\n"
        "agents: {solver: {model: m" + (", adapter: sol" if lora else "") + "}, verifier: {model: n}}\n"
        "workflow: {group_size: 2}\n"
        f"train: {{global_batch: 16, micro_batch: 8, pool: {{slots: {slots}, mode: {mode}, cores: 1}}}}\n")
    return load_config(p)


def _state(learner) -> dict[str, torch.Tensor]:
    sd = learner.state_dict()
    out = {f"w/{k}": v for k, v in sd["model"].items()}
    for i, st in sd["optimizer"]["state"].items():
        for k, v in st.items():
            out[f"o/{i}/{k}"] = v
    return out


def _kill_mid_call(pool: TrainingPool, slot: int, call: str) -> bool:
    """SIGKILL ``slot``'s worker while it is inside ``call`` (frozen first, and killed only if it has not
    answered yet); False if the call ended before it could be caught."""
    deadline = time.monotonic() + WAIT_S
    worker = pool.workers[slot]
    while worker.calling != call:
        if time.monotonic() > deadline:
            raise AssertionError(f"slot {slot} never ran {call}")
        time.sleep(0.001)
    pid = worker.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    if worker.conn is not None and worker.conn.poll():  # it answered before it froze: not mid-call
        os.kill(pid, signal.SIGCONT)
        return False
    os.kill(pid, signal.SIGKILL)
    return True


def _reference(cfg: ChorusConfig, model: str, start: dict, batches: list) -> Learner:
    torch.set_num_threads(1)
    ref = Learner(cfg, model)
    ref.load_state_dict(start)
    for mb in batches:
        ref.micro_batch(mb, list(range(len(mb))), "grpo")
        ref.step()
    return ref


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_models_on_one_slot_and_a_slot_killed_mid_micro_batch_train_as_if_nothing_moved(tmp_path, lora):
    cfg = pool_cfg(tmp_path, slots=1, lora=lora)
    pool = TrainingPool(cfg)
    try:
        a, b = PooledLearner(pool, "m"), PooledLearner(pool, "n")
        start_a = a.state_dict()
        a.release()
        start_b = b.state_dict()
        b.release()
        adapters = list(cfg.adapters_of("m")) if lora else [None]
        batches_a = _micro_batches(adapters, 6, 8)
        batches_b = _micro_batches([None], 6, 8)
        killed = 0
        for k in range(3):  # a: two micro-batches and a step without letting go of the slot; then b takes it
            for j in (0, 1):
                ma = batches_a[2 * k + j]
                if k == 1 and j == 1:  # kill the slot inside a's second micro-batch: the first is only in the slot
                    done: list[float] = []
                    t = threading.Thread(target=lambda ma=ma, done=done: done.append(
                        a.micro_batch(ma, list(range(8)), "grpo")))
                    t.start()
                    killed += _kill_mid_call(pool, 0, "micro_batch")
                    t.join(timeout=WAIT_S)
                    assert done, "the micro-batch never came back"
                else:
                    a.micro_batch(ma, list(range(8)), "grpo")
            a.step()
            a.release()
            for j in (0, 1):
                b.micro_batch(batches_b[2 * k + j], list(range(8)), "grpo")
                b.release()  # b lets go after each micro-batch: its state is set, and got back
            b.step()
            b.release()
        assert killed == 1
        assert a.version == b.version == 3
        snap = pool.snapshot()
        assert snap["swap"]["lost"] == 1 and snap["slots"][0]["starts"] == 2, snap
        assert snap["swap"]["replayed"] == 1, snap  # a's first micro-batch ran again on the fresh slot
        assert snap["swap"]["gets"] >= 9 and snap["swap"]["sets"] >= 2 + 3 + 9, snap
        got_a = _state(a)
        a.release()
        got_b = _state(b)
        b.release()
    finally:
        pool.close()
    for got, model, start, batches in ((got_a, "m", start_a, batches_a), (got_b, "n", start_b, batches_b)):
        want = _state(_reference(cfg, model, start, batches))
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (model, k)


def test_suspend_to_destroy_ends_the_slot_process_at_every_release(tmp_path):
    cfg = pool_cfg(tmp_path, slots=2, mode="destroy")
    pool = TrainingPool(cfg)
    try:
        a = PooledLearner(pool, "m")
        assert pool.snapshot()["slots"][0]["pid"] is None  # released after its first state was stored
        batches = _micro_batches([None], 2, 8)  # one global batch: two micro-batches and the step
        pids = []
        for mb in batches:
            a.micro_batch(mb, list(range(8)), "grpo")
            pids.append(pool.snapshot()["slots"][0]["pid"])
            a.step()
            a.release()
            assert pool.snapshot()["slots"][0]["pid"] is None
        assert len(set(pids)) == len(pids)  # a fresh process each time
        snap = pool.snapshot()
        assert snap["swap"]["starts"] >= 3 and snap["swap"]["control_s"] > 0 and snap["swap"]["gets"] >= 2
        got = _state(a)
        a.release()
    finally:
        pool.close()
    want = _state(_reference(cfg, "m", Learner(cfg, "m").state_dict(), batches))  # a model's build is seeded
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_states_beyond_the_budget_spill_to_the_run_directory(tmp_path):
    cfg = pool_cfg(tmp_path, slots=1)
    pool = TrainingPool(cfg, budget_bytes=0)
    try:
        a = PooledLearner(pool, "m")
        a.micro_batch(_micro_batches([None], 1, 8)[0], list(range(8)), "grpo")
        a.release()
        snap = pool.snapshot()
        assert snap["resident_bytes"] == 0 and snap["spilled_bytes"] > 0
        assert list((tmp_path / "runs").glob("pool/pool/spill/m.*.state")) or list(
            (cfg.run_dir / "pool" / "spill").glob("m.*.state"))
    finally:
        pool.close()
