"""MARFT's central critic on a tiny random Llama: a frozen base, a head that learns the returns."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.critic.learner import CriticLearner
from shared.models.critic import CentralCritic


def tiny_base() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (8, 10), generator=gen)
    mask = torch.ones_like(ids)
    for row, length in enumerate([10, 7, 4, 9, 10, 3, 6, 8]):
        mask[row, length:] = 0
        ids[row, length:] = 0
    returns = torch.linspace(-1.0, 1.0, 8)
    return ids, mask, returns


def test_the_head_learns_the_returns_while_the_base_stays_bit_identical() -> None:
    base = tiny_base()
    before = {k: t.clone() for k, t in base.state_dict().items()}
    critic = CentralCritic(base, head_sizes=(64, 32))
    learner = CriticLearner(critic, lr=3e-3, grad_clip=1.0, value_clip=None)
    ids, mask, returns = batch()
    steps = [learner.step(ids, mask, learner.values(ids, mask), returns) for _ in range(150)]
    assert steps[-1].value_loss < 0.1 * steps[0].value_loss
    assert steps[-1].explained_variance > 0.8 > steps[0].explained_variance
    assert all(torch.equal(t, before[k]) for k, t in base.state_dict().items())
    assert not any(p.requires_grad for p in base.parameters())


@torch.no_grad()
def test_the_value_reads_the_last_real_token_of_a_right_padded_row() -> None:
    critic = CentralCritic(tiny_base(), head_sizes=(16,))
    ids, mask, _ = batch()
    row = 2  # 4 real tokens
    alone = critic(ids[row : row + 1, :4], mask[row : row + 1, :4])
    other_pad = ids[row : row + 1].clone()
    other_pad[0, 4:] = 5  # what sits after the last real token does not matter
    assert float(critic(ids, mask)[row]) == pytest.approx(float(alone[0]), abs=1e-5)
    assert float(critic(other_pad, mask[row : row + 1])[0]) == pytest.approx(float(alone[0]), abs=1e-5)
    with pytest.raises(ValueError, match="at least one token"):
        critic(ids[:1], torch.zeros_like(mask[:1]))


def test_a_restored_head_and_optimizer_continue_exactly() -> None:
    ids, mask, returns = batch()
    a = CriticLearner(CentralCritic(tiny_base(), head_sizes=(16,)), lr=1e-2)
    for _ in range(3):
        a.step(ids, mask, a.values(ids, mask), returns)
    state = a.state_dict()
    b = CriticLearner(CentralCritic(tiny_base(), head_sizes=(16,)), lr=1e-2)
    b.load_state_dict(state)
    torch.testing.assert_close(b.values(ids, mask), a.values(ids, mask), rtol=0, atol=0)
    sa, sb = a.step(ids, mask, a.values(ids, mask), returns), b.step(ids, mask, b.values(ids, mask), returns)
    assert sa.value_loss == sb.value_loss
    torch.testing.assert_close(b.values(ids, mask), a.values(ids, mask), rtol=0, atol=0)
