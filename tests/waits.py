"""Waiting for a condition in a test: a deadline generous enough for a loaded machine, never a window of time.

A condition that holds returns at once; on a busy machine the test takes longer instead of failing.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

WAIT_S = 90.0  # the default deadline: minutes of slack for what takes a second on an idle machine


async def wait_until(cond: Callable[[], Any | Awaitable[Any]], what: str, timeout_s: float = WAIT_S,
                     interval_s: float = 0.05) -> Any:
    """The first truthy value of ``cond()`` (sync or async), asked every ``interval_s``; AssertionError naming
    ``what`` past the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f}s")
        await asyncio.sleep(interval_s)


def wait_until_sync(cond: Callable[[], Any], what: str, timeout_s: float = WAIT_S, interval_s: float = 0.05) -> Any:
    """:func:`wait_until` for code outside an event loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(interval_s)


async def connect(servers: str | list[str], timeout_s: float = WAIT_S, **options: Any) -> Any:
    """A test's NATS client, whose first connection is retried until ``timeout_s`` as a user's client retries it
    (a server just started on a loaded machine may answer late); ``options``: more of ``nats.connect``."""
    import nats

    return await asyncio.wait_for(nats.connect(servers, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                               connect_timeout=10, **options), timeout_s)
