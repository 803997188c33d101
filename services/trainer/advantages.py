"""A micro-batch's advantages in the trainer: the coordinator's where it set them (train.grouping "episode"), else a
group estimator of :mod:`shared.rlmath.advantages` over this micro-batch's groups (train.grouping "trainer")."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

from shared.rlmath.advantages import estimate


def micro_batch_advantages(rewards: Sequence[float], group_ids: Sequence[Hashable],
                           given: Sequence[float | None], estimator: str = "grpo") -> torch.Tensor:
    """A_i per sample, float32: ``given[i]`` where the coordinator set it, else ``estimator`` over the groups of the
    samples without one, within this micro-batch."""
    if not len(rewards) == len(group_ids) == len(given):
        raise ValueError(f"{len(rewards)} rewards, {len(group_ids)} group ids and {len(given)} advantages: "
                         "expected one of each per sample")
    adv = torch.zeros(len(rewards), dtype=torch.float32)
    todo = [i for i, a in enumerate(given) if a is None]
    if todo:
        adv[todo] = torch.from_numpy(estimate([rewards[i] for i in todo], [group_ids[i] for i in todo],
                                              estimator)).to(torch.float32)
    for i, a in enumerate(given):
        if a is not None:
            if not math.isfinite(a):
                raise ValueError(f"sample {i}: advantage must be a finite number, got {a!r}")
            adv[i] = a
    return adv
