"""Learning-rate schedules as a function of the version (optimizer steps applied), so a restarted or resumed
trainer continues the schedule exactly where its committed version left it. ``optim.schedule``:

- constant:  lr
- linear:    warm-up, then lr * (m + (1 - m) * (1 - p))
- cosine:    warm-up, then lr * (m + (1 - m) * (1 + cos(pi * p)) / 2)

with the warm-up lr * k / W over the first W = ``optim.warmup_versions`` steps, m = ``optim.min_lr_ratio`` and p
the share of the steps after the warm-up done, (k - W) / (T - W), for step k of T = ``train.max_versions``.
"""

from __future__ import annotations

import math
from typing import Literal

Schedule = Literal["constant", "linear", "cosine"]


def lr_factor(step: int, total: int, schedule: Schedule, warmup: int = 0, min_ratio: float = 0.0) -> float:
    """The multiplier of the base lr for optimizer step ``step`` (1-based: the step that makes that version)."""
    if warmup > 0 and step <= warmup:
        return step / warmup
    if schedule == "constant":
        return 1.0
    p = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    decay = 1.0 - p if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return min_ratio + (1.0 - min_ratio) * decay
