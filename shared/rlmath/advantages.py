"""Advantage estimators (``train.advantage``), the formulas the coordinator (train.grouping "episode") and the
trainer (train.grouping "trainer") both use. Plain numpy: the coordinator does not load torch for them.

Symbols: r_i the reward of sample i, g its AT-GRPO group (one environment, agent and turn), G_g its size.

- grpo (Shao et al. 2024):       A_i = (r_i - mean_g r) / (std_g r + eps), population std
- dr_grpo (Liu et al. 2025):     A_i = r_i - mean_g r  (no std normalisation)
- rloo (Ahmadian et al. 2024):   A_i = r_i - mean_{j in g, j != i} r_j = G_g / (G_g - 1) * (r_i - mean_g r)
- reinforce_pp (Hu 2025):        A_i = (R_i - mean_B R) / (std_B R + eps) over the response tokens of the whole
  global batch B, R_i the return of every token of sample i (the outcome reward, gamma 1): no groups. With a
  per-token reward penalty p_t (KL to the reference, ``train.kl_in: reward``) the return of token t is
  R_it = r_i - sum_{s >= t} p_is, whitened the same way (:func:`batch_token_advantages`).

A group of one sample, or one whose rewards are all equal, gets A = 0 in the group estimators.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

EPS = 1e-6


def _grouped(rewards: Sequence[float] | Any,
             group_ids: Sequence[Hashable]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(r, g, count, mean): the rewards, each one's group index, and each group's size and mean reward."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if len(group_ids) != r.size:
        raise ValueError(f"{r.size} rewards but {len(group_ids)} group ids")
    index: dict[Hashable, int] = {}
    g = np.fromiter((index.setdefault(k, len(index)) for k in group_ids), dtype=np.int64, count=r.size)
    count = np.bincount(g, minlength=len(index)).astype(np.float64)
    mean = np.bincount(g, weights=r, minlength=len(index)) / np.maximum(count, 1)
    return r, g, count, mean


def group_advantages(rewards: Sequence[float] | Any, group_ids: Sequence[Hashable], eps: float = EPS) -> np.ndarray:
    """A_i = (r_i - mean_g(r)) / (std_g(r) + eps), population std per group; singleton/constant groups get 0."""
    r, g, count, mean = _grouped(rewards, group_ids)
    var = np.bincount(g, weights=(r - mean[g]) ** 2, minlength=count.size) / np.maximum(count, 1)
    std = np.sqrt(var)
    adv = (r - mean[g]) / (std[g] + eps)
    # A group of one, or one where every reward is equal, carries no learning signal.
    degenerate = (count[g] < 2) | (std[g] == 0)
    return np.where(degenerate, 0.0, adv)


GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
ESTIMATORS = (*GROUP_ESTIMATORS, "reinforce_pp")


def estimate(rewards: Sequence[float] | Any, group_ids: Sequence[Hashable], estimator: str = "grpo",
             eps: float = EPS) -> np.ndarray:
    """A_i of a group estimator (``grpo``, ``dr_grpo``, ``rloo``) within each group of ``group_ids``."""
    if estimator == "grpo":
        return group_advantages(rewards, group_ids, eps)
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r} is not one of {GROUP_ESTIMATORS} (reinforce_pp "
                         "normalises over the global batch: batch_advantages)")
    r, g, count, mean = _grouped(rewards, group_ids)
    centred = r - mean[g]
    if estimator == "rloo":  # r_i - mean of the others = G / (G - 1) * (r_i - mean)
        centred = centred * count[g] / np.maximum(count[g] - 1, 1)
    return np.where(count[g] < 2, 0.0, centred)


def batch_advantages(rewards: Sequence[float] | Any, tokens: Sequence[int], eps: float = EPS) -> np.ndarray:
    """REINFORCE++: each sample's return (its reward, on every one of its ``tokens``) whitened over the response
    tokens of the whole batch (token-weighted mean and population std, as the token-level normalisation of
    OpenRLHF's REINFORCE++); a batch whose returns are all equal gets 0."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    w = np.asarray(tokens, dtype=np.float64).reshape(-1)
    if w.size != r.size:
        raise ValueError(f"{r.size} rewards but {w.size} token counts")
    total = w.sum()
    if total <= 0:
        return np.zeros_like(r)
    mean = float((w * r).sum() / total)
    std = float(np.sqrt((w * (r - mean) ** 2).sum() / total))
    if std == 0.0:
        return np.zeros_like(r)
    return (r - mean) / (std + eps)


def batch_token_advantages(rewards: Sequence[float] | Any, penalties: Sequence[np.ndarray],
                           eps: float = EPS) -> list[np.ndarray]:
    """REINFORCE++ with per-token rewards: sample i's outcome reward r_i on its last token and ``-penalties[i][t]``
    on every token t, so its return at token t (gamma 1) is R_it = r_i - sum_{s >= t} p_is; the returns are
    whitened over all response tokens of the batch (mean and population std). One array per sample; a batch whose
    returns are all equal gets zeros. With zero penalties it is :func:`batch_advantages` on every token."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if len(penalties) != r.size:
        raise ValueError(f"{r.size} rewards but {len(penalties)} penalty arrays")
    returns = [ri - np.cumsum(np.asarray(p, dtype=np.float64)[::-1])[::-1] for ri, p in zip(r, penalties, strict=True)]
    flat = np.concatenate(returns) if returns else np.zeros(0)
    if flat.size == 0:
        return [np.zeros(0) for _ in returns]
    mean = float(flat.mean())
    std = float(np.sqrt(((flat - mean) ** 2).mean()))
    if std == 0.0:
        return [np.zeros_like(g) for g in returns]
    return [(g - mean) / (std + eps) for g in returns]
