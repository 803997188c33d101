"""What a trainer commits with every version, and what it needs back after a restart (knows nothing of NATS).

A committed version is its weights (the flat buffer rollouters load, written beside this) and this state: the
optimizer's, the record of the step that made the version (which samples it trained) and the sample ids of the
last steps, so that a restarted trainer knows a redelivered micro-batch it already trained for a duplicate.
"""

from __future__ import annotations

import io
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

RECENT_STEPS = 64  # committed steps whose sample ids a restarted trainer still recognises, at least


def steps_remembered(max_staleness: int) -> int:
    """How many committed steps' sample ids to keep: a copy of a sample that arrives later than this is stale
    (older than ``max_staleness``) anyway, so it is dropped, never trained again."""
    return max(RECENT_STEPS, max_staleness + 2)


class RecentSteps:
    """Sample ids of the last ``keep`` committed steps, oldest first."""

    def __init__(self, keep: int = RECENT_STEPS, steps: Iterable[tuple[int, list[str]]] = ()) -> None:
        self.steps: deque[tuple[int, list[str]]] = deque(steps, maxlen=keep)

    def add(self, version: int, sample_ids: list[str]) -> None:
        self.steps.append((version, list(sample_ids)))

    def ids(self) -> Iterator[str]:
        for _, ids in self.steps:
            yield from ids

    def to_list(self) -> list[list[Any]]:
        return [[v, ids] for v, ids in self.steps]


@dataclass
class Committed:
    """A committed state as read back (the weights come from the version's weights object)."""

    version: int
    optimizer: dict[str, Any]  # the optimizer's state_dict
    record: dict[str, Any] | None  # the step event of this version (None for the initial version)
    recent: RecentSteps = field(default_factory=RecentSteps)


def pack_state(version: int, optimizer: dict[str, Any], record: dict[str, Any] | None, recent: RecentSteps) -> bytes:
    """One blob (torch.save) of a committed version's state."""
    import torch

    buf = io.BytesIO()
    torch.save({"version": version, "optimizer": optimizer, "record": record, "recent": recent.to_list()}, buf)
    return buf.getvalue()


def unpack_state(data: bytes | memoryview, keep: int = RECENT_STEPS) -> Committed:
    """Read :func:`pack_state`'s blob back; tensors only, no pickled code (``weights_only``)."""
    import torch

    raw = torch.load(io.BytesIO(bytes(data)), map_location="cpu", weights_only=True)
    if not isinstance(raw, dict) or not {"version", "optimizer", "record", "recent"} <= set(raw):
        raise ValueError("not a committed trainer state (expected version, optimizer, record and recent)")
    recent = RecentSteps(keep, ((int(v), [str(i) for i in ids]) for v, ids in raw["recent"]))
    return Committed(int(raw["version"]), raw["optimizer"], raw["record"], recent)
