"""GRPO advantages and the PPO-clip surrogate on hand-computed examples."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shared.rlmath import advantages
from shared.rlmath.losses import LossSettings, PolicyBatch, ppo_clip


def grpo_advantages(rewards: Any, group_ids: list[Any]) -> torch.Tensor:
    return torch.from_numpy(advantages.group_advantages(rewards, group_ids)).to(torch.float32)


def registered_ppo_clip(logp_new: torch.Tensor, logp_behav: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                  clip_eps: float, global_batch: int) -> tuple[torch.Tensor, dict[str, float]]:
    """The registered ppo_clip, token-mean per sample, summed and divided by ``global_batch``."""
    return ppo_clip(PolicyBatch(logp_new, logp_behav, adv, mask), LossSettings(clip_eps=clip_eps, denominator=global_batch))


def test_group_advantages_normalise_within_each_group_with_population_std():
    adv = grpo_advantages([1.0, 3.0, 2.0, 2.0, 5.0, 0.0, 1.0, 0.0, 1.0], ["a", "a", "b", "b", "c", "d", "d", "d", "d"])
    # a: mean 2, population std 1 -> -1, +1; b: constant -> 0; c: a group of one -> 0; d: mean .5, std .5
    expected = torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0, -1.0, 1.0, -1.0, 1.0])
    assert torch.allclose(adv, expected, atol=1e-4)


def test_group_advantages_of_singletons_and_constant_groups_are_zero():
    adv = grpo_advantages([7.0, 0.5, 0.5, 0.5], ["x", "y", "y", "y"])
    assert torch.equal(adv, torch.zeros(4))


def test_group_advantages_reject_mismatched_lengths():
    with pytest.raises(ValueError, match="group ids"):
        grpo_advantages([1.0, 2.0], ["a"])


def test_advantages_of_one_agent_never_depend_on_another_agents_rewards_in_the_same_batch():
    # AT-GRPO keys groups by (env, agent, turn): two adapters' rows of one env share a micro-batch, not a group.
    keys = ["e0/solver/0"] * 3 + ["e0/verifier/1"] * 3
    a = grpo_advantages([1.0, 0.0, 0.5, 9.0, -3.0, 4.0], keys)
    b = grpo_advantages([1.0, 0.0, 0.5, 0.0, 0.0, 1.0], keys)
    assert torch.allclose(a[:3], b[:3]) and not torch.allclose(a[3:], b[3:])
    assert torch.allclose(a[:3], grpo_advantages([1.0, 0.0, 0.5], keys[:3]))


def _hand_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logp_behav = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]])
    ratios = torch.tensor([[1.5, 1.0], [0.5, 2.0]])
    logp_new = (logp_behav + ratios.log()).requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return logp_new, logp_behav, advantages, mask


def test_ppo_clip_loss_matches_hand_computation():
    logp_new, logp_behav, adv, mask = _hand_example()
    loss, stats = registered_ppo_clip(logp_new, logp_behav, adv, mask, clip_eps=0.2, global_batch=4)
    # sample 0 (A=+1): -mean(min(1.5, 1.2), min(1.0, 1.0)) = -1.1
    # sample 1 (A=-1): -min(-0.5, -0.8) = 0.8 on its one unmasked token
    assert loss.item() == pytest.approx((-1.1 + 0.8) / 4, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert stats["tokens"] == 3


def test_ppo_clip_loss_gradient_is_zero_where_clipped_and_ignores_masked_tokens():
    logp_new, logp_behav, adv, mask = _hand_example()
    loss, _ = registered_ppo_clip(logp_new, logp_behav, adv, mask, clip_eps=0.2, global_batch=4)
    loss.backward()
    # Only sample 0 token 1 is unclipped: d(-rho*A/2/4)/dlogp = -rho*A/8 = -0.125.
    expected = torch.tensor([[0.0, -0.125], [0.0, 0.0]])
    assert torch.allclose(logp_new.grad, expected, atol=1e-6)


def test_ppo_clip_loss_is_finite_for_extreme_log_ratios():
    logp_new = torch.tensor([[0.0]], requires_grad=True)
    loss, _ = registered_ppo_clip(logp_new, torch.tensor([[-500.0]]), torch.tensor([-1.0]), torch.ones(1, 1), 0.2, 1)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp_new.grad).all()


def test_gradients_accumulated_over_two_micro_batches_equal_the_full_batch_gradient():
    g = torch.Generator().manual_seed(0)
    b, t = 8, 5
    theta = torch.randn(b, t, generator=g).mul(0.3).requires_grad_(True)
    logp_behav = -torch.rand(b, t, generator=g) * 3
    adv = grpo_advantages(torch.rand(b, generator=g), [i // 4 for i in range(b)])
    mask = (torch.rand(b, t, generator=g) > 0.3).float()

    def logp(x: torch.Tensor) -> torch.Tensor:
        return logp_behav + torch.tanh(x)  # some differentiable policy

    full, _ = registered_ppo_clip(logp(theta), logp_behav, adv, mask, 0.2, global_batch=b)
    (full_grad,) = torch.autograd.grad(full, theta)
    acc = torch.zeros_like(theta)
    for part in (slice(0, 3), slice(3, 8)):
        loss, _ = registered_ppo_clip(logp(theta)[part], logp_behav[part], adv[part], mask[part], 0.2, global_batch=b)
        (grad,) = torch.autograd.grad(loss, theta)
        acc += grad
    assert full_grad.abs().sum() > 0
    assert torch.allclose(acc, full_grad, atol=1e-7)
