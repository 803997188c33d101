"""MARFT through `chorus up` with a DeepSpeed trainer group: tests/e2e/test_marft.py's tiny run (configs/marft-tiny.yaml,
150 versions) with the actor's model trained by a 2-rank ZeRO-2 group. Its books are kept (every published sample in
exactly one step or drop record of its model, every critic sample in at most one critic step), its steps are
on-policy (no KL, no cut), and the team reward rises as much as the torch run's test asks. That the group's MARFT
loss and weights are the torch learner's on the same batches is test_zero.py's
`test_marfts_step_on_a_two_rank_zero_group_is_the_torch_learners`.

Marked deepspeed (`make test-deepspeed`).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import nats
import pytest
import yaml

from shared.kernel.codec import decode
from shared.kernel.schemas import CriticBatch, Sample
from tests.e2e.conftest import ROOT, assert_books, chorus_up
from tests.e2e.test_marft import MODELS, VERSIONS, fifth_means

pytestmark = [pytest.mark.deepspeed, pytest.mark.e2e]
GROUP = "actor_lm"  # the team reward sits on the actor, the last agent of each round


def marft_deepspeed_config(tmp_path: Path, run_id: str, model: str = GROUP, stage: int = 2) -> Path:
    """configs/marft-tiny.yaml as tests/e2e/test_marft.py runs it, ``model`` trained by a 2-rank ZeRO group."""
    cfg = yaml.safe_load((ROOT / "configs" / "marft-tiny.yaml").read_text())
    cfg["run"] = {"id": run_id, "dir": str(tmp_path / "runs"), "seed": 0}
    cfg.pop("nats", None)
    cfg["train"]["max_versions"] = VERSIONS
    cfg["metrics_interval_s"] = 0.5
    cfg["models"][model]["trainer"] = {"backend": "deepspeed", "deepspeed": {"ranks": 2, "zero_stage": stage}}
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


async def test_the_tiny_marft_run_with_a_zero2_group_on_the_actor_keeps_its_books_and_learns(nats_url, run_id,
                                                                                            tmp_path):
    path = marft_deepspeed_config(tmp_path, run_id)
    ours = f"chorus.{run_id}-"  # `chorus up` appends a timestamp to the run id
    published: dict[str, set[str]] = defaultdict(set)
    critic_published: set[str] = set()
    records: list[dict] = []

    async def on_msg(msg) -> None:
        if not msg.subject.startswith(ours):
            return
        if ".traj." in msg.subject:
            s = decode(Sample, msg.data)
            published[s.model].add(s.sample_id)
        elif msg.subject.endswith(".critic.samples"):
            critic_published.update(s.sample_id for s in decode(CriticBatch, msg.data).samples)
        else:
            records.append(json.loads(msg.data))

    nc = await nats.connect(nats_url)
    await nc.subscribe("chorus.*.traj.*", cb=on_msg)
    await nc.subscribe("chorus.*.critic.samples", cb=on_msg)
    await nc.subscribe("chorus.*.events.*", cb=on_msg)
    code, text = await chorus_up(path, nats_url, 600)  # it ends when both models reach VERSIONS
    await nc.flush()
    await nc.close()
    assert code == 0, text[-4000:]

    run_dir = sorted((tmp_path / "runs").glob(f"{run_id}-*"))[-1]
    # The actor's model was trained by the 2-rank group, the reasoner's by the torch learner.
    group = "".join(p.read_text() for p in (run_dir / "logs").glob(f"trainer-{GROUP}*.log"))
    torch_ = "".join(p.read_text() for p in (run_dir / "logs").glob("trainer-reasoner_lm*.log"))
    assert '"event": "trainer group"' in group and '"ranks": 2' in group, group[-2000:]
    assert '"event": "trainer group"' not in torch_

    # Every published sample is in exactly one step record or one drop record of its model (with its reason) ...
    for m in MODELS:
        assert_books(records, published[m], m, VERSIONS)
    for r in records:
        if r.get("kind") == "drop" and r.get("model") in MODELS:
            assert r.get("reason"), r
    # ... and every critic sample in at most one critic step.
    critic_steps = [r for r in records if r.get("kind") == "critic_step"]
    trained = Counter(sid for r in critic_steps for sid in r["sample_ids"])
    assert trained and max(trained.values()) == 1 and set(trained) <= critic_published
    assert [r["version"] for r in critic_steps] == list(range(1, len(critic_steps) + 1))

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for m in MODELS:
        steps = [r for r in lines if r.get("model") == m and "reward_mean" in r]
        assert len(steps) == VERSIONS, (m, len(steps))
        for r in steps:
            assert {"approx_kl", "kl_cut", "marft_agent", "trained_samples"} <= set(r), sorted(r)
            # on-policy (train.mode sync): the rollouts ran the weights the group shipped, so the k3 KL to their
            # log-probs is 0 up to rounding and no step is cut; both agents train at every step
            assert abs(r["approx_kl"]) < 1e-6 and r["kl_cut"] == 0, (m, r["version"], r["approx_kl"])
            assert r["marft_agent"] == -1 and r["trained_samples"] > 0
    # The team reward (on the actor) rises by at least 0.3, the torch run's criterion.
    steps = [r for r in lines if r.get("model") == GROUP and "reward_mean" in r]
    first, last = fifth_means([r["agent_reward"]["actor"] for r in steps])
    print(f"team reward, first fifth {first:.3f}, last fifth {last:.3f}")
    assert last - first >= 0.3, (first, last)
