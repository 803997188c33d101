"""Non-finite numbers published into a running `chorus up` run: rejected sample by sample, weights stay finite."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import nats
import numpy as np

from shared.kernel.bus import read_object
from shared.kernel.codec import decode, encode
from shared.kernel.schemas import MicroBatch, Sample, WeightsAnnounce
from shared.kernel.subjects import Names
from shared.models.weights import unpack
from tests.e2e.conftest import UP_BACKSTOP_S, small_run_config

CHORUS = str(Path(sys.executable).parent / "chorus")
MODELS = ["solver_lm", "verifier_lm"]
MODEL = "solver_lm"
VERSIONS = 12


def forged(real: Sample, task: str, i: int, version: int, **update: object) -> Sample:
    """A copy of a real sample of the run as member ``i`` of group ``task``: valid unless ``update`` spoils it."""
    return real.model_copy(update={"sample_id": Sample.make_id(task, real.turn, i), "rollout_idx": i,
                                   "group_key": f"{task}:{real.agent}:{real.turn}", "episode": f"{task}/{i}",
                                   "version": version, "reward": float(i % 2), "advantage": None, **update})


def finite_weights(header, body: memoryview) -> bool:
    for slot in header.slots:
        values = np.frombuffer(body[slot.offset:slot.offset + slot.nbytes], dtype=np.dtype(slot.dtype))
        if not np.isfinite(values).all():
            return False
    return True


async def test_nan_reward_and_inf_advantage_go_to_the_dlq_and_the_rest_trains(nats_url, run_id, tmp_path):
    cfg = small_run_config(tmp_path, run_id, max_versions=VERSIONS)
    ours = f"chorus.{run_id}-"
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    real: list[Sample] = []
    steps: list[dict] = []
    dlq: dict[str, list[tuple[str, str]]] = {"mq": [], "trainer": []}

    async def on_msg(msg) -> None:
        if not msg.subject.startswith(ours):
            return
        if ".traj." in msg.subject:
            s = decode(Sample, msg.data)
            if s.model == MODEL:
                real.append(s)
        elif ".dlq." in msg.subject:
            dlq[msg.subject.rsplit(".", 1)[-1]].append((msg.headers["Chorus-Reason"], msg.headers["Chorus-Subject"]))
        else:
            ev = json.loads(msg.data)
            if ev.get("kind") == "step" and ev.get("model") == MODEL:
                steps.append(ev)

    for subject in ("chorus.*.traj.*", "chorus.*.events.trainer", "chorus.*.dlq.*"):
        await nc.subscribe(subject, cb=on_msg)
    env = {**os.environ, "CHORUS_NATS__URL": nats_url}
    proc = await asyncio.create_subprocess_exec(CHORUS, "up", str(cfg), "--timeout-s", str(UP_BACKSTOP_S), env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    reader = asyncio.create_task(proc.communicate())
    try:
        async with asyncio.timeout(120):
            while not steps or not real:
                await asyncio.sleep(0.2)
        run = real[0].run
        names = Names(run)
        version = max(s["version"] for s in steps)
        base = real[-1]
        # One sample with a NaN reward straight into mq's intake ...
        await js.publish(names.traj(MODEL), encode(forged(base, "nanmq", 0, version, reward=float("nan"))))
        # ... and a micro-batch on the trainer's own subject: a NaN reward, an inf advantage, four good samples.
        batch = [forged(base, "inj", i, version) for i in range(6)]
        batch[1] = batch[1].model_copy(update={"reward": float("nan")})
        batch[4] = batch[4].model_copy(update={"advantage": float("inf")})
        good = {batch[i].sample_id for i in (0, 2, 3, 5)}
        await js.publish(names.ready(MODEL), encode(MicroBatch(batch_id="injected", model=MODEL, samples=batch)))
        out, _ = await reader
    finally:
        if proc.returncode is None:
            proc.kill()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]  # the run completes

    (mq_reason, mq_subject), = dlq["mq"]
    assert "sample nanmq_" in mq_reason and "reward nan is not a finite number" in mq_reason
    assert mq_subject == names.traj(MODEL)
    reasons = sorted(r for r, _ in dlq["trainer"])
    assert len(reasons) == 2, reasons
    assert f"sample {batch[1].sample_id}: reward nan is not a finite number" in reasons[0] + reasons[1]
    assert f"sample {batch[4].sample_id}: advantage inf is not a finite number" in reasons[0] + reasons[1]
    trained = {sid for s in steps for sid in s["sample_ids"]}
    assert good <= trained, (good - trained)  # the rest of their micro-batch trained
    assert not {batch[1].sample_id, batch[4].sample_id} & trained
    assert max(s["version"] for s in steps) == VERSIONS

    # Every weight of both models' last committed version is finite.
    kv = await js.key_value(names.kv_bucket)
    for m in MODELS:
        ann = decode(WeightsAnnounce, (await kv.get(Names.weights_key(m))).value)
        assert ann.version == VERSIONS
        header, body = unpack(await read_object(js, names.obj_bucket, ann.object_name))
        assert finite_weights(header, body), m
    await nc.close()
