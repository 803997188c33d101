"""What of a micro-batch gets trained: staleness and duplicate filtering, and per-step bookkeeping."""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shared.kernel.schemas import Sample


class SeenIds:
    """Sample ids already trained (or accepted into the running accumulation); bounded, oldest forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add_all(self, ids: Iterable[str]) -> None:
        for sid in ids:
            self._ids[sid] = None
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)


@dataclass
class Filtered:
    keep: list[Sample]
    keep_idx: list[int]  # positions of ``keep`` in the micro-batch
    stale: list[Sample]
    duplicates: list[Sample]


def filter_samples(samples: Sequence[Sample], version: int, max_staleness: int, seen: SeenIds) -> Filtered:
    """Split a micro-batch into samples to train, stale ones (version - s.version > max_staleness) and repeats."""
    out = Filtered([], [], [], [])
    in_batch: set[str] = set()
    for i, s in enumerate(samples):
        if s.sample_id in seen or s.sample_id in in_batch:
            out.duplicates.append(s)
        elif version - s.version > max_staleness:
            out.stale.append(s)
        else:
            out.keep.append(s)
            out.keep_idx.append(i)
        in_batch.add(s.sample_id)
    return out


@dataclass
class StepBook:
    """The samples that went into the current accumulation, summarised for the step record."""

    rewards: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    truncated: int = 0  # samples whose reply was cut at max_new_tokens
    agents: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    sample_ids: list[str] = field(default_factory=list)
    adapters: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # LoRA adapter -> samples
    compute_s: float = 0.0

    def add(self, samples: Sequence[Sample], version: int) -> None:
        for s in samples:
            if s.adapter is not None:
                self.adapters[s.adapter] += 1
            self.rewards.append(s.reward)
            self.staleness.append(version - s.version)
            self.truncated += s.truncated
            self.agents[s.agent].append(s.reward)
            self.sample_ids.append(s.sample_id)

    def summary(self) -> dict[str, object]:
        n = len(self.rewards)
        mean = sum(self.rewards) / n if n else 0.0
        std = math.sqrt(sum((r - mean) ** 2 for r in self.rewards) / n) if n else 0.0
        return {
            "reward_mean": mean,
            "reward_std": std,
            "samples": n,
            "staleness_mean": sum(self.staleness) / n if n else 0.0,
            "staleness_max": max(self.staleness, default=0),
            "truncated": self.truncated / n if n else 0.0,
            "agent_reward": {a: sum(v) / len(v) for a, v in sorted(self.agents.items())},
            "sample_ids": list(self.sample_ids),
        }
