"""``chorus monitor --raw SUBJECT``: the messages of a run's subjects, decoded, one per line, with nothing but the
install (no ``nats`` CLI). Metrics and events are JSON already; data-plane messages are msgpack, shown as JSON
with their arrays as dtype, shape and leading values.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

SHOWN = 8  # array values shown per array


def readable(data: bytes) -> Any:
    """A message as plain data: JSON as is, msgpack decoded (arrays summarised), anything else as its size."""
    try:
        return json.loads(data)
    except ValueError:
        pass
    try:
        return _plain(msgpack.unpackb(data, raw=False, strict_map_key=False))
    except Exception:  # not msgpack either: msgpack raises several unrelated types
        return {"bytes": len(data)}


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        if {"dtype", "shape", "data"} <= set(value) and isinstance(value["data"], bytes):
            return _array(value)
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return value


def _array(value: dict[str, Any]) -> dict[str, Any]:
    out = {"dtype": value["dtype"], "shape": value["shape"]}
    if value["dtype"] in ("int32", "int64", "float32", "float16", "uint8"):
        flat = np.frombuffer(value["data"], dtype=np.dtype(value["dtype"]).newbyteorder("<")).tolist()
        out["values"] = flat[:SHOWN] + (["..."] if len(flat) > SHOWN else [])
    return out


def line(subject: str, data: bytes, prefix: str) -> str:
    """``<subject relative to the run> <message as one line of JSON>``."""
    return f"{subject.removeprefix(prefix)} {json.dumps(readable(data), separators=(',', ':'), default=str)}"


async def watch(nc: Any, prefix: str, subject: str, emit: Callable[[str], None], *, count: int | None,
                duration_s: float | None) -> int:
    """Print every message on ``<prefix>.<subject>`` (NATS wildcards allowed) until ``count`` were printed or
    ``duration_s`` passed; the number printed."""
    done = asyncio.Event()
    seen = 0

    async def on_msg(msg: Any) -> None:
        nonlocal seen
        if count is not None and seen >= count:
            return
        seen += 1
        emit(line(msg.subject, msg.data, prefix + "."))
        if count is not None and seen >= count:
            done.set()

    sub = await nc.subscribe(f"{prefix}.{subject}", cb=on_msg)
    try:
        await asyncio.wait_for(done.wait(), duration_s)
    except TimeoutError:
        pass
    finally:
        await sub.unsubscribe()
    return seen
