"""The policy-loss family (ppo_clip, decoupled, dual-clip) and its aggregations, on hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

from shared.rlmath.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    LossSettings,
    PolicyBatch,
    aggregate_loss,
    kl_estimate,
    ppo_terms,
)

LOG = math.log


def ppo_family_terms(logp: torch.Tensor, behav: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
                      clip_eps: float, loss: str = "ppo_clip", logp_prox: torch.Tensor | None = None,
                      clip_ratio_c: float | None = None, behav_imp_weight_cap: float | None = None
                      ) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token terms of the PPO family's registered losses (``ppo_terms``) in this file's words."""
    if loss not in ("ppo_clip", "decoupled"):
        raise ValueError(f"loss {loss!r} is not one of the PPO family")
    settings = LossSettings(clip_eps=clip_eps, clip_ratio_c=clip_ratio_c, behav_imp_weight_cap=behav_imp_weight_cap)
    return ppo_terms(PolicyBatch(logp, behav, adv, mask, logp_prox=logp_prox), settings, loss == "decoupled")


def _leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values).log().requires_grad_(True)


def test_aggregations_match_hand_computation():
    per_token = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # each sample's token mean (1.5, 3), summed, over the global batch's 4 samples
    assert aggregate_loss(per_token, mask, "seq-mean-token-mean", 4).item() == pytest.approx((1.5 + 3.0) / 4)
    # each sample's token sum (3, 3), over 4 samples
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum", 4).item() == pytest.approx(6.0 / 4)
    # every token of the batch weighs the same: 6 over its 3 tokens
    assert aggregate_loss(per_token, mask, "token-mean", 3).item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate_loss(per_token, mask, "mean", 1)


def test_decoupled_matches_hand_computation_with_weights_and_cap():
    # one sample, A = +1; token 1: mu .5, pi_prox .6, pi_theta .9; token 2: mu .4, pi_prox .2, pi_theta .2
    mu = torch.tensor([[LOG(0.5), LOG(0.4)]])
    prox = torch.tensor([[LOG(0.6), LOG(0.2)]])
    theta = _leaf([[0.9, 0.2]])
    adv, mask = torch.tensor([1.0]), torch.ones(1, 2)
    per_token, stats = ppo_family_terms(theta, mu, adv, mask, clip_eps=0.2, loss="decoupled", logp_prox=prox)
    # token 1: r = 1.5 -> clipped 1.2, w = 1.2: L = 1.2 * -1.2 = -1.44; token 2: r = 1, w = .5: L = -0.5
    assert per_token.tolist()[0] == pytest.approx([-1.44, -0.5], abs=1e-5)
    loss = aggregate_loss(per_token, mask, "seq-mean-token-mean", 1)
    assert loss.item() == pytest.approx((-1.44 - 0.5) / 2, abs=1e-5)
    loss.backward()
    # token 1 is clipped (no gradient); token 2: d(-r A w / 2)/dlog pi_theta = -r w / 2 = -0.25
    assert theta.grad.tolist()[0] == pytest.approx([0.0, -0.25], abs=1e-5)
    assert stats["clip_frac"] == 0.5 and stats["is_weight_mean"] == pytest.approx(0.85, abs=1e-5)
    assert stats["is_weight_max"] == pytest.approx(1.2, abs=1e-5)
    assert stats["approx_kl_prox"] == pytest.approx((LOG(0.6 / 0.9) + 0.0) / 2, abs=1e-5)
    # with a cap of 1.1, token 1 (w = 1.2) leaves the loss
    capped, stats = ppo_family_terms(theta, mu, adv, mask, clip_eps=0.2, loss="decoupled", logp_prox=prox,
                                      behav_imp_weight_cap=1.1)
    assert capped.tolist()[0] == pytest.approx([0.0, -0.5], abs=1e-5)
    assert stats["is_weight_capped_frac"] == 0.5


def test_ppo_clip_on_the_same_tokens_clips_against_mu():
    mu = torch.tensor([[LOG(0.5), LOG(0.4)]])
    theta = _leaf([[0.9, 0.2]])
    per_token, stats = ppo_family_terms(theta, mu, torch.tensor([1.0]), torch.ones(1, 2), clip_eps=0.2)
    # token 1: rho = 1.8 -> clipped at 1.2: -1.2; token 2: rho = .5, A > 0: min(.5, .8) -> -0.5 (unclipped)
    assert per_token.tolist()[0] == pytest.approx([-1.2, -0.5], abs=1e-5)
    assert stats["clip_frac"] == 0.5 and stats["ratio_mean"] == pytest.approx((1.8 + 0.5) / 2, abs=1e-5)
    assert stats["approx_kl_mu"] == pytest.approx((LOG(0.5 / 0.9) + LOG(0.4 / 0.2)) / 2, abs=1e-5)


def test_decoupled_keeps_the_gradient_of_a_token_whose_ratio_to_a_stale_mu_left_the_trust_region():
    # pi_theta = pi_prox = .9, mu = .5 (stale): ppo_clip's rho = 1.8 is clipped and the token has no gradient;
    # decoupled's r = 1 is inside the region and the token is weighted by w = 1.8
    mu = torch.tensor([[LOG(0.5)]])
    for loss, expected in (("ppo_clip", 0.0), ("decoupled", -1.8)):
        theta = _leaf([[0.9]])
        per_token, _ = ppo_family_terms(theta, mu, torch.tensor([1.0]), torch.ones(1, 1), clip_eps=0.2, loss=loss,
                                         logp_prox=theta.detach())
        aggregate_loss(per_token, torch.ones(1, 1), "token-mean", 1).backward()
        assert theta.grad.item() == pytest.approx(expected, abs=1e-5), loss


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("dual", [None, 3.0])
def test_decoupled_with_pi_prox_equal_to_mu_is_ppo_clip(agg: str, dual: float | None):
    g = torch.Generator().manual_seed(7)
    b, t = 6, 9
    mu = -torch.rand(b, t, generator=g) * 4
    start = (mu + torch.randn(b, t, generator=g) * 0.6).detach()
    adv = torch.randn(b, generator=g) * 2
    mask = (torch.rand(b, t, generator=g) > 0.25).float()
    out = {}
    for loss in ("ppo_clip", "decoupled"):
        theta = start.clone().requires_grad_(True)
        per_token, _ = ppo_family_terms(theta, mu, adv, mask, clip_eps=0.2, loss=loss, logp_prox=mu,
                                         clip_ratio_c=dual)
        value = aggregate_loss(per_token, mask, agg, float(mask.sum()) if agg == "token-mean" else b)
        value.backward()
        out[loss] = (value.detach(), theta.grad.clone())
    torch.testing.assert_close(out["decoupled"][0], out["ppo_clip"][0])
    torch.testing.assert_close(out["decoupled"][1], out["ppo_clip"][1])
    assert out["ppo_clip"][1].abs().sum() > 0  # a gradient that could differ


def test_dual_clip_bounds_the_loss_of_a_negative_advantage_token_with_a_huge_ratio():
    mu = torch.tensor([[-12.0]])
    adv, mask = torch.tensor([-2.0]), torch.ones(1, 1)
    for loss in ("ppo_clip", "decoupled"):
        theta = torch.tensor([[-2.0]], requires_grad=True)  # ratio to mu e^10
        prox = mu if loss == "decoupled" else None
        unbounded, _ = ppo_family_terms(theta, mu, adv, mask, clip_eps=0.2, loss=loss, logp_prox=prox)
        assert unbounded.item() == pytest.approx(2.0 * math.exp(10.0), rel=1e-4)  # -A * rho, no bound
        bounded, stats = ppo_family_terms(theta, mu, adv, mask, clip_eps=0.2, loss=loss, logp_prox=prox,
                                           clip_ratio_c=3.0)
        assert bounded.item() == pytest.approx(3.0 * 2.0)  # c * |A|
        assert stats["dual_clip_frac"] == 1.0
        bounded.sum().backward()
        assert theta.grad.item() == 0.0
    # a positive advantage is never dual-clipped
    theta = torch.tensor([[-2.0]], requires_grad=True)
    pos, stats = ppo_family_terms(theta, mu, torch.tensor([2.0]), mask, clip_eps=0.2, clip_ratio_c=3.0)
    assert pos.item() == pytest.approx(-2.0 * 1.2) and stats["dual_clip_frac"] == 0.0


def test_clip_frac_counts_only_tokens_whose_clipped_term_is_used():
    mu = torch.zeros(1, 4)
    # ratios 1.5, 0.5, 1.5, 0.5 with A = +1: only 1.5 is clipped (0.5 with A > 0 keeps its unclipped term)
    theta = torch.tensor([[LOG(1.5), LOG(0.5), LOG(1.5), LOG(0.5)]])
    _, stats = ppo_family_terms(theta, mu, torch.tensor([1.0]), torch.ones(1, 4), clip_eps=0.2)
    assert stats["clip_frac"] == 0.5
    _, stats = ppo_family_terms(theta, mu, torch.tensor([-1.0]), torch.ones(1, 4), clip_eps=0.2)
    assert stats["clip_frac"] == 0.5  # A < 0: now 0.5 is the clipped one


def test_the_decoupled_loss_needs_pi_prox_and_unknown_losses_are_refused():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="logp_prox"):
        ppo_family_terms(x, x, torch.ones(1), x + 1, clip_eps=0.2, loss="decoupled")
    with pytest.raises(ValueError, match="not one of"):
        ppo_family_terms(x, x, torch.ones(1), x + 1, clip_eps=0.2, loss="ppo")


def test_kl_estimators_on_a_hand_computed_token():
    # pi = 0.5, pi_ref = 0.25: log r = log(pi_ref / pi) = -log 2, r = 0.5
    log2 = math.log(2.0)
    expected = {"k1": (log2, 1.0), "k2": (0.5 * log2**2, log2), "k3": (0.5 - 1 + log2, 1 - 0.5)}  # (value, d/dlog pi)
    for est in KL_ESTIMATORS:
        logp = torch.tensor([math.log(0.5)], requires_grad=True)
        k = kl_estimate(logp, torch.tensor([math.log(0.25)]), est)
        k.sum().backward()
        value, grad = expected[est]
        assert float(k.detach()) == pytest.approx(value, rel=1e-5), est
        assert float(logp.grad) == pytest.approx(grad, rel=1e-5), est


def test_kl_estimators_vanish_at_the_reference_and_k3_is_never_negative():
    logp = torch.log(torch.tensor([0.1, 0.3, 0.6]))
    for est in KL_ESTIMATORS:
        assert kl_estimate(logp, logp.clone(), est).abs().max() == 0.0, est
    ref = torch.log(torch.tensor([0.6, 0.1, 0.3]))
    assert bool((kl_estimate(logp, ref, "k3") >= 0).all())
    assert bool((kl_estimate(logp, ref, "k1") < 0).any())  # k1 is unbiased but not positive token by token
    # k3 is clamped as verl's low_var_kl: a log-ratio of 30 gives 10, not e^30
    assert float(kl_estimate(torch.tensor([-30.0]), torch.tensor([0.0]), "k3")) == 10.0
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")
