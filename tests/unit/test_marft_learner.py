"""MARFT's policy step in the torch learner: agent-by-agent updates touch only the selected agent's adapter and
follow (version // interval) % n; a step whose approximate KL is above marft.kl_target is cut, its samples
reported untrained, the weights left as they were and the version moved on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.critic.learner import CriticLearner
from services.trainer.learner import Learner
from shared.kernel.config import ChorusConfig, load_config
from shared.kernel.schemas import Array, Sample
from shared.models.critic import CentralCritic
from shared.models.loading import adapter_of_tensor, load_base
from shared.models.tokenizer import BOS_ID, EOS_ID

AGENTS = ("reasoner", "actor")
ADAPTERS = {"reasoner": "rea", "actor": "act"}


def marft_cfg(tmp_path, *, interval: int = 1, kl_target: float | None = None, variant: str = "action",
              warmup: int = 0, batch: int = 8, kl_level: str = "action") -> ChorusConfig:
    kl = "null" if kl_target is None else repr(kl_target)
    p = tmp_path / "marft.yaml"
    p.write_text(
        "run: {id: marft-learner}\n"
        "models: {m: {arch: {hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64, max_position: 64},"
        " lora: {r: 4, alpha: 8.0, target_modules: [q_proj, v_proj]}, optim: {lr: 0.05, grad_clip: 1.0}}}\n"
        "agents: {reasoner: {model: m, adapter: rea}, actor: {model: m, adapter: act}}\n"
        "workflow: {name: chain, agents: [reasoner, actor], rounds: 2, feedback: true, group_size: 2}\n"
        f"train: {{loss: marft, mode: sync, max_staleness: 0, global_batch: {batch}, micro_batch: {batch}}}\n"
        f"marft: {{variant: {variant}, agent_interval: {interval}, kl_target: {kl}, warmup: {warmup}, "
        f"kl_level: {kl_level}}}\n"
    )
    return load_config(p)


def on_policy(learner: Learner, agent: str, i: int, advantage: float, *, off: float = 0.0) -> Sample:
    """A sample whose behaviour log-probs are the learner's own (plus ``off``), so its KL is 0 unless ``off``."""
    rng = np.random.default_rng(i)
    prompt = [BOS_ID, *rng.integers(32, 127, 3).tolist()]
    resp = [*rng.integers(32, 127, 2).tolist(), EOS_ID]
    ids = torch.tensor([prompt + resp])
    net = learner.net
    with torch.no_grad():
        net.set_adapter(ADAPTERS[agent])  # type: ignore[operator]
        logits = net(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(resp)[:, None])[:, 0] + off
    for p in learner.trainable:  # peft's set_adapter leaves only the active adapter trainable
        p.requires_grad_(True)
    return Sample(run="marft-learner", episode=f"t{i}/0", sample_id=f"t{i}_{AGENTS.index(agent)}_0", env_idx=i,
                  rollout_idx=0, agent=agent, model="m", adapter=ADAPTERS[agent], turn=AGENTS.index(agent),
                  prompt_ids=Array.of(prompt, "int32"), response_ids=Array.of(resp, "int32"),
                  behavior_logprobs=Array.of(lp.tolist(), "float32"), reward=0.0, group_key=f"t{i}:{agent}:0",
                  group_size=1, version=learner.version, advantage=advantage,
                  token_advantages=Array.of([advantage] * len(resp), "float32"))


def batch(learner: Learner, n: int = 8, off: float = 0.0) -> list[Sample]:
    return [on_policy(learner, AGENTS[i % 2], 100 * learner.version + i, 1.0 if i % 4 < 2 else -1.0, off=off)
            for i in range(n)]


def adapters(learner: Learner) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {"rea": {}, "act": {}}
    for name, t in learner.named_tensors().items():
        out[str(adapter_of_tensor(name, ["rea", "act"]))][name] = t.clone()
    return out


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("variant", ["action", "token"])
def test_a_sequential_step_moves_only_the_selected_agents_adapter(tmp_path, variant):
    interval = 2
    learner = Learner(marft_cfg(tmp_path, interval=interval, variant=variant), "m")
    trained = []
    for v in range(6):
        assert learner.version == v
        before = adapters(learner)
        samples = batch(learner)
        learner.micro_batch(samples, list(range(len(samples))), "grpo")
        result = learner.step()
        assert result is not None and not result.skipped and result.version == v + 1
        after = adapters(learner)
        selected = (v // interval) % len(AGENTS)  # MARFT's agent-by-agent schedule
        agent, other = AGENTS[selected], AGENTS[1 - selected]
        assert result.stats["marft_agent"] == selected
        assert changed(before[ADAPTERS[agent]], after[ADAPTERS[agent]]), (v, agent)
        assert all(torch.equal(before[ADAPTERS[other]][k], after[ADAPTERS[other]][k]) for k in before[ADAPTERS[other]])
        # the other agent's samples are in no step: reported untrained, with the reason
        assert sorted(result.untrained["marft_agent"]) == sorted(s.sample_id for s in samples if s.agent == other)
        assert "version" in result.why["marft_agent"]
        trained.append(agent)
    assert trained == ["reasoner", "reasoner", "actor", "actor", "reasoner", "reasoner"]


def test_interval_zero_steps_every_agent_together(tmp_path):
    learner = Learner(marft_cfg(tmp_path, interval=0), "m")
    before = adapters(learner)
    samples = batch(learner)
    learner.micro_batch(samples, list(range(len(samples))), "grpo")
    result = learner.step()
    assert result is not None and result.untrained == {} and result.stats["marft_agent"] == -1
    after = adapters(learner)
    assert changed(before["rea"], after["rea"]) and changed(before["act"], after["act"])


def test_a_step_above_the_kl_target_is_cut_the_version_moves_on_and_the_critic_still_steps(tmp_path):
    learner_cfg = marft_cfg(tmp_path, interval=0, kl_target=0.01)
    learner = Learner(learner_cfg, "m")
    # behaviour log-probs 0.5 nats above the policy's on each of an action's 3 tokens: the action's log rho is
    # -1.5, k3 = e^-1.5 - 1 + 1.5 = 0.723 per action (marft.kl_level token: e^-0.5 - 1 + 0.5 = 0.107 per token)
    before = adapters(learner)
    samples = batch(learner, off=0.5)
    learner.micro_batch(samples, list(range(len(samples))), "grpo")
    result = learner.step()
    assert result is not None and result.version == 1 and not result.skipped
    assert result.stats["kl_cut"] == 1.0
    assert result.stats["approx_kl"] == pytest.approx(np.exp(-1.5) - 1 + 1.5, rel=1e-3)
    assert sorted(result.untrained["kl_cut"]) == sorted(s.sample_id for s in samples)
    assert "marft.kl_target" in result.why["kl_cut"]
    after = adapters(learner)
    assert not changed(before["rea"], after["rea"]) and not changed(before["act"], after["act"])
    assert all(p.grad is None for p in learner.trainable)
    # the critic (its own service, its own learner) takes its step on the same observations all the same
    critic = CriticLearner(CentralCritic(load_base(learner_cfg, "m"), head_sizes=(16,)), lr=1e-2)
    head = {k: t.clone() for k, t in critic.critic.head_state().items()}
    rows = [(s.prompt_ids.numpy().tolist(), [len(s.prompt_ids.numpy()) - 1]) for s in samples]
    features = critic.row_features(rows, pad_id=0)
    step = critic.step_features(features, critic.values_of(features), torch.ones(len(samples)))
    assert step.value_loss > 0 and any(not torch.equal(head[k], t) for k, t in critic.critic.head_state().items())
    # on-policy samples (KL 0) at the next version are trained
    samples = batch(learner)
    learner.micro_batch(samples, list(range(len(samples))), "grpo")
    result = learner.step()
    assert result is not None and result.stats["kl_cut"] == 0.0 and result.stats["approx_kl"] < 1e-6
    assert changed(after["rea"], adapters(learner)["rea"])


def test_the_critic_warm_up_holds_the_policy_still(tmp_path):
    learner = Learner(marft_cfg(tmp_path, interval=0, warmup=2), "m")
    before = adapters(learner)
    for v in range(2):
        samples = batch(learner)
        learner.micro_batch(samples, list(range(len(samples))), "grpo")
        result = learner.step()
        assert result is not None and result.version == v + 1
        assert len(result.untrained["critic_warmup"]) == len(samples)
    assert not changed(before["act"], adapters(learner)["act"])


@pytest.mark.parametrize(("kl_level", "cut"), [("action", True), ("token", False)])
def test_the_cut_reads_the_kl_of_whole_actions_unless_kl_level_is_token(tmp_path, kl_level: str, cut: bool):
    # 0.2 nats per token on 3-token actions: per action log rho = -0.6, k3 = 0.149 (over the 0.1 target); per
    # token k3 = e^-0.2 - 1 + 0.2 = 0.0187 (under it)
    learner = Learner(marft_cfg(tmp_path, interval=0, kl_target=0.1, kl_level=kl_level), "m")
    samples = batch(learner, off=0.2)
    learner.micro_batch(samples, list(range(len(samples))), "grpo")
    result = learner.step()
    assert result is not None and result.stats["kl_cut"] == float(cut)
    expected = np.exp(-0.6) - 1 + 0.6 if kl_level == "action" else np.exp(-0.2) - 1 + 0.2
    assert result.stats["approx_kl"] == pytest.approx(expected, rel=1e-3)
