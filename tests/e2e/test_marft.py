"""MARFT through `chorus up` (configs/marft-tiny.yaml, shortened): a critic service beside the trainers, the
coordinator's GAE, the marft loss. Every published sample is in exactly one step or drop record, the critic's value
loss falls, the team reward rises, and `chorus up` plots the value loss and the KL."""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict

import nats
import pytest
import yaml

from shared.kernel.codec import decode
from shared.kernel.schemas import CriticBatch, Sample
from shared.results.plotting import training_panels
from tests.conftest import ROOT
from tests.e2e.conftest import assert_books, chorus_up

MODELS = ["reasoner_lm", "actor_lm"]
VERSIONS = 150  # configs/marft-tiny.yaml's own: by then the critic has caught up with the policy


def fifth_means(xs: list[float]) -> tuple[float, float]:
    n = max(1, len(xs) // 5)
    return sum(xs[:n]) / n, sum(xs[-n:]) / n


def fifth_medians(xs: list[float]) -> tuple[float, float]:
    n = max(1, len(xs) // 5)
    return statistics.median(xs[:n]), statistics.median(xs[-n:])


@pytest.mark.full  # in make test-long (CI), out of make test's 20 minutes
async def test_the_tiny_marft_run_keeps_its_books_trains_its_critic_and_learns(nats_url, run_id, tmp_path):
    cfg = yaml.safe_load((ROOT / "configs" / "marft-tiny.yaml").read_text())
    cfg["run"] = {"id": run_id, "dir": str(tmp_path / "runs"), "seed": 0}
    cfg.pop("nats", None)
    cfg["train"]["max_versions"] = VERSIONS
    cfg["metrics_interval_s"] = 0.5
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(cfg))

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
    code, text = await chorus_up(path, nats_url, 600)
    await nc.flush()
    await nc.close()
    assert code == 0, text[-4000:]

    # Every published sample is in exactly one step record or one drop record of its model.
    for m in MODELS:
        assert_books(records, published[m], m, VERSIONS)
    # ... and every critic sample in at most one critic step.
    critic_steps = [r for r in records if r.get("kind") == "critic_step"]
    trained = Counter(sid for r in critic_steps for sid in r["sample_ids"])
    assert trained and max(trained.values()) == 1 and set(trained) <= critic_published
    assert [r["version"] for r in critic_steps] == list(range(1, len(critic_steps) + 1))

    run_dir = sorted((tmp_path / "runs").glob(f"{run_id}-*"))[-1]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # The critic learns: over the last fifth of its steps its values explain more of the returns' variance than over
    # the first fifth, and more than their mean does. (Not its value loss: that grows as the policy starts to win
    # and the returns stop being nearly all zero.) Medians, not means: a batch whose returns are nearly all equal has
    # a variance near 0 and one such batch's explained variance (-400 is seen) outweighs sixty steps near 0.9.
    explained = [r["explained_variance"] for r in lines if r.get("kind") == "critic_step"]
    first, last = fifth_medians(explained)
    assert last > max(first, 0.0), (first, last)
    # The team reward (it sits on the actor, the last agent of each round) rises by at least 0.3.
    steps = [r for r in lines if r.get("model") == "actor_lm" and "reward_mean" in r]
    assert len(steps) == VERSIONS
    first, last = fifth_means([r["agent_reward"]["actor"] for r in steps])
    assert last - first >= 0.3, (first, last)
    for r in steps:
        assert {"approx_kl", "kl_cut", "marft_agent", "trained_samples"} <= set(r), sorted(r)
        # on-policy (train.mode sync): the k3 KL to the rollout's log-probs is 0 up to rounding, and no step is cut
        assert abs(r["approx_kl"]) < 1e-6 and r["kl_cut"] == 0
        assert r["marft_agent"] == -1  # marft.agent_interval 0: both agents each step
    # `chorus up` drew the critic's value loss and the KL.
    titles = [t for t, _ in training_panels(run_dir / "metrics.jsonl")]
    assert "MARFT critic: value loss (x: critic version)" in titles and "KL estimates (token mean)" in titles
    assert (run_dir / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
