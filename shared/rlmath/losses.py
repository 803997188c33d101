"""Every loss Chorus trains with, as pure torch functions; the policy losses registered under their names.

A policy loss has one signature, ``fn(batch: PolicyBatch, settings: LossSettings) -> (loss, stats)``: the scalar
loss of one sub-batch (already divided by ``settings.denominator``, so that sub-batches and micro-batches add up to
the step's loss) and its statistics (token means, and ``tokens``). ``train.loss`` names one of
:data:`POLICY_LOSSES` (MARFT-T, ``train.loss: marft`` with ``marft.variant: token``, is ``marft_token``); a new loss
is one function with :func:`register_policy_loss` and nothing else. The learner adds the regularisers
(:func:`regularised`: the entropy bonus and the KL to the reference) aggregated as the loss.

Symbols follow the papers: A the advantage (GRPO, Shao et al. 2024), rho_t = pi_theta(a_t|s_t) / mu(a_t|s_t) the
ratio against the behaviour policy mu (decoupled PPO, Hilton et al. 2022), pi_prox the proximal policy, epsilon
the clip range, c the dual-clip bound (Ye et al. 2020); MARFT (Liao et al. 2025, eq. 6 and 7): r = pi_theta(a) /
pi_old(a) of a whole action a (MARFT-A) or of each token (MARFT-T).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import torch

# exp() of a log-ratio above this overflows float32 long before it means anything.
_MAX_LOG_RATIO = 20.0
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
ACTION_NORMS = ("none", "token", "word")


@dataclass
class PolicyBatch:
    """What a policy loss reads of one sub-batch: per-token tensors [B, T] (0 outside ``mask``)."""

    logp: torch.Tensor  # log pi_theta of the sampled tokens (with gradient)
    logp_behav: torch.Tensor  # log mu: the behaviour policy that generated them
    advantages: torch.Tensor  # [B] one per sample, or [B, T] one per token
    mask: torch.Tensor  # 1 on response tokens
    logp_prox: torch.Tensor | None = None  # decoupled: log pi_prox
    words: torch.Tensor | None = None  # [B] MARFT's word normalisation: each action's word count


@dataclass(frozen=True)
class LossSettings:
    """How a policy loss is computed and aggregated (``train.*`` and ``marft.*``)."""

    clip_eps: float = 0.2
    agg: str = "seq-mean-token-mean"  # loss_agg (GRPO family); MARFT-T's tokens are always token-mean
    denominator: float = 1.0  # the global batch's samples (token-mean: its tokens; MARFT-A: the step's actions)
    clip_ratio_c: float | None = None  # dual-clip
    behav_imp_weight_cap: float | None = None  # decoupled
    action_norm: str = "none"  # MARFT-A


PolicyLoss: TypeAlias = Callable[[PolicyBatch, LossSettings], tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register ``fn`` as the policy loss ``name`` (``train.loss: name``)."""

    def register(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = fn
        return fn

    return register


def policy_loss(name: str) -> PolicyLoss:
    """The registered policy loss ``name``, or a ValueError naming the registered ones."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"policy loss {name!r} is not registered: one of {', '.join(sorted(POLICY_LOSSES))} "
                         "(shared/rlmath/losses.py)") from None


def loss_name(loss: str, marft_variant: str = "action") -> str:
    """The registered name of the configured loss: ``train.loss``, MARFT-T's ``marft_token``."""
    return "marft_token" if loss == "marft" and marft_variant == "token" else loss


# --- aggregation ----------------------------------------------------------------------------------------------


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str, denominator: float) -> torch.Tensor:
    """The scalar loss of per-token losses [B, T] (already 0 where masked), as verl's ``agg_loss`` defines it:

    - ``seq-mean-token-mean``: sum_i (sum_t L_it / |o_i|) / denominator  (each sample's token mean; the
      denominator is the global batch's sample count, so micro-batches add up to the batch's mean)
    - ``seq-mean-token-sum``:  sum_i sum_t L_it / denominator  (sample sums, mean over samples)
    - ``token-mean``:          sum_i sum_t L_it / denominator  (the denominator is the global batch's count of
      response tokens: every token weighs the same, long answers weigh more)

    A sample with no response token contributes 0.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"loss aggregation {mode!r} is not one of {AGGREGATIONS}")
    if mode == "seq-mean-token-mean":
        tokens = mask.to(per_token.dtype).sum(dim=1).clamp(min=1.0)
        return (per_token.sum(dim=1) / tokens).sum() / denominator
    return per_token.sum() / denominator


def _token_means(mask: torch.Tensor) -> tuple[float, Callable[[torch.Tensor], float]]:
    """(response tokens, the mean of a [B, T] tensor over them)."""
    n_tok = float((mask > 0).sum())
    denom = max(n_tok, 1.0)
    return n_tok, lambda x: float((x.to(mask.dtype) * mask).sum() / denom)


# --- PPO family -----------------------------------------------------------------------------------------------


def ppo_terms(batch: PolicyBatch, s: LossSettings, decoupled: bool) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token loss ``L_t`` [B, T] (masked tokens 0) of ppo_clip or decoupled, and its token statistics.

    ``ppo_clip`` (the trust region centred on the behaviour policy mu; verl's bypass mode)::

        rho_t = pi_theta / mu,   L_t = max(-A rho_t, -A clip(rho_t, 1 - eps, 1 + eps))

    ``decoupled`` (decoupled PPO, Hilton et al. 2022, as AReaL implements it): the trust region is centred on the
    proximal policy pi_prox and the behaviour policy enters only as an importance weight::

        r_t = pi_theta / pi_prox,  w_t = pi_prox / mu,   L_t = w_t * max(-A r_t, -A clip(r_t, 1 - eps, 1 + eps))

    with ``w_t = 0`` where ``w_t > behav_imp_weight_cap`` (the token leaves the loss) when a cap is set.
    Dual-clip (``clip_ratio_c`` = c > 1, verl's default 3) bounds a negative-advantage token:
    ``L_t = min(L_t, -c A)`` where ``A < 0`` (before the weight ``w_t``, as AReaL applies it).
    """
    logp, logp_behav, mask = batch.logp, batch.logp_behav, batch.mask.to(batch.logp.dtype)
    if decoupled and batch.logp_prox is None:
        raise ValueError("the decoupled loss needs the proximal log-probs logp_prox")
    adv = batch.advantages.to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    anchor = batch.logp_prox if decoupled else logp_behav
    assert anchor is not None
    # rho_t = exp(log pi_theta - log anchor), anchor = mu (ppo_clip) or pi_prox (decoupled)
    log_ratio = (logp - anchor.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - s.clip_eps, 1.0 + s.clip_eps)
    per_token = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1  # the clipped term is the one used (its gradient is zero)
    dual = torch.zeros_like(clipped)
    if s.clip_ratio_c is not None:
        # L_t = min(L_t, -c A) for A < 0: a negative-advantage token's loss is at most c |A|
        bound = -s.clip_ratio_c * adv
        dual = (adv < 0) & (bound < per_token)
        per_token = torch.where(dual, bound.expand_as(per_token), per_token)
    if decoupled:
        assert batch.logp_prox is not None
        # w_t = pi_prox / mu, a constant of the step (no gradient)
        weight = torch.exp((batch.logp_prox - logp_behav).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        kept = mask > 0
        if s.behav_imp_weight_cap is not None:
            kept = kept & (weight <= s.behav_imp_weight_cap)
        weight = torch.where(kept, weight, torch.zeros_like(weight))
        per_token = per_token * weight
    else:
        weight = ratio.detach()
    per_token = per_token * mask

    with torch.no_grad():
        m = mask > 0
        n_tok, mean = _token_means(mask)
        stats = {
            "clip_frac": mean(clipped),
            "dual_clip_frac": mean(dual),
            "ratio_mean": mean(ratio),
            # k1 estimates of KL(anchor || pi_theta) on the sampled tokens (verl's ppo_kl)
            "approx_kl_mu": mean(logp_behav - logp),
            "is_weight_mean": mean(weight),
            "is_weight_max": float(weight[m].max()) if n_tok else 0.0,
            "tokens": n_tok,
        }
        if decoupled:
            assert batch.logp_prox is not None
            stats["approx_kl_prox"] = mean(batch.logp_prox - logp)
            stats["is_weight_capped_frac"] = mean(m & (weight == 0))
    return per_token, stats


@register_policy_loss("ppo_clip")
def ppo_clip(batch: PolicyBatch, s: LossSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip against the behaviour policy mu (dual-clip with ``clip_ratio_c``), aggregated by ``s.agg``."""
    per_token, stats = ppo_terms(batch, s, decoupled=False)
    return aggregate_loss(per_token, batch.mask.to(batch.logp.dtype), s.agg, s.denominator), stats


@register_policy_loss("decoupled")
def decoupled(batch: PolicyBatch, s: LossSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO: the trust region around pi_prox, mu only in the importance weight (capped at
    ``behav_imp_weight_cap``; dual-clip with ``clip_ratio_c``), aggregated by ``s.agg``."""
    per_token, stats = ppo_terms(batch, s, decoupled=True)
    return aggregate_loss(per_token, batch.mask.to(batch.logp.dtype), s.agg, s.denominator), stats


# --- MARFT ----------------------------------------------------------------------------------------------------


def action_logprob(token_logp: torch.Tensor, mask: torch.Tensor, norm: str = "none",
                   words: torch.Tensor | None = None) -> torch.Tensor:
    """log pi of each action [B] from its tokens' log-probs [B, L] (eq. 7: the sum over the action's tokens),
    divided by 1 (``none``), the token count (``token``) or ``words`` [B], the action's word count (``word``)."""
    total = (token_logp * mask).sum(-1)
    if norm == "none":
        return total
    if norm == "token":
        return total / mask.sum(-1).clamp(min=1)
    if norm == "word":
        if words is None:
            raise ValueError("word normalisation needs each action's word count")
        return total / words.to(total.dtype).clamp(min=1)
    raise ValueError(f"action normalisation {norm!r}: one of {ACTION_NORMS}")


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL[pi_old || pi_theta] per element: (rho - 1) - log rho, rho = exp(log_ratio)."""
    return torch.exp(log_ratio) - 1.0 - log_ratio


def _marft_stats(ratio: torch.Tensor, clipped: torch.Tensor, weights: torch.Tensor, kl: torch.Tensor,
                 tokens: float) -> dict[str, float]:
    with torch.no_grad():
        denom = weights.sum().clamp(min=1)
        return {"clip_frac": float((((ratio - clipped).abs() > 0).to(weights.dtype) * weights).sum() / denom),
                "ratio_mean": float((ratio * weights).sum() / denom), "approx_kl": float(kl), "tokens": tokens}


@register_policy_loss("marft")
def marft_action(batch: PolicyBatch, s: LossSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """MARFT-A, eq. (6): a whole generation is one action; r = pi_theta(a) / pi_old(a) from the action
    log-probs (eq. 7, normalised by ``s.action_norm``); the loss is -sum_a min(r A, clip(r, 1 +- eps) A) divided
    by ``s.denominator`` (the step's actions: their mean). ``approx_kl`` is the listing's trust-region estimate,
    k3 of each action's log-ratio, averaged over this sub-batch's actions."""
    mask = batch.mask.to(batch.logp.dtype)
    lp = action_logprob(batch.logp, mask, s.action_norm, batch.words)
    lp_old = action_logprob(batch.logp_behav, mask, s.action_norm, batch.words)
    log_ratio = lp - lp_old
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - s.clip_eps, 1.0 + s.clip_eps)
    adv = batch.advantages.to(lp.dtype)
    loss = -torch.min(ratio * adv, clipped * adv).sum() / s.denominator
    kl = k3(log_ratio.detach().double()).mean()  # float64: exp(x) - 1 - x of a small x cancels in float32
    return loss, _marft_stats(ratio.detach(), clipped.detach(), torch.ones_like(ratio), kl, float(mask.sum()))


@register_policy_loss("marft_token")
def marft_token(batch: PolicyBatch, s: LossSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """MARFT-T: every token is an action; r_t = pi_theta(w_t) / pi_old(w_t), the loss -sum_t min(r_t A_t,
    clip(r_t) A_t) over response tokens divided by ``s.denominator`` (the step's tokens: their mean).
    ``approx_kl`` is k3 of each token's log-ratio, averaged over this sub-batch's tokens."""
    mask = batch.mask.to(batch.logp.dtype)
    log_ratio = batch.logp - batch.logp_behav
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - s.clip_eps, 1.0 + s.clip_eps)
    adv = batch.advantages.to(ratio.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    loss = -(torch.min(ratio * adv, clipped * adv) * mask).sum() / s.denominator
    tokens = float(mask.sum())
    kl = (k3(log_ratio.detach()) * mask).sum() / max(tokens, 1.0)
    return loss, _marft_stats(ratio.detach(), clipped.detach(), mask, kl, tokens)


def token_k3(token_logp: torch.Tensor, token_logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 of each token's log-ratio, averaged over the tokens of ``mask`` (``marft.kl_level: token``)."""
    log_rho = (token_logp - token_logp_old) * mask
    return (k3(log_rho) * mask).sum() / mask.sum().clamp(min=1)


# --- regularisers ---------------------------------------------------------------------------------------------


def kl_estimate(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probs of the sampled tokens (Schulman 2020, "Approximating
    KL divergence"), as verl's ``kl_penalty`` computes them. With log r_t = log pi_ref - log pi::

        k1 = -log r_t                  = log pi - log pi_ref     (unbiased, high variance, can be negative)
        k2 = (log r_t)^2 / 2                                     (verl's "mse")
        k3 = r_t - 1 - log r_t                                   (unbiased, low variance, >= 0; verl's "low_var_kl")

    k3's log r_t is clamped to [-20, 20] and its value to [-10, 10], as verl's ``low_var_kl``. Gradients flow
    through ``logp`` (the reference is a constant).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator {estimator!r} is not one of {KL_ESTIMATORS}")
    diff = logp - logp_ref.detach()  # log pi - log pi_ref = -log r_t
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    log_r = (-diff).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return (torch.exp(log_r) - 1.0 - log_r).clamp(-10.0, 10.0)


def regularised(loss: torch.Tensor, stats: dict[str, float], mask: torch.Tensor, agg: str, denominator: float, *,
                entropy: torch.Tensor | None = None, entropy_coef: float = 0.0, logp: torch.Tensor | None = None,
                logp_ref: torch.Tensor | None = None, kl_coef: float = 0.0,
                kl_estimator: str = "k3") -> torch.Tensor:
    """``loss`` minus the entropy bonus and plus the KL to the reference, each aggregated as the policy loss
    (``agg`` over ``denominator``), the token means into ``stats`` (``entropy``, ``kl_ref``)::

        L = L_pg - c_H agg(H_t) + beta agg(k_t(pi_theta, pi_ref))     (verl's entropy_coeff and use_kl_loss)
    """
    fmask = mask.to(loss.dtype)
    tokens = fmask.sum().clamp(min=1.0)
    if entropy is not None:
        stats["entropy"] = float((entropy.detach() * fmask).sum() / tokens)
        if entropy_coef > 0:
            loss = loss - entropy_coef * aggregate_loss(entropy * fmask, fmask, agg, denominator)
    if logp_ref is not None:
        assert logp is not None
        kl = kl_estimate(logp, logp_ref, kl_estimator) * fmask
        stats["kl_ref"] = float(kl.detach().sum() / tokens)
        loss = loss + kl_coef * aggregate_loss(kl, fmask, agg, denominator)
    return loss


# --- the critic -----------------------------------------------------------------------------------------------


def _error_loss(err: torch.Tensor, huber_delta: float | None) -> torch.Tensor:
    """err^2 / 2, or Huber's loss with ``huber_delta`` (quadratic within it, linear beyond)."""
    if huber_delta is None:
        return 0.5 * err**2
    a = err.abs()
    return torch.where(a <= huber_delta, 0.5 * err**2, huber_delta * (a - 0.5 * huber_delta))


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None,
               huber_delta: float | None = None) -> torch.Tensor:
    """The critic's loss against the GAE returns R: the larger of the loss of V and of the clipped
    V_old + clip(V - V_old, -clip, clip) (no clipping where ``clip`` is None), averaged."""
    loss = _error_loss(returns - values, huber_delta)
    if clip is not None:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        loss = torch.max(loss, _error_loss(returns - clipped, huber_delta))
    return loss.mean()


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R): 1 where the critic predicts the returns, 0 (or below) where it predicts nothing."""
    var = float(returns.var(unbiased=False))
    if var == 0.0:
        return float("nan")
    return 1.0 - float((returns - values).var(unbiased=False)) / var
