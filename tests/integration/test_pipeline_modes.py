"""The trainer service in microbatch mode against a real nats-server: one optimizer step per global batch,
equal to one synchronous full-batch step on the same samples whatever order the micro-batches come in."""

from __future__ import annotations

import asyncio
import itertools

import nats
import torch

from services.trainer.learner import Learner
from shared.kernel.codec import encode
from shared.kernel.schemas import MicroBatch, Sample
from shared.kernel.subjects import Names
from shared.models.weights import load_into
from shared.rlmath.advantages import group_advantages
from tests.integration.test_trainer import MODEL, Watch, fetch_object, group, start, wait_until, write_cfg

KEYS = ["a", "b", "c", "d"]  # four groups of 4 samples: one global batch of 16 in micro-batches of 4


def batch_groups(run_id: str) -> dict[str, list[Sample]]:
    agents = {"a": "solver", "b": "verifier", "c": "solver", "d": "verifier"}
    return {k: group(run_id, k, version=0, agent=agents[k]) for k in KEYS}


def full_batch_step(cfg, samples: list[Sample]) -> dict[str, torch.Tensor]:
    """The synchronous reference: every sample in one accumulate call, then one step."""
    learner = Learner(cfg, MODEL)
    adv = group_advantages([s.reward for s in samples], [s.group_key for s in samples])
    learner.accumulate(samples, adv.tolist())
    assert learner.step() is not None
    return {k: v.clone() for k, v in learner.named_tensors().items()}


async def microbatch_step(nats_url: str, run_id: str, tmp_path, order: list[str]) -> dict[str, torch.Tensor]:
    """Run the trainer service in microbatch mode, feed the groups in ``order``, return the weights of v1."""
    cfg = write_cfg(tmp_path, run_id, mode="microbatch", global_batch=16, micro_batch=4, max_versions=1,
                    checkpoint_every=0)
    names = Names(run_id)
    nc = await nats.connect(nats_url)
    watch = Watch()
    await watch.attach(nc, names)
    svc, task = await start(cfg, nats_url)
    try:
        await wait_until(lambda: watch.announces, what="the v0 announce")
        js = nc.jetstream()
        groups = batch_groups(run_id)
        for i, key in enumerate(order):
            mb = MicroBatch(batch_id=f"{key}", model=MODEL, samples=groups[key])
            await js.publish(names.ready(MODEL), encode(mb), headers={"Nats-Msg-Id": key})
            if i < len(order) - 1:
                # No step until the whole global batch is in: the gradients only accumulate.
                await wait_until(lambda n=i: svc.learner.accumulated == 4 * (n + 1), what="accumulation")
                assert svc.learner.version == 0
        await wait_until(lambda: [a for a in watch.announces if a.version == 1], what="the v1 announce")
        header, body = await fetch_object(js, names, next(a for a in watch.announces if a.version == 1))
        step = watch.kinds("step")[0]
        assert step["samples"] == 16 and step["staleness_max"] == 0
        assert sorted(step["sample_ids"]) == sorted(s.sample_id for g in groups.values() for s in g)
        weights = {k: v.clone() for k, v in Learner(cfg, MODEL).named_tensors().items()}
        load_into(weights, header, body)
        return weights
    finally:
        svc.stop()
        await asyncio.wait_for(task, 30)
        await nc.close()


async def test_microbatch_step_equals_one_full_batch_step_in_any_arrival_order(nats_url, run_id, tmp_path):
    orders = [KEYS, KEYS[::-1], ["c", "a", "d", "b"]]
    assert len({tuple(o) for o in orders}) == 3 and all(sorted(o) == KEYS for o in orders)
    (tmp_path / "ref").mkdir()
    ref_cfg = write_cfg(tmp_path / "ref", run_id, mode="microbatch", global_batch=16, micro_batch=4)
    # The same run id for every run: sample contents (and so the reference) do not depend on it otherwise.
    reference = full_batch_step(ref_cfg, [s for g in batch_groups(run_id).values() for s in g])
    initial = {k: v.clone() for k, v in Learner(ref_cfg, MODEL).named_tensors().items()}
    for n, order in enumerate(orders):
        (tmp_path / f"o{n}").mkdir()
        got = await microbatch_step(nats_url, f"{run_id}o{n}", tmp_path / f"o{n}", order)
        assert got.keys() == reference.keys()
        for name, ref in reference.items():
            # float32; Adam moves each weight by about lr = 1e-2, so a different step is far outside this.
            assert torch.allclose(got[name], ref, atol=1e-5), (order, name, (got[name] - ref).abs().max())
        assert any(not torch.equal(reference[k], initial[k]) for k in reference)


def test_every_order_of_micro_batches_gives_the_full_batch_step(tmp_path):
    """The same property at the learner alone, over all 24 orders of four micro-batches."""
    cfg = write_cfg(tmp_path, "perm", mode="microbatch", global_batch=16, micro_batch=4)
    groups = batch_groups("perm")
    reference = full_batch_step(cfg, [s for g in groups.values() for s in g])
    for order in itertools.permutations(KEYS):
        learner = Learner(cfg, MODEL)
        for key in order:
            g = groups[key]
            learner.accumulate(g, group_advantages([s.reward for s in g], [s.group_key for s in g]).tolist())
        assert learner.step() is not None
        for name, t in learner.named_tensors().items():
            assert torch.allclose(t, reference[name], atol=1e-5), (order, name)
