"""MARFT's advantage normalisation over the whole batch, every agent pooled, where each agent has its own model: the
coordinator normalises a held on-policy batch together (services/coordinator/marft.py) and each model's trainer
steps on exactly its part with those numbers, as the listing normalises its ``[B, n]`` buffer; in async mode a step
normalises its own samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.coordinator.marft import HeldBatch, normalise_batch
from services.trainer.learner import Learner
from shared.kernel.config import ChorusConfig, load_config
from shared.kernel.schemas import Array, Sample
from shared.models.tokenizer import BOS_ID, EOS_ID
from shared.rlmath.losses import POLICY_LOSSES, LossSettings, PolicyBatch
from shared.rlmath.marft import normalise_advantages

AGENTS = {"reasoner": "m1", "actor": "m2"}


def two_models(tmp_path: Path, batch: int = 4, mode: str = "sync") -> ChorusConfig:
    arch = "{hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64, max_position: 64}"
    p = tmp_path / "marft2.yaml"
    p.write_text(
        "run: {id: marft-pooled}\n"
        f"models: {{m1: {{arch: {arch}, optim: {{lr: 0.05}}}}, m2: {{arch: {arch}, optim: {{lr: 0.05}}}}}}\n"
        "agents: {reasoner: {model: m1}, actor: {model: m2}}\n"
        "workflow: {name: chain, agents: [reasoner, actor], rounds: 2, feedback: true, group_size: 2}\n"
        f"train: {{loss: marft, mode: {mode}, max_staleness: 0, global_batch: {batch}, micro_batch: {batch}}}\n"
        "marft: {kl_target: null}\n"
    )
    return load_config(p)


def sample(agent: str, i: int, advantage: float) -> Sample:
    rng = np.random.default_rng(i)
    prompt, resp = [BOS_ID, *rng.integers(32, 127, 3).tolist()], [*rng.integers(32, 127, 2).tolist(), EOS_ID]
    return Sample(run="marft-pooled", episode=f"t{i}/0", sample_id=f"t{i}_{agent}", env_idx=i, rollout_idx=0,
                  agent=agent, model=AGENTS[agent], turn=0 if agent == "reasoner" else 1,
                  prompt_ids=Array.of(prompt, "int32"), response_ids=Array.of(resp, "int32"),
                  behavior_logprobs=Array.of([-1.0] * len(resp), "float32"), reward=0.0,
                  group_key=f"t{i}:{agent}:0", group_size=1, version=0, advantage=advantage)


def test_normalise_batch_pools_every_agent_and_model_and_counts_each_models_samples():
    # the reasoner's GAE advantages sit far above the actor's: pooled, the reasoner's are all positive
    raw = {"reasoner": [2.0, 3.0, 4.0, 0.0], "actor": [-1.0, 0.5, 0.0, 0.25, -0.5]}
    samples = [sample(a, 10 * k + j, v) for k, (a, vs) in enumerate(raw.items()) for j, v in enumerate(vs)]
    normalise_batch(samples, "action")
    pooled = normalise_advantages([*raw["reasoner"], *raw["actor"]])
    assert [s.advantage for s in samples] == pytest.approx(pooled.tolist())
    assert all(s.advantage > 0 for s in samples[:3])  # per model, one reasoner advantage would be negative
    per_model = normalise_advantages(raw["reasoner"])
    assert sum(np.sign(per_model[:3]) != np.sign(pooled[:3])) > 0
    assert [s.batch_samples for s in samples] == [4] * 4 + [5] * 5


def test_held_batch_refuses_an_episode_of_another_batch_while_one_is_held():
    held = HeldBatch()
    ep = type("Ep", (), {"samples": []})()
    held.add(3, ep, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch 4 while batch 3"):
        held.add(4, ep, None)  # type: ignore[arg-type]
    assert held.take("action") == [(ep, None)] and held.batch is None


def test_two_trainers_step_on_their_parts_of_one_pooled_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cfg = two_models(tmp_path)
    raw = {"reasoner": [2.0, 3.0, 4.0, 1.0, 2.5], "actor": [-1.0, 0.5, -0.75, 0.25]}
    samples = [sample(a, 10 * k + j, v) for k, (a, vs) in enumerate(raw.items()) for j, v in enumerate(vs)]
    normalise_batch(samples, "action")  # what the coordinator does with the held batch
    seen: dict[int, list[float]] = {}
    marft = POLICY_LOSSES["marft"]

    def spy(batch: PolicyBatch, s: LossSettings) -> tuple[torch.Tensor, dict[str, float]]:
        seen.setdefault(id(batch.logp), []).extend(batch.advantages.tolist())
        return marft(batch, s)

    monkeypatch.setitem(POLICY_LOSSES, "marft", spy)
    used: dict[str, list[float]] = {}
    for model in ("m1", "m2"):
        learner = Learner(cfg, model)
        mine = [s for s in samples if s.model == model]
        learner.micro_batch(mine[:2], [0, 1], "grpo")
        assert not learner.ready() or len(mine) <= 2  # the batch is larger than its first micro-batch
        learner.micro_batch(mine[2:], list(range(len(mine) - 2)), "grpo")
        assert learner.ready()  # 5 (m1) and 4 (m2) samples: each model's whole part of the batch, global_batch 4
        before = len(seen)
        result = learner.step()
        assert result is not None and result.version == 1 and result.samples == len(mine)
        used[model] = [a for k in list(seen)[before:] for a in seen[k]]
    pooled = normalise_advantages([*raw["reasoner"], *raw["actor"]]).tolist()
    assert sorted(used["m1"] + used["m2"]) == pytest.approx(sorted(pooled), abs=1e-6)
    alone = normalise_advantages(raw["reasoner"]).tolist()
    assert sorted(used["m1"]) != pytest.approx(sorted(alone), abs=1e-3)  # not each model on its own


def test_in_async_mode_a_step_normalises_its_own_samples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    raw = [2.0, 3.0, 4.0, 1.0]
    seen: list[float] = []
    marft = POLICY_LOSSES["marft"]

    def spy(batch: PolicyBatch, s: LossSettings) -> tuple[torch.Tensor, dict[str, float]]:
        seen.extend(batch.advantages.tolist())
        return marft(batch, s)

    monkeypatch.setitem(POLICY_LOSSES, "marft", spy)
    learner = Learner(two_models(tmp_path, mode="async"), "m1")
    learner.micro_batch([sample("reasoner", j, v) for j, v in enumerate(raw)], [0, 1, 2, 3], "grpo")
    assert learner.step() is not None
    assert sorted(seen) == pytest.approx(sorted(normalise_advantages(raw).tolist()), abs=1e-6)
