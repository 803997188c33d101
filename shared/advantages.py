"""GRPO group-normalised advantages, the one formula the coordinator (train.grouping "episode") and the trainer
(train.grouping "trainer") both use. Plain numpy: the coordinator does not load torch for it.

Symbols follow GRPO (Shao et al. 2024): r_i rewards, A_i = (r_i - mean_g(r)) / (std_g(r) + eps) within group g.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

EPS = 1e-6


def group_advantages(rewards: Sequence[float] | Any, group_ids: Sequence[Hashable], eps: float = EPS) -> np.ndarray:
    """A_i = (r_i - mean_g(r)) / (std_g(r) + eps), population std per group; singleton/constant groups get 0."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if len(group_ids) != r.size:
        raise ValueError(f"{r.size} rewards but {len(group_ids)} group ids")
    index: dict[Hashable, int] = {}
    g = np.fromiter((index.setdefault(k, len(index)) for k in group_ids), dtype=np.int64, count=r.size)
    count = np.bincount(g, minlength=len(index)).astype(np.float64)
    mean = np.bincount(g, weights=r, minlength=len(index)) / np.maximum(count, 1)
    var = np.bincount(g, weights=(r - mean[g]) ** 2, minlength=len(index)) / np.maximum(count, 1)
    std = np.sqrt(var)
    adv = (r - mean[g]) / (std[g] + eps)
    # A group of one, or one where every reward is equal, carries no learning signal.
    degenerate = (count[g] < 2) | (std[g] == 0)
    return np.where(degenerate, 0.0, adv)
