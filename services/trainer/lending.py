"""Cores the training pool frees, lent to other work until a slot needs them back (FlexMARL §6.1, §8.4).

The pool binds a slot's cores only while a model trains on it (:class:`~services.trainer.pool.TrainingPool`); what
it frees has to *do* something for the machine's utilisation to rise. :class:`CoreLender` is a pool listener
(``pool.listeners.append(lender)``): every time slots change hands it is told the free cores, and it lends each
newly free core to the **borrower** of that core and reclaims each core a slot took back.

A borrower is one elastic worker pinned to one core: a rollout engine instance that is started once (its model
loaded: a process start with torch's import takes seconds, longer than most free spells) and then *parked*
(blocked, no CPU) whenever its core is not lent. ``lend(core)`` lets it take work; ``reclaim(core)`` makes it
finish the short chunk it is in (a few decode steps) and take no more. Both return at once: the lender runs in the
trainer's thread, inside the pool's ``acquire`` / ``release``, and a blocking reclaim would only move the same
chunk's wait from the core to the trainer. So for at most one chunk a returning slot shares its core with the
borrower; the chunk length bounds what training loses to lending.

The pool calls its listeners outside its lock, so two trainers' notifications can arrive out of order (the older
free list last). With ``current`` (the pool's :meth:`~services.trainer.pool.TrainingPool.free_cores`) the lender
reads the free cores afresh under its own lock on every notification and ignores the list it was handed: whichever
notification runs last sees the newest state, so a core is never left lent to a borrower while a slot holds it.

Pure logic with no I/O of its own (tested with fake borrowers and a fake clock); the borrowers own the processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class Borrower(Protocol):
    """Work that runs on cores the pool lends it (an elastic rollout instance pinned to a core)."""

    def lend(self, core: int) -> None:
        """``core`` is free: take work on it (returns at once)."""

    def reclaim(self, core: int) -> None:
        """A slot needs ``core``: finish the current short chunk and take no more work on it (returns at once)."""


@dataclass
class CoreLoan:
    core: int
    lent: bool = False
    since: float = 0.0  # when the current loan began
    lent_s: float = 0.0  # seconds lent, finished loans
    loans: int = 0
    reclaims: int = 0


class CoreLender:
    """Lends the pool's free cores to their borrowers; a callable pool listener (thread-safe)."""

    def __init__(self, borrowers: Mapping[int, Borrower], *, current: Callable[[], Iterable[int]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.borrowers = dict(borrowers)
        self.current = current
        self.clock = clock
        self.lock = threading.Lock()
        self.loans = {c: CoreLoan(c) for c in self.borrowers}
        self.started = clock()
        self.closed = False

    def __call__(self, free: list[int]) -> None:
        """The pool's listener: ``free`` are the cores no slot holds now."""
        self.update(free)

    def update(self, free: Iterable[int]) -> None:
        """Lend every free core that has a borrower and is not lent yet; reclaim every lent core no longer free.
        Reclaims go first (a slot is waiting on them), then loans. A borrower that raises does not stop the others;
        the first error is raised after all of them were told (the loan's state is what was asked of it)."""
        with self.lock:
            if self.closed:
                return
            self._apply(set(self.current() if self.current is not None else free))

    def _apply(self, want: set[int]) -> None:
        """Under the lock: make the lent cores ``want`` (those of them that have a borrower)."""
        now = self.clock()
        take = [ln for ln in self.loans.values() if ln.lent and ln.core not in want]
        give = [ln for ln in self.loans.values() if not ln.lent and ln.core in want]
        errors: list[BaseException] = []
        for ln in take:
            ln.lent, ln.lent_s, ln.reclaims = False, ln.lent_s + now - ln.since, ln.reclaims + 1
            self._tell(self.borrowers[ln.core].reclaim, ln.core, errors)
        for ln in give:
            ln.lent, ln.since, ln.loans = True, now, ln.loans + 1
            self._tell(self.borrowers[ln.core].lend, ln.core, errors)
        if errors:
            raise errors[0]

    @staticmethod
    def _tell(fn: Callable[[int], None], core: int, errors: list[BaseException]) -> None:
        try:
            fn(core)
        except Exception as exc:  # the other borrowers are still told; the caller gets the first error
            errors.append(exc)

    def lent(self) -> list[int]:
        with self.lock:
            return sorted(c for c, ln in self.loans.items() if ln.lent)

    def lent_seconds(self, now: float | None = None) -> dict[int, float]:
        """Per core, the seconds it has been lent (the current loan up to ``now`` included)."""
        with self.lock:
            now = self.clock() if now is None else now
            return {c: ln.lent_s + (now - ln.since if ln.lent else 0.0) for c, ln in self.loans.items()}

    def snapshot(self) -> dict[str, Any]:
        """For the pool's metrics: per core whether it is lent, lent seconds, loans and reclaims."""
        secs = self.lent_seconds()
        with self.lock:
            span = self.clock() - self.started
            return {"cores": [{"core": c, "lent": ln.lent, "lent_s": round(secs[c], 3), "loans": ln.loans,
                               "reclaims": ln.reclaims} for c, ln in sorted(self.loans.items())],
                    "lent_share": round(sum(secs.values()) / (span * len(self.loans)), 4)
                    if span > 0 and self.loans else 0.0}

    def close(self) -> None:
        """Reclaim every lent core and ignore later notifications (detach from the pool's listeners first)."""
        with self.lock:
            self.closed = True
            self._apply(set())
