"""Response-only log-probs and length-sorted sub-batches give the old full-logits path's numbers.

The reference below is the learner's previous computation: the whole model over the right-padded batch with
its attention mask, log-softmax over every position, one forward and backward per micro-batch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.trainer.learner import Collated, Learner, collate
from services.trainer.logprobs import pack_rows, pack_shared, prompt_groups
from services.trainer.optstep import merge_token_stats
from shared.kernel.config import ChorusConfig
from shared.kernel.schemas import Array, Sample
from shared.models.tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE
from shared.rlmath.losses import LossSettings, PolicyBatch, aggregate_loss, ppo_terms

# Long-tailed responses: a 40-token row among short ones, so the micro-batch is cut into sub-batches.
PROMPTS = [5, 7, 6, 9, 5, 8, 6, 7]
RESPONSES = [3, 40, 4, 6, 2, 28, 5, 3]
ADVANTAGES = [1.0, -1.0, 0.6, -0.4, 1.5, -0.8, 0.3, -1.2]
ADAPTERS = ["sol", "ver", "sol", "sol", "ver", "sol", "ver", "ver"]


def cfg_for(*, lora: list[str] | None = None, temperature: float = 0.8) -> ChorusConfig:
    adapter = {} if lora is None else {"adapter": "sol"}
    return ChorusConfig(
        run={"id": "logprobs"},
        models={"m": {"arch": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
                               "max_position": 96},
                      "optim": {"lr": 0.01},
                      **({} if lora is None else {"lora": {"r": 4, "target_modules": lora}})}},
        agents={"solver": {"model": "m", **adapter},
                "verifier": {"model": "m", **({} if lora is None else {"adapter": "ver"})}},
        workflow={"group_size": 2, "temperature": temperature},
        train={"global_batch": 8, "micro_batch": 8},
    )


def sample(i: int, prompt_len: int, resp_len: int, adapter: str | None = None) -> Sample:
    rng = np.random.default_rng(100 + i)
    prompt = [BOS_ID, *rng.integers(32, 127, prompt_len - 1).tolist()]
    resp = [*rng.integers(32, 127, resp_len - 1).tolist(), EOS_ID]
    # Near a fresh model's (uniform) log-probs, spread so that some tokens clip and most do not.
    lp = (-math.log(VOCAB_SIZE) + rng.uniform(-0.3, 0.3, resp_len)).tolist()
    return Sample(run="r", episode=f"e{i}", sample_id=f"s{i}", env_idx=i, rollout_idx=0, agent="solver", model="m",
                  adapter=adapter, turn=0, prompt_ids=Array.of(prompt, "int32"), response_ids=Array.of(resp, "int32"),
                  behavior_logprobs=Array.of(lp, "float32"), reward=0.0, group_key=f"g{i}", group_size=2, version=0)


def long_tail(lora: bool) -> list[Sample]:
    return [sample(i, p, r, ADAPTERS[i] if lora else None) for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True))]


def reference_logprobs(learner: Learner, batch: Collated) -> torch.Tensor:
    """The previous token_logprobs: full logits [B, L-1, V], log-softmax everywhere, then the targets."""
    routing = {"adapter_names": list(batch.adapters)} if learner.lora else {}
    out = learner.net(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, **routing)
    logp = torch.log_softmax(out.logits[:, :-1, :].float() / learner.temperature, dim=-1)
    return logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)


def reference_accumulate(learner: Learner, samples: list[Sample], adv: list[float]) -> tuple[float, dict[str, float]]:
    """The previous accumulate: one collated micro-batch, one forward and backward."""
    batch = collate(samples, learner.pad_id)
    pb = PolicyBatch(reference_logprobs(learner, batch), batch.logp_behav, torch.tensor(adv), batch.loss_mask)
    per_token, stats = ppo_terms(pb, LossSettings(clip_eps=learner.clip_eps, clip_ratio_c=learner.clip_ratio_c),
                                 learner.loss_name == "decoupled")
    loss = aggregate_loss(per_token, batch.loss_mask, learner.loss_agg, learner.global_batch)
    loss.backward()
    return float(loss.detach()), stats


def perturb_adapters(learner: Learner) -> None:
    """Fresh adapters are no-ops (B = 0); give both different non-zero weights, the same in every learner."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for t in learner.named_tensors().values():
            t.add_(torch.randn(t.shape, generator=gen) * 0.2)


def learners(lora: list[str] | None) -> tuple[Learner, Learner]:
    new, old = Learner(cfg_for(lora=lora), "m"), Learner(cfg_for(lora=lora), "m")
    if lora is not None:
        perturb_adapters(new)
        perturb_adapters(old)
    return new, old


CASES = [None, ["q_proj", "v_proj"], ["q_proj", "v_proj", "lm_head"]]
IDS = ["full", "lora", "lora-head"]


def test_the_long_tail_batch_is_really_cut_into_sub_batches():
    groups = pack_rows([p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)])
    assert len(groups) >= 3 and sorted(i for g in groups for i in g) == list(range(len(PROMPTS)))


@pytest.mark.parametrize("lora", CASES, ids=IDS)
def test_response_log_probs_match_the_full_logits_path(lora):
    learner, _ = learners(lora)
    batch = collate(long_tail(lora is not None), learner.pad_id)
    mask = batch.loss_mask.bool()
    with torch.no_grad():
        got, want = learner.token_logprobs(batch), reference_logprobs(learner, batch)
        learner.scorer.split = False  # the fallback of a model whose forward transforms its logits
        fallback = learner.token_logprobs(batch)
    assert torch.allclose(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    assert torch.allclose(fallback[mask], want[mask], rtol=1e-5, atol=1e-5)
    assert bool((got[~mask] == 0).all()) and got.dtype == torch.float32


def assert_same_stats(learner, ref_stats: dict[str, float]) -> None:
    """The learner's accumulated statistics (token means, ``*_max`` maxima, token count) against one reference
    micro-batch's."""
    merged = merge_token_stats(learner._parts)
    for k, v in ref_stats.items():
        assert merged[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("lora", CASES, ids=IDS)
def test_sub_batches_accumulate_the_gradient_of_the_whole_micro_batch(lora):
    new, old = learners(lora)
    samples = long_tail(lora is not None)
    loss = new.accumulate(samples, ADVANTAGES)
    ref_loss, ref_stats = reference_accumulate(old, samples, ADVANTAGES)
    old.accumulated += len(samples)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert_same_stats(new, ref_stats)
    g_new, g_old = new.scaled_gradients(), old.scaled_gradients()
    assert g_new.keys() == g_old.keys() and g_new
    if lora is not None:  # both adapters got a gradient, and only adapters did
        assert {n.split(".")[-2] for n, g in g_new.items() if bool(g.any())} == {"sol", "ver"}
    for name, g in g_old.items():
        assert bool(g.abs().sum() > 0) or "lora_A" in name, name
        assert torch.allclose(g_new[name], g, rtol=1e-4, atol=1e-7), name


def test_a_micro_batch_without_response_tokens_adds_no_gradient():
    learner = Learner(cfg_for(), "m")
    empty = [sample(0, 5, 1).model_copy(update={"response_ids": Array.of([], "int32"),
                                                "behavior_logprobs": Array.of([], "float32")})]
    assert learner.accumulate(empty, [1.0]) == 0.0
    assert learner.accumulated == 1 and all(p.grad is None for p in learner.trainable)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.floats(1.0, 3.0))
def test_every_sub_batch_pads_within_the_bound_and_every_row_is_in_one(lengths, bound):
    groups = pack_rows(lengths, bound)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        width = max(lengths[i] for i in g)
        assert len(g) * width <= bound * sum(lengths[i] for i in g) + 1e-9
        assert lengths[g[0]] == width  # opened by its longest row


def test_one_long_row_among_short_ones_is_split_off_and_equal_rows_stay_together():
    assert pack_rows([30] * 7 + [256]) == [[7], [0, 1, 2, 3, 4, 5, 6]]
    assert pack_rows([40] * 8) == [list(range(8))]
    assert pack_rows([100, 5], float("inf")) == [[0, 1]]
    with pytest.raises(ValueError, match="pad bound"):
        pack_rows([1], 0.5)


def grouped(lora: bool) -> list[Sample]:
    """GRPO-like groups of 3, 3 and 2 samples with one long response among short ones. With LoRA, group 1 mixes
    two adapters (one prompt, two packed rows) and group 2 has group 0's prompt under another adapter (its own
    row): rows share a prompt only under the same adapter."""
    out = []
    for i, r in enumerate(RESPONSES):
        group = i // 3
        adapter = {0: "sol", 1: "sol" if i % 2 else "ver", 2: "ver"}[group] if lora else None
        base = sample(i, PROMPTS[group], r, adapter)
        prompt = sample(group if group != 2 else 0, PROMPTS[group if group != 2 else 0], 1).prompt_ids
        out.append(base.model_copy(update={"prompt_ids": prompt, "group_key": f"g{group}"}))
    return out


@pytest.mark.parametrize("share", [True, False], ids=["shared-prompts", "one-row-per-sample"])
@pytest.mark.parametrize("lora", CASES, ids=IDS)
def test_samples_sharing_a_prompt_run_it_once_and_give_the_same_gradient(lora, share):
    new, old = learners(lora)
    new.share_prompts = share
    samples = grouped(lora is not None)
    groups = prompt_groups(samples)
    assert len(groups) < len(samples) and max(len(g) for g in groups) >= 3
    packed = pack_shared(samples, new.pad_id)
    assert packed.input_ids.shape[0] == len(groups)
    assert packed.input_ids.shape[1] < sum(s.prompt_ids.shape[0] + s.response_ids.shape[0] for s in samples)
    loss = new.accumulate(samples, ADVANTAGES)
    ref_loss, ref_stats = reference_accumulate(old, samples, ADVANTAGES)
    old.accumulated += len(samples)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert_same_stats(new, ref_stats)
    g_new, g_old = new.scaled_gradients(), old.scaled_gradients()
    assert g_new.keys() == g_old.keys() and g_new
    for name, g in g_old.items():
        assert torch.allclose(g_new[name], g, rtol=1e-4, atol=1e-6), name
