"""The trainer's learner (torch), checkpoints, and the staleness / duplicate intake, without a broker."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.trainer.intake import SeenIds, StepBook, filter_samples
from services.trainer.learner import Learner, collate, latest_checkpoint, validate_sample
from shared.config import ChorusConfig, load_config
from shared.schemas import Array, Sample
from shared.tokenizer import BOS_ID, EOS_ID


def make_cfg(tmp_path, global_batch: int = 8, temperature: float = 1.0, lr: float = 0.01) -> ChorusConfig:
    p = tmp_path / "c.yaml"
    p.write_text(
        "run: {id: learner}\n"
        "models: {m: {arch: {hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64,"
        f" max_position: 64}}, optim: {{lr: {lr}, grad_clip: 1.0}}}}}}\n"
        "agents: {solver: {model: m}, verifier: {model: m}}\n"
        f"workflow: {{group_size: 2, temperature: {temperature}}}\n"
        f"train: {{global_batch: {global_batch}, micro_batch: 4}}\n"
    )
    return load_config(p)


def make_sample(i: int, *, prompt_len: int = 3, resp_len: int = 4, version: int = 0, reward: float | None = None,
                logprobs: list[float] | None = None, agent: str = "solver") -> Sample:
    rng = np.random.default_rng(i)
    prompt = [BOS_ID, *rng.integers(32, 127, prompt_len - 1).tolist()]
    resp = rng.integers(32, 127, resp_len).tolist()
    if resp:
        resp[-1] = EOS_ID
    lp = logprobs if logprobs is not None else (-rng.random(resp_len) * 4).tolist()
    return Sample(run="r", episode=f"e{i // 2}", sample_id=f"in{i // 2}_0_{i % 2}", env_idx=i // 2, rollout_idx=i % 2,
                  agent=agent, model="m", turn=0, prompt_ids=Array.of(prompt, "int32"),
                  response_ids=Array.of(resp, "int32"), behavior_logprobs=Array.of(lp, "float32"),
                  reward=float(i % 3) if reward is None else reward, group_key=f"g{i // 2}", group_size=2,
                  version=version)


def params(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in learner.named_tensors().items()}


def test_collate_puts_only_response_tokens_in_the_shifted_loss_mask():
    a = make_sample(0, prompt_len=2, resp_len=3)
    b = make_sample(1, prompt_len=4, resp_len=1)
    c = collate([a, b])
    assert c.input_ids.shape == (2, 5)
    assert c.loss_mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    # Shifted targets at the masked positions are exactly the response ids.
    assert c.targets[0][c.loss_mask[0].bool()].tolist() == a.response_ids.tolist()
    assert c.targets[1][c.loss_mask[1].bool()].tolist() == b.response_ids.tolist()
    assert c.logp_behav[0, 1:].tolist() == pytest.approx(a.behavior_logprobs.tolist())
    assert c.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]


def test_on_policy_behaviour_logprobs_give_ratio_one_across_padding(tmp_path):
    cfg = make_cfg(tmp_path, global_batch=4, temperature=0.7)
    learner = Learner(cfg, "m")
    samples = []
    for i, (pl, rl) in enumerate([(2, 5), (4, 2), (3, 3), (6, 1)]):
        s = make_sample(i, prompt_len=pl, resp_len=rl)
        ids = s.prompt_ids.tolist() + s.response_ids.tolist()
        lp = []
        with torch.no_grad():  # score each response token from its own unpadded prefix, the way a sampler does
            for j in range(rl):
                prefix = torch.tensor([ids[: pl + j]])
                logits = learner.net(input_ids=prefix).logits[0, -1] / 0.7
                lp.append(float(torch.log_softmax(logits, -1)[ids[pl + j]]))
        samples.append(s.model_copy(update={"behavior_logprobs": Array.of(lp, "float32")}))
    learner.accumulate(samples, [1.0, -1.0, 0.5, -0.5])
    result = learner.step()
    assert result is not None
    assert result.stats["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert result.stats["clip_frac"] == 0.0


def test_accumulated_micro_batches_make_the_same_step_as_one_full_batch(tmp_path):
    cfg = make_cfg(tmp_path, global_batch=8)
    samples = [make_sample(i, resp_len=2 + i % 3) for i in range(8)]
    adv = [1.0, -1.0, 0.3, -0.3, 0.0, 0.0, 2.0, -2.0]
    full = Learner(cfg, "m")
    micro = Learner(cfg, "m")
    v0 = params(full)
    full.accumulate(samples, adv)
    micro.accumulate(samples[:4], adv[:4])
    assert micro.step() is None  # 4 < global_batch: no step yet
    micro.accumulate(samples[4:], adv[4:])
    g_full, g_micro = full.scaled_gradients(), micro.scaled_gradients()
    assert g_full.keys() == g_micro.keys() and g_full
    for name, g in g_full.items():
        assert torch.allclose(g, g_micro[name], rtol=1e-4, atol=1e-8), name
    r_full, r_micro = full.step(), micro.step()
    assert r_full is not None and r_micro is not None
    assert r_full.version == r_micro.version == 1
    assert r_full.loss == pytest.approx(r_micro.loss, abs=1e-6)
    moved = False
    for name, p in full.named_tensors().items():
        # Adam moves each weight by about lr (1e-2): a wrong step is far outside this tolerance.
        assert torch.allclose(p, micro.named_tensors()[name], atol=1e-4), name
        moved |= not torch.equal(p, v0[name])
    assert moved


def test_a_step_over_more_than_global_batch_is_rescaled_to_the_mean(tmp_path):
    samples = [make_sample(i) for i in range(6)]
    adv = [1.0, -1.0, 0.5, -0.5, 1.5, -1.5]
    over = Learner(make_cfg(tmp_path, global_batch=4), "m")
    exact = Learner(make_cfg(tmp_path, global_batch=6), "m")
    over.accumulate(samples[:3], adv[:3])
    over.accumulate(samples[3:], adv[3:])
    exact.accumulate(samples, adv)
    # Compared before Adam: its per-element normalisation magnifies float rounding in near-zero gradients.
    g_over, g_exact = over.scaled_gradients(), exact.scaled_gradients()
    assert g_over.keys() == g_exact.keys() and g_over
    for name, g in g_over.items():
        assert torch.allclose(g, g_exact[name], rtol=1e-4, atol=1e-8), name
    r_over, r_exact = over.step(), exact.step()
    assert r_over is not None and r_exact is not None and r_over.samples == 6
    assert r_over.loss == pytest.approx(r_exact.loss, abs=1e-6)


def test_checkpoint_round_trip_restores_weights_optimizer_and_version(tmp_path):
    cfg = make_cfg(tmp_path, global_batch=2)
    a = Learner(cfg, "m")
    for k in range(3):
        a.accumulate([make_sample(2 * k), make_sample(2 * k + 1)], [1.0, -1.0])
        a.step()
    a.save_checkpoint(tmp_path / "ck")
    b = Learner(cfg, "m")
    assert b.restore_latest(tmp_path / "ck") == tmp_path / "ck" / "v3.pt"
    assert b.version == 3
    for name, p in a.named_tensors().items():
        assert torch.equal(p, b.named_tensors()[name])
    # Same optimizer state: the next step is identical too.
    for learner in (a, b):
        learner.accumulate([make_sample(10), make_sample(11)], [0.5, -0.5])
        learner.step()
    for name, p in a.named_tensors().items():
        assert torch.allclose(p, b.named_tensors()[name], atol=1e-7)


def test_latest_checkpoint_orders_versions_numerically(tmp_path):
    assert latest_checkpoint(tmp_path / "none") is None
    for v in (2, 9, 10):
        (tmp_path / f"v{v}.pt").write_bytes(b"x")
    (tmp_path / "v11.pt.tmp").write_bytes(b"x")
    assert latest_checkpoint(tmp_path) == tmp_path / "v10.pt"


def test_validate_sample_explains_what_is_wrong():
    assert validate_sample(make_sample(0)) is None
    s = make_sample(0)
    bad_len = s.model_copy(update={"behavior_logprobs": Array.of([-1.0], "float32")})
    assert "behaviour log-probs" in (validate_sample(bad_len) or "")
    bad_ids = s.model_copy(update={"response_ids": Array.of([1, 2, 3, 999], "int32")})
    assert "outside" in (validate_sample(bad_ids) or "")
    no_prompt = s.model_copy(update={"prompt_ids": Array.of([], "int32")})
    assert "empty prompt" in (validate_sample(no_prompt) or "")
    nan = s.model_copy(update={"behavior_logprobs": Array.of([-1.0, float("nan"), -1.0, -1.0], "float32")})
    assert "finite" in (validate_sample(nan) or "")


def test_stale_and_duplicate_samples_are_split_from_the_ones_to_train():
    seen = SeenIds()
    seen.add_all(["in0_0_0"])
    batch = [make_sample(0, version=5), make_sample(1, version=5), make_sample(2, version=2),
             make_sample(3, version=4), make_sample(1, version=5)]
    f = filter_samples(batch, version=5, max_staleness=1, seen=seen)
    assert [s.sample_id for s in f.keep] == ["in0_0_1", "in1_0_1"]
    assert f.keep_idx == [1, 3]
    assert [s.sample_id for s in f.stale] == ["in1_0_0"]
    assert [s.sample_id for s in f.duplicates] == ["in0_0_0", "in0_0_1"]


def test_seen_ids_forget_the_oldest_beyond_capacity():
    seen = SeenIds(capacity=3)
    seen.add_all(["a", "b", "c", "d"])
    assert "a" not in seen and "d" in seen and len(seen) == 3


def test_step_book_summarises_rewards_staleness_and_agents():
    book = StepBook()
    book.add([make_sample(0, version=3, reward=1.0), make_sample(1, version=4, reward=0.0, agent="verifier")], 4)
    book.add([make_sample(2, version=4, reward=1.0)], 4)
    s = book.summary()
    assert s["samples"] == 3
    assert s["reward_mean"] == pytest.approx(2 / 3)
    assert s["reward_std"] == pytest.approx(np.std([1.0, 0.0, 1.0]))
    assert s["staleness_max"] == 1 and s["staleness_mean"] == pytest.approx(1 / 3)
    assert s["agent_reward"] == {"solver": 1.0, "verifier": 0.0}
    assert s["sample_ids"] == ["in0_0_0", "in0_0_1", "in1_0_0"]
