"""Procedural arithmetic tasks with checkable answers, small enough for a byte-level model to learn."""

from __future__ import annotations

import random
from dataclasses import dataclass

from shared.config import TaskConfig


@dataclass(frozen=True)
class Task:
    task_id: str
    question: str  # e.g. "3+4="
    answer: str  # e.g. "7"


def solve(a: int, op: str, b: int, modulo: int | None) -> str:
    """The answer text of ``a op b``, reduced mod ``modulo`` (always non-negative) when it is set."""
    if op == "+":
        result = a + b
    elif op == "-":
        result = a - b
    elif op == "*":
        result = a * b
    else:
        raise ValueError(f"unknown operator {op!r}: expected one of + - *")
    return str(result % modulo) if modulo else str(result)


def make_task(rng: random.Random, cfg: TaskConfig, task_id: str | None = None) -> Task:
    """Draw one task; deterministic given the state of ``rng`` (the id too, unless ``task_id`` is given)."""
    a = rng.randint(0, cfg.max_operand)
    b = rng.randint(0, cfg.max_operand)
    op = rng.choice(cfg.ops)
    tid = f"{rng.getrandbits(48):012x}"
    return Task(task_id=task_id or tid, question=f"{a}{op}{b}=", answer=solve(a, op, b, cfg.modulo))


class TaskSource:
    """Numbered tasks from one seeded stream: ids ``<prefix>-<n>`` are unique across restarts via the prefix."""

    def __init__(self, seed: int, cfg: TaskConfig, prefix: str) -> None:
        self.rng = random.Random(seed)
        self.cfg = cfg
        self.prefix = prefix
        self.count = 0

    def next(self) -> tuple[int, Task]:
        """The next (index, task)."""
        index = self.count
        self.count += 1
        return index, make_task(self.rng, self.cfg, f"{self.prefix}-{index}")
