"""First-come-first-served allocation of a CPU core budget (pure asyncio, no I/O).

Requests are granted strictly in arrival order: a waiting request that needs more cores than are free
blocks the ones behind it (no backfilling), so a large action cannot starve.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class FcfsScheduler:
    """A FIFO queue over ``cores`` cores; ``async with sched.slot(n)`` holds ``n`` of them."""

    def __init__(self, cores: int) -> None:
        if cores < 1:
            raise ValueError(f"core budget must be >= 1, got {cores}")
        self.cores = cores
        self.free = cores
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self.granted_total = 0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def busy(self) -> int:
        return self.cores - self.free

    def _clamp(self, n: int) -> int:
        # An action never gets more than the whole budget; asking for more would deadlock.
        return max(1, min(n, self.cores))

    async def acquire(self, n: int = 1) -> int:
        """Wait for ``n`` cores in arrival order; returns the number granted (clamped to the budget)."""
        n = self._clamp(n)
        if not self._waiters and self.free >= n:
            self.free -= n
            self.granted_total += 1
            return n
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted and cancelled in the same tick: give the cores back
            else:
                self._remove(fut)
                self._wake()  # the head may have changed
            raise
        return n

    def release(self, n: int = 1) -> None:
        """Return ``n`` cores and grant waiters at the head of the queue that now fit."""
        self.free = min(self.cores, self.free + self._clamp(n))
        self._wake()

    def _remove(self, fut: asyncio.Future[None]) -> None:
        for item in list(self._waiters):
            if item[1] is fut:
                self._waiters.remove(item)
                return

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.free < n:
                return
            self._waiters.popleft()
            self.free -= n
            self.granted_total += 1
            fut.set_result(None)

    @asynccontextmanager
    async def slot(self, n: int = 1) -> AsyncIterator[int]:
        """Hold ``n`` cores for the body of the ``async with``."""
        granted = await self.acquire(n)
        try:
            yield granted
        finally:
            self.release(granted)
