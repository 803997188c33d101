"""The trainer's learner (torch), checkpoints, and the staleness / duplicate intake, without a broker."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.trainer.intake import SeenIds, StepBook, filter_samples
from services.trainer.learner import Learner, collate, latest_checkpoint, validate_sample
from shared.kernel.config import ChorusConfig, load_config
from shared.kernel.schemas import Array, Sample
from shared.models.loading import adapter_of_tensor
from shared.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE


def make_cfg(tmp_path, global_batch: int = 8, temperature: float = 1.0, lr: float = 0.01,
             train_extra: str = "") -> ChorusConfig:
    p = tmp_path / "c.yaml"
    p.write_text(
        "run: {id: learner}\n"
        "models: {m: {arch: {hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64,"
        f" max_position: 64}}, optim: {{lr: {lr}, grad_clip: 1.0}}}}}}\n"
        "agents: {solver: {model: m}, verifier: {model: m}}\n"
        f"workflow: {{group_size: 2, temperature: {temperature}}}\n"
        f"train: {{global_batch: {global_batch}, micro_batch: 4{train_extra}}}\n"
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
    c = collate([a, b], PAD_ID)
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


@pytest.mark.parametrize("loss", ["ppo_clip", "decoupled"])
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
def test_every_loss_and_aggregation_accumulates_to_the_full_batch_step(tmp_path, loss: str, agg: str):
    cfg = make_cfg(tmp_path, global_batch=8, train_extra=f", loss: {loss}, loss_agg: {agg}")
    samples = [make_sample(i, resp_len=2 + 2 * (i % 3)) for i in range(8)]  # 2 to 6 tokens: token-mean differs
    adv = [1.0, -1.0, 0.3, -0.3, 0.5, 0.1, 2.0, -2.0]
    full, micro = Learner(cfg, "m"), Learner(cfg, "m")
    full.accumulate(samples, adv)
    micro.accumulate(samples[:3], adv[:3])
    micro.accumulate(samples[3:], adv[3:])
    g_full, g_micro = full.scaled_gradients(), micro.scaled_gradients()
    for name, g in g_full.items():
        assert torch.allclose(g, g_micro[name], rtol=1e-4, atol=1e-8), name
    r_full, r_micro = full.step(), micro.step()
    assert r_full.loss == pytest.approx(r_micro.loss, abs=1e-6)
    tokens = sum(s.response_ids.shape[0] for s in samples)
    assert r_full.stats["tokens"] == r_micro.stats["tokens"] == tokens
    for key in ("clip_frac", "dual_clip_frac", "approx_kl_mu", "is_weight_mean", "is_weight_max"):
        assert key in r_full.stats and r_full.stats[key] == pytest.approx(r_micro.stats[key], abs=1e-5), key
    if loss == "decoupled":  # pi_prox is the learner's own policy: ratio 1, nothing clipped
        assert r_full.stats["approx_kl_prox"] == pytest.approx(0.0, abs=1e-6) and r_full.stats["clip_frac"] == 0.0


def test_token_mean_weighs_every_token_and_seq_means_weigh_every_sample(tmp_path):
    """Two samples with the same per-token advantage sign but 2 and 6 tokens: the reported loss is the mean over
    the batch's tokens (token-mean) or over its samples (the seq-mean modes), as recomputed here."""
    samples = [make_sample(0, resp_len=2), make_sample(1, resp_len=6)]
    adv = [1.0, 0.5]
    per_sample_sum, per_sample_tokens = [], []
    ref = Learner(make_cfg(tmp_path, global_batch=2), "m")
    for s, a in zip(samples, adv, strict=True):
        batch = collate([s], ref.pad_id)
        with torch.no_grad():
            logp = ref.token_logprobs(batch)
        ratio = torch.exp(logp - batch.logp_behav).clamp(max=1.2) if a > 0 else None
        per_token = -a * torch.minimum(torch.exp(logp - batch.logp_behav), ratio) * batch.loss_mask
        per_sample_sum.append(float(per_token.sum()))
        per_sample_tokens.append(float(batch.loss_mask.sum()))
    expected = {
        "token-mean": sum(per_sample_sum) / sum(per_sample_tokens),
        "seq-mean-token-sum": sum(per_sample_sum) / 2,
        "seq-mean-token-mean": sum(x / n for x, n in zip(per_sample_sum, per_sample_tokens, strict=True)) / 2,
    }
    for agg, value in expected.items():
        learner = Learner(make_cfg(tmp_path, global_batch=2, train_extra=f", loss_agg: {agg}"), "m")
        learner.accumulate(samples, adv)
        assert learner.step().loss == pytest.approx(value, rel=1e-4), agg
    assert len({round(v, 5) for v in expected.values()}) == 3  # the three modes really differ here


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
    def check(s: Sample) -> str | None:
        return validate_sample(s, VOCAB_SIZE, None)

    assert check(make_sample(0)) is None
    s = make_sample(0)
    bad_len = s.model_copy(update={"behavior_logprobs": Array.of([-1.0], "float32")})
    assert "behaviour log-probs" in (check(bad_len) or "")
    bad_ids = s.model_copy(update={"response_ids": Array.of([1, 2, 3, 999], "int32")})
    assert "outside" in (check(bad_ids) or "")
    no_prompt = s.model_copy(update={"prompt_ids": Array.of([], "int32")})
    assert "empty prompt" in (check(no_prompt) or "")
    nan = s.model_copy(update={"behavior_logprobs": Array.of([-1.0, float("nan"), -1.0, -1.0], "float32")})
    assert "finite" in (check(nan) or "")


def make_lora_cfg(tmp_path, global_batch: int = 4) -> ChorusConfig:
    p = tmp_path / "lora.yaml"
    p.write_text(
        "run: {id: lora}\n"
        "models: {m: {arch: {hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64,"
        " max_position: 64}, lora: {r: 4}, optim: {lr: 0.01}}}\n"
        "agents: {solver: {model: m, adapter: sol}, verifier: {model: m, adapter: ver}}\n"
        f"workflow: {{group_size: 2}}\n"
        f"train: {{global_batch: {global_batch}, micro_batch: 4}}\n"
    )
    return load_config(p)


def with_adapter(s: Sample, adapter: str | None) -> Sample:
    """``s`` for ``adapter``, with behaviour log-probs near a fresh model's (ratios near 1, so no row is clipped)."""
    uniform = Array.of([-float(np.log(VOCAB_SIZE))] * s.response_ids.shape[0], "float32")
    return s.model_copy(update={"adapter": adapter, "behavior_logprobs": uniform})


def all_params(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.net.named_parameters()}


def test_pad_id_never_changes_the_log_probs_of_real_tokens(tmp_path):
    learner = Learner(make_cfg(tmp_path), "m")
    samples = [make_sample(0, prompt_len=2, resp_len=5), make_sample(1, prompt_len=3, resp_len=1)]
    a, b = collate(samples, PAD_ID), collate(samples, 7)
    assert int(b.input_ids[1, -1]) == 7 and int(a.input_ids[1, -1]) == PAD_ID
    with torch.no_grad():
        la, lb = learner.token_logprobs(a), learner.token_logprobs(b)
    assert torch.allclose(la * a.loss_mask, lb * b.loss_mask, atol=1e-6)


def test_a_lora_learner_optimises_only_the_adapters_and_ships_only_them(tmp_path):
    learner = Learner(make_lora_cfg(tmp_path), "m")
    optimised = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    adapter_params = {id(p) for k, p in learner.net.named_parameters() if "lora_" in k}
    assert optimised == adapter_params and optimised
    shipped = learner.named_tensors()
    assert shipped and all("lora_" in k for k in shipped)
    assert {adapter_of_tensor(k, ["sol", "ver"]) for k in shipped} == {"sol", "ver"}
    assert sum(t.numel() for t in shipped.values()) < sum(p.numel() for p in learner.net.parameters()) / 10


def test_one_step_on_a_mixed_batch_trains_both_adapters_and_leaves_the_base_bit_identical(tmp_path):
    learner = Learner(make_lora_cfg(tmp_path), "m")
    before = all_params(learner)
    batch = [with_adapter(make_sample(i), "sol" if i % 2 else "ver") for i in range(4)]
    learner.accumulate(batch, [1.0, -1.0, 0.5, -0.5])
    result = learner.step()
    assert result is not None and result.version == 1
    changed = {k for k, p in learner.net.named_parameters() if not torch.equal(p, before[k])}
    assert {adapter_of_tensor(k, ["sol", "ver"]) for k in changed} == {"sol", "ver"}
    base = [k for k in before if "lora_" not in k]
    assert base and all(torch.equal(dict(learner.net.named_parameters())[k], before[k]) for k in base)


def test_an_adapter_without_rows_in_the_step_is_left_exactly_as_it_was(tmp_path):
    learner = Learner(make_lora_cfg(tmp_path, global_batch=2), "m")
    before = all_params(learner)
    learner.accumulate([with_adapter(make_sample(i), "sol") for i in range(2)], [1.0, -1.0])
    assert learner.step() is not None
    now = dict(learner.net.named_parameters())
    ver = [k for k in before if adapter_of_tensor(k, ["sol", "ver"]) == "ver"]
    assert ver and all(torch.equal(now[k], before[k]) for k in ver)
    assert any(not torch.equal(now[k], before[k]) for k in before if adapter_of_tensor(k, ["sol"]) == "sol")


def test_with_a_kl_term_every_adapter_keeps_training_after_the_first_reference_forward(tmp_path):
    # the KL reference is the base with the adapters disabled; re-enabling them must leave all of them trainable
    cfg = make_lora_cfg(tmp_path, global_batch=4)
    cfg.train.kl_coef, cfg.train.kl_in = 0.1, "loss"
    learner = Learner(cfg, "m")
    for step in range(3):
        before = all_params(learner)
        batch = [with_adapter(make_sample(4 * step + i, resp_len=2 + i % 3), ("sol", "ver")[i % 2]) for i in range(4)]
        learner.accumulate(batch, [1.0, 0.5, -1.0, -0.5])
        assert learner.step() is not None
        now = dict(learner.net.named_parameters())
        for adapter in ("sol", "ver"):
            mine = [k for k in before if adapter_of_tensor(k, ["sol", "ver"]) == adapter]
            assert any(not torch.equal(now[k], before[k]) for k in mine), (step, adapter)


def test_a_mixed_batch_makes_the_same_step_as_one_batch_per_adapter(tmp_path):
    cfg = make_lora_cfg(tmp_path, global_batch=4)
    batch = [with_adapter(make_sample(i, resp_len=2 + i % 3), "sol" if i < 2 else "ver") for i in range(4)]
    adv = [1.0, -1.0, 0.7, -0.7]
    mixed, split = Learner(cfg, "m"), Learner(cfg, "m")
    mixed.accumulate(batch, adv)
    split.accumulate(batch[:2], adv[:2])
    split.accumulate(batch[2:], adv[2:])
    g_mixed, g_split = mixed.scaled_gradients(), split.scaled_gradients()
    assert g_mixed.keys() == g_split.keys()
    assert {adapter_of_tensor(k, ["sol", "ver"]) for k, g in g_mixed.items() if bool(g.any())} == {"sol", "ver"}
    for name, g in g_mixed.items():
        assert torch.allclose(g, g_split[name], rtol=1e-4, atol=1e-8), name


def test_samples_must_name_one_of_the_models_adapters(tmp_path):
    learner = Learner(make_lora_cfg(tmp_path), "m")
    assert learner.validate(with_adapter(make_sample(0), "sol")) is None
    assert "not one of the model's adapters ['sol', 'ver']" in (learner.validate(with_adapter(make_sample(0), "x")) or "")
    assert "base of a LoRA model is frozen" in (learner.validate(make_sample(0)) or "")
    full = Learner(make_cfg(tmp_path), "m")
    assert "no LoRA adapters" in (full.validate(with_adapter(make_sample(0), "sol")) or "")
    with pytest.raises(ValueError, match=r"adapters \['x'\]"):
        learner.accumulate([with_adapter(make_sample(0), "x")], [1.0])


def test_a_lora_checkpoint_holds_only_adapters_and_restores_the_next_step_exactly(tmp_path):
    cfg = make_lora_cfg(tmp_path, global_batch=2)
    a = Learner(cfg, "m")
    a.accumulate([with_adapter(make_sample(0), "sol"), with_adapter(make_sample(1), "ver")], [1.0, -1.0])
    a.step()
    path = a.save_checkpoint(tmp_path / "ck")
    saved = torch.load(path, weights_only=True)
    assert set(saved["model"]) == set(a.named_tensors())
    b = Learner(cfg, "m")
    b.restore_latest(tmp_path / "ck")
    assert b.version == 1
    for learner in (a, b):
        learner.accumulate([with_adapter(make_sample(2), "ver"), with_adapter(make_sample(3), "sol")], [0.5, -0.5])
        learner.step()
    for name, p in a.named_tensors().items():
        assert torch.equal(p, b.named_tensors()[name]), name
    with pytest.raises(ValueError, match="does not match model"):
        Learner(make_cfg(tmp_path, global_batch=2), "m").load_state_dict(saved)


def test_stale_and_duplicate_samples_are_split_from_the_ones_to_train():
    seen = SeenIds(capacity=100)
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


def test_a_step_whose_gradient_norm_is_not_finite_is_skipped_and_keeps_the_weights(tmp_path):
    learner = Learner(make_cfg(tmp_path, global_batch=4), "m")
    before = params(learner)
    samples = [make_sample(i) for i in range(4)]
    # Finite advantages that overflow float32 in the loss: the gradient norm is inf or nan.
    learner.accumulate(samples, [3e38, -3e38, 3e38, -3e38])
    result = learner.step()
    assert result is not None and result.skipped and not np.isfinite(result.grad_norm)
    assert learner.version == 0 and learner.accumulated == 0
    after = params(learner)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in learner.trainable)
    # The next (sane) step trains as usual.
    learner.accumulate(samples, [1.0, -1.0, 0.5, -0.5])
    result = learner.step()
    assert result is not None and not result.skipped and learner.version == 1
    assert all(torch.isfinite(t).all() for t in learner.named_tensors().values())


@pytest.mark.parametrize(("field", "value", "why"), [
    ("reward", float("nan"), "reward nan is not a finite number"),
    ("reward", float("inf"), "reward inf is not a finite number"),
    ("advantage", float("-inf"), "advantage -inf is not a finite number"),
])
def test_non_finite_rewards_and_advantages_are_not_trainable(field, value, why):
    s = make_sample(0).model_copy(update={field: value})
    assert why in (validate_sample(s, VOCAB_SIZE, None) or "")


def test_reinforce_pp_holds_the_micro_batches_and_trains_on_batch_whitened_returns(tmp_path):
    from shared.rlmath.advantages import batch_advantages

    cfg = make_cfg(tmp_path, global_batch=8, train_extra=", advantage: reinforce_pp")
    samples = [make_sample(i, resp_len=2 + i % 3) for i in range(8)]
    held = Learner(cfg, "m")
    assert held.batch_level
    assert held.hold(samples[:4]) == 0.0 and held.step() is None  # 4 of 8: nothing runs yet
    assert all(p.grad is None for p in held.net.parameters())
    held.hold(samples[4:])
    # the same as accumulating the whole batch at once with the advantages whitened over its tokens
    ref = Learner(make_cfg(tmp_path, global_batch=8), "m")
    adv = batch_advantages([s.reward for s in samples], [s.response_ids.shape[0] for s in samples])
    ref.accumulate(samples, adv.tolist())
    g_held, g_ref = held.scaled_gradients(), ref.scaled_gradients()
    for name, g in g_ref.items():
        assert torch.allclose(g, g_held[name], rtol=1e-4, atol=1e-8), name
    r = held.step()
    assert r is not None and r.version == 1 and r.samples == 8


def _response_entropy(learner: Learner, samples: list[Sample]) -> float:
    """Token mean of -sum_v p log p at the response positions, from a plain forward of the whole model."""
    batch = collate(samples, learner.pad_id)
    with torch.no_grad():
        logits = learner.net(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
        logp = torch.log_softmax(logits / learner.temperature, dim=-1)
        h = -(logp.exp() * logp).sum(-1)
    return float((h * batch.loss_mask).sum() / batch.loss_mask.sum())


def test_the_entropy_is_logged_and_its_bonus_alone_raises_it(tmp_path):
    samples = [make_sample(i, resp_len=3 + i % 2) for i in range(4)]
    # A uniform policy over V tokens has entropy log V: the random tiny model is close to it, but not at it.
    plain = Learner(make_cfg(tmp_path, global_batch=4, temperature=0.7), "m")
    before = _response_entropy(plain, samples)
    plain.accumulate(samples, [1.0, -1.0, 0.5, -0.5])
    r = plain.step()
    assert r.stats["entropy"] == pytest.approx(before, rel=1e-4) and 0 < before < math.log(VOCAB_SIZE)
    # advantages 0: the policy term has no gradient, only the bonus moves the weights, towards more entropy
    bonus = Learner(make_cfg(tmp_path, global_batch=4, temperature=0.7, lr=1e-4,
                             train_extra=", entropy_coef: 0.1"), "m")
    start = _response_entropy(bonus, samples)
    bonus.accumulate(samples, [0.0] * 4)
    r = bonus.step()
    assert r.loss == pytest.approx(-0.1 * start, rel=1e-4)  # seq-mean-token-mean of H, times -c
    assert r.grad_norm > 0 and _response_entropy(bonus, samples) > start


def _logprobs(learner: Learner, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = collate(samples, learner.pad_id)
    with torch.no_grad():
        return learner.token_logprobs(batch), batch.loss_mask


def test_kl_in_the_loss_pulls_the_policy_back_to_a_frozen_copy_of_its_start(tmp_path):
    from shared.rlmath.losses import kl_estimate

    samples = [make_sample(i, resp_len=3 + i % 2) for i in range(4)]
    learner = Learner(make_cfg(tmp_path, global_batch=4, train_extra=", kl_coef: 0.5, kl_estimator: k3"), "m")
    assert learner.reference is not None and learner.reference.net is not learner.net
    start = params(learner)
    start_logp, mask = _logprobs(learner, samples)
    learner.accumulate(samples, [1.0, -1.0, 0.5, -0.5])
    first = learner.step()
    assert first.stats["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # pi_theta = pi_ref before the first step
    # the reference stays the starting weights; the policy has moved
    ref_params = dict(learner.reference.net.named_parameters())
    assert all(torch.equal(ref_params[k], v) for k, v in start.items())
    assert any(not torch.equal(v, start[k]) for k, v in params(learner).items())
    # advantages 0: only beta * seq-mean-token-mean(k3(pi_theta, pi_ref)) is left: its gradient is the one of that
    # formula, and a small step along it brings pi_theta back towards the start
    batch = collate(samples, learner.pad_id)
    logp = learner.token_logprobs(batch)
    k3 = kl_estimate(logp, start_logp, "k3") * mask
    by_hand = 0.5 * (k3.sum(1) / mask.sum(1)).sum() / 4
    names = [n for n, q in learner.net.named_parameters() if q.requires_grad]
    expected = dict(zip(names, torch.autograd.grad(by_hand, [learner.net.get_parameter(n) for n in names]),
                        strict=True))
    learner.accumulate(samples, [0.0] * 4)
    grads = learner.scaled_gradients()
    for name, g in expected.items():
        assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-9), name
    with torch.no_grad():
        for name, g in grads.items():
            learner.net.get_parameter(name).sub_(1e-2 * g / max(float(g.norm()), 1e-12))
    after, _ = _logprobs(learner, samples)
    assert float((kl_estimate(after, start_logp, "k3") * mask).sum()) < float(k3.detach().sum())
    with torch.no_grad():
        for name, g in grads.items():
            learner.net.get_parameter(name).add_(1e-2 * g / max(float(g.norm()), 1e-12))
    second = learner.step()
    assert second.loss == pytest.approx(float(by_hand.detach()), rel=1e-4) and float(by_hand.detach()) > 0
    assert second.stats["kl_ref"] == pytest.approx(float(k3.detach().sum() / mask.sum()), rel=1e-4)


def test_a_lora_models_kl_reference_is_its_base_with_the_adapters_disabled(tmp_path):
    cfg = make_lora_cfg(tmp_path)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"kl_coef": 0.1})})
    learner = Learner(cfg, "m")
    assert learner.reference is not None and learner.reference.net is learner.net  # no second copy
    samples = [with_adapter(make_sample(i), "sol" if i % 2 else "ver") for i in range(4)]
    batch = collate(samples, learner.pad_id)
    with torch.no_grad():
        base = learner.token_logprobs(batch)  # fresh adapters (B = 0): the policy is the base
    learner.accumulate(samples, [1.0, -1.0, 0.5, -0.5])
    learner.step()
    with torch.no_grad():
        policy = learner.token_logprobs(batch)
    ref = learner._reference_logprobs(batch)
    assert torch.allclose(ref, base, atol=1e-6)
    assert not torch.allclose(policy, base, atol=1e-4)
    with torch.no_grad():
        assert torch.allclose(learner.token_logprobs(batch), policy)  # the adapters are on again


def test_kl_in_the_reward_penalises_each_token_by_its_behaviour_kl_to_the_reference(tmp_path):
    samples = [make_sample(i, resp_len=2 + i % 3) for i in range(4)]
    learner = Learner(make_cfg(tmp_path, global_batch=4,
                               train_extra=", kl_coef: 0.1, kl_estimator: k1, kl_in: reward"), "m")
    assert learner.kl_reward and not learner.kl_loss
    ref, mask = _logprobs(learner, samples)  # the reference is the starting weights
    penalties = learner.reward_penalties(samples)
    behav = collate(samples, learner.pad_id).logp_behav
    for i, (s, p) in enumerate(zip(samples, penalties, strict=True)):
        m = mask[i] > 0
        assert p.shape == (s.response_ids.shape[0],)
        assert p == pytest.approx((0.1 * (behav[i][m] - ref[i][m])).numpy(), rel=1e-4, abs=1e-6)
    learner.accumulate(samples, [1.0, -1.0, 0.5, -0.5])
    r = learner.step()
    n = float(mask.sum())
    assert r.stats["kl_ref"] == pytest.approx(float(((behav - ref) * mask).sum()) / n, rel=1e-4)
    assert r.stats["kl_reward_penalty"] == pytest.approx(sum(float(p.sum()) for p in penalties) / 4, rel=1e-5)


def test_reinforce_pp_with_a_kl_reward_penalty_trains_on_whitened_returns_to_go(tmp_path):
    from shared.rlmath.advantages import batch_token_advantages

    extra = ", advantage: reinforce_pp, kl_coef: 0.2, kl_estimator: k2, kl_in: reward"
    samples = [make_sample(i, resp_len=2 + i % 3) for i in range(4)]
    held = Learner(make_cfg(tmp_path, global_batch=4, train_extra=extra), "m")
    held.hold(samples)
    plain = Learner(make_cfg(tmp_path, global_batch=4), "m")
    ref, mask = _logprobs(plain, samples)
    behav = collate(samples, plain.pad_id).logp_behav
    penalties = [(0.2 * 0.5 * (behav[i] - ref[i])[mask[i] > 0] ** 2).double().numpy() for i in range(4)]
    adv = batch_token_advantages([s.reward for s in samples], penalties)
    assert not np.allclose(adv[2], adv[2][0])  # returns to go differ token by token
    plain.accumulate(samples, adv)
    g_held, g_plain = held.scaled_gradients(), plain.scaled_gradients()
    for name, g in g_plain.items():
        assert torch.allclose(g, g_held[name], rtol=1e-4, atol=1e-8), name


def test_a_kl_reward_penalty_replaces_the_coordinators_advantages_by_penalised_group_ones(tmp_path):
    from shared.rlmath.advantages import group_advantages

    extra = ", kl_coef: 0.5, kl_estimator: k1, kl_in: reward, grouping: episode"
    samples = [make_sample(i, resp_len=2 + i % 3).model_copy(update={"advantage": 9.0}) for i in range(4)]
    penalised = Learner(make_cfg(tmp_path, global_batch=4, train_extra=extra), "m")
    penalties = penalised.reward_penalties(samples[1:])
    penalised.micro_batch(samples, [1, 2, 3], "grpo")  # sample 0 is stale: it is in no group
    plain = Learner(make_cfg(tmp_path, global_batch=4), "m")
    rewards = [s.reward - float(p.sum()) for s, p in zip(samples[1:], penalties, strict=True)]
    adv = group_advantages(rewards, [s.group_key for s in samples[1:]])
    assert float(np.abs(adv).max()) > 0 and all(float(a) != 9.0 for a in adv)
    plain.accumulate(samples[1:], adv.tolist())
    g_pen, g_plain = penalised.scaled_gradients(), plain.scaled_gradients()
    for name, g in g_plain.items():
        assert torch.allclose(g, g_pen[name], rtol=1e-4, atol=1e-8), name


def test_a_learner_takes_its_models_own_loss_options(tmp_path):
    cfg = make_cfg(tmp_path)
    cfg.models["m"].train = {"loss": "decoupled", "kl_coef": 0.1, "loss_agg": "token-mean"}
    learner = Learner(cfg, "m")
    assert (learner.loss_name, learner.loss_agg, learner.kl_loss) == ("decoupled", "token-mean", True)
    assert learner.reference is not None and cfg.train.loss == "ppo_clip"
