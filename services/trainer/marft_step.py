"""MARFT's policy step (docs/marft.md) over a learner's held global batch: the registered ``marft`` (MARFT-A) or
``marft_token`` (MARFT-T) loss, agent by agent, the trust-region cut, one optimizer step.

In the on-policy modes the advantages come normalised: the coordinator holds a batch's episodes and normalises their
GAE advantages over the whole batch, every agent of every model pooled, as the listing normalises its ``[B, n]``
buffer (services/coordinator/marft.py); in async mode the step normalises over its own samples. Only the selected agent's samples enter the loss (``(version //
marft.agent_interval) % n``, every agent when the interval is 0), so only its adapter gets gradients and a model
none of whose agents is selected does not step. Above ``marft.kl_target`` the approximate KL cuts the step: k3 of
each action's log-ratio averaged over the actions (the listing; ``marft.kl_level: token``: over the tokens).
The version moves on whether or not the weights do (the on-policy gate and the agent cycle go on).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from services.trainer import optstep
from shared.kernel.schemas import Sample
from shared.rlmath.losses import LossSettings, PolicyBatch, regularised, token_k3
from shared.rlmath.marft import agent_to_train, normalise_advantages

if TYPE_CHECKING:
    from services.trainer.learner import Learner, StepResult


def step_advantages(held: Sequence[Sample], token: bool) -> list[Any]:
    """Each sample's advantage for the step: one number (MARFT-A), or one per response token (MARFT-T; a sample
    without token advantages repeats its number on every token). An on-policy batch comes normalised by the
    coordinator (its samples carry ``batch_samples``); in async mode, which has no batches, the step normalises
    over its own samples, every agent of this model pooled."""
    if token:
        adv: list[Any] = [np.asarray(s.token_advantages.numpy() if s.token_advantages is not None else
                                     np.full(int(s.response_ids.shape[0]), s.advantage or 0.0), dtype=np.float64)
                          for s in held]
    else:
        adv = [float(s.advantage or 0.0) for s in held]
    if not held or all(s.batch_samples is not None for s in held):
        return adv
    if token:
        flat = normalise_advantages(np.concatenate(adv))
        return list(np.split(flat, np.cumsum([a.size for a in adv])[:-1]))
    return normalise_advantages(adv).tolist()


def selection(learner: Learner, held: Sequence[Sample]
              ) -> tuple[list[int], dict[str, list[str]], dict[str, str], dict[str, float]]:
    """Which of ``held`` the step trains (none in the critic's warm-up; the selected agent's alone, agent by
    agent), the others by reason with the reason in words, and the step's ``marft_agent`` statistic."""
    mc = learner.marft_cfg
    selected = agent_to_train(learner.version, mc.agent_interval, len(learner.marft_agents))
    agent = None if selected is None else learner.marft_agents[selected]
    untrained: dict[str, list[str]] = {}
    why: dict[str, str] = {}
    stats: dict[str, float] = {"marft_agent": -1.0 if selected is None else float(selected)}
    if learner.version < mc.warmup:
        untrained["critic_warmup"] = [s.sample_id for s in held]
        why["critic_warmup"] = f"critic warm-up: version {learner.version} < marft.warmup {mc.warmup}"
        return [], untrained, why, stats
    train_idx = [i for i, s in enumerate(held) if agent is None or s.agent == agent]
    others = [s.sample_id for s in held if agent is not None and s.agent != agent]
    if others:
        untrained["marft_agent"] = others
        why["marft_agent"] = (f"agent-by-agent: version {learner.version} trains agent {agent!r} "
                              f"((v // {mc.agent_interval}) % {len(learner.marft_agents)} = {selected})")
    return train_idx, untrained, why, stats


def settings_of(learner: Learner, samples: Sequence[Sample], token: bool
                ) -> tuple[LossSettings, float, list[int] | None]:
    """The loss settings of a step over ``samples`` (its mean over their actions, or over their tokens in
    MARFT-T), their response tokens, and each one's word count where actions are normalised by words."""
    mc = learner.marft_cfg
    total_tokens = float(sum(int(s.response_ids.shape[0]) for s in samples))
    words = None
    if mc.action_norm == "word":
        words = [max(1, len(learner.tokenizer.decode(s.response_ids.numpy().tolist()).split())) for s in samples]
    settings = LossSettings(clip_eps=learner.clip_eps, denominator=max(total_tokens, 1.0) if token else
                            float(len(samples)), action_norm=mc.action_norm)
    return settings, total_tokens, words


def sub_batch(learner: Learner, batch: Any, advantages: Sequence[Any], words: Sequence[int] | None,
              settings: LossSettings, total_tokens: float, token: bool) -> tuple[torch.Tensor, float, dict[str, float]]:
    """One sub-batch of a MARFT step: its loss (with the entropy bonus and a KL-to-reference term as means over
    the step's ``total_tokens``), its part of the trust region's KL sum, and its statistics."""
    from services.trainer.learner import token_layout

    logp = learner._logprobs(learner.scorer, batch)
    mask = batch.loss_mask.to(logp.dtype)
    w = None if words is None else torch.as_tensor(list(words), device=logp.device)
    a = token_layout(list(advantages), batch.loss_mask)
    loss, part = learner.policy_loss(PolicyBatch(logp, batch.logp_behav, a, mask, words=w), settings)
    ref = learner._reference_logprobs(batch) if learner.kl_loss else None
    loss = regularised(loss, part, mask, "token-mean", max(total_tokens, 1.0), entropy=learner.scorer.last_entropy,
                       entropy_coef=learner.entropy_coef, logp=logp, logp_ref=ref, kl_coef=learner.kl_coef,
                       kl_estimator=learner.kl_estimator)
    if learner.marft_cfg.kl_level == "action" and not token:  # k3 of each action's log-ratio, over its actions
        kl = part["approx_kl"] * len(advantages)
    elif token:  # MARFT-T: its actions are the tokens
        kl = part["approx_kl"] * part["tokens"]
    else:  # marft.kl_level token under MARFT-A: k3 of each token's log-ratio
        kl = float(token_k3(logp.detach(), batch.logp_behav, mask)) * part["tokens"]
    return loss, kl, {k: v for k, v in part.items() if k != "approx_kl"}


def step_kl(learner: Learner, kl_sum: float, n: int, total_tokens: float, token: bool) -> float:
    """The trust region's approximate KL of a step: a mean over its actions (the listing) or its tokens."""
    action_kl = learner.marft_cfg.kl_level == "action" and not token
    return kl_sum / max(float(n) if action_kl else total_tokens, 1.0)


def marft_step(learner: Learner) -> StepResult:
    """MARFT's step of ``learner`` over the samples it holds (see the module's docstring)."""
    from services.trainer.learner import StepResult

    held, learner._held = learner._held, []
    learner.accumulated = 0
    mc = learner.marft_cfg
    token = mc.variant == "token"
    adv = step_advantages(held, token)
    train_idx, untrained, why, stats = selection(learner, held)
    loss_sum, kl = 0.0, 0.0
    if train_idx:
        loss_sum, kl, parts = accumulate(learner, [held[i] for i in train_idx], [adv[i] for i in train_idx], token)
        stats.update(optstep.merge_token_stats(parts))
    stats["approx_kl"] = kl
    cut = bool(train_idx) and mc.kl_target is not None and kl > mc.kl_target
    params = [p for p in learner.trainable if p.grad is not None]
    lr = optstep.scheduled_lr(learner.optim, learner.version, learner.max_versions)
    grad_norm, skipped = optstep.apply(learner.optimizer, params, lr, learner.grad_clip, update=not cut)
    if cut:
        grad_norm, skipped = 0.0, False
        untrained["kl_cut"] = [held[i].sample_id for i in train_idx]
        why["kl_cut"] = (f"trust-region cut: approximate KL {kl:.3g} > marft.kl_target {mc.kl_target:g} at "
                         f"version {learner.version}; the policy step is skipped")
    if not skipped:
        learner.version += 1
    stats.update(lr=lr, kl_cut=float(cut), trained_samples=float(0 if cut else len(train_idx)))
    learner._parts, learner._loss_sum = [], 0.0
    return StepResult(learner.version, len(held), loss_sum, grad_norm, stats, skipped, untrained, why)


def accumulate(learner: Learner, samples: Sequence[Sample], advantages: Sequence[Any], token: bool
               ) -> tuple[float, float, list[dict[str, float]]]:
    """Forward + backward of the registered MARFT loss over ``samples`` (their normalised ``advantages``: one per
    sample, or one array per sample in MARFT-T), sub-batch by sub-batch; returns (loss, the trust region's
    approximate KL over all of them, per-sub-batch statistics). The loss is the mean over the actions (MARFT-A) or
    the tokens (MARFT-T) of all ``samples``; the entropy bonus and a KL-to-reference term are token means."""
    settings, total_tokens, words = settings_of(learner, samples, token)
    loss_sum, kl_sum = 0.0, 0.0
    parts: list[dict[str, float]] = []
    for idx, batch in learner._batches(samples):
        loss, kl, part = sub_batch(learner, batch, [advantages[i] for i in idx],
                                   None if words is None else [words[i] for i in idx], settings, total_tokens, token)
        kl_sum += kl
        learner._backward(loss)
        loss_sum += float(loss.detach())
        parts.append(part)
    return loss_sum, step_kl(learner, kl_sum, len(samples), total_tokens, token), parts
