"""The subprocess side of the action pool: length-prefixed msgpack requests on stdin, results on stdout.

``python -m services.actions.worker --memory-mb 512``. One request at a time; a failing action answers an
error and the worker lives on; the address space is capped so a runaway action cannot take the host.
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import struct
import sys
import time
import traceback
from typing import Any, BinaryIO

import msgpack

HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024


def write_frame(out: BinaryIO, obj: Any) -> None:
    """Write one length-prefixed msgpack frame and flush."""
    data = msgpack.packb(obj, use_bin_type=True)
    out.write(HEADER.pack(len(data)) + data)
    out.flush()


def read_frame(inp: BinaryIO) -> Any | None:
    """Read one frame; ``None`` at end of input."""
    head = inp.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (n,) = HEADER.unpack(head)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    data = inp.read(n)
    if len(data) < n:
        return None
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def run_one(request: Any) -> dict[str, Any]:
    """Run one ``{"kind", "payload", "timeout_s"?}`` request against the registry; never raises."""
    from services.actions.actions import REGISTRY, time_budget_s

    if not isinstance(request, dict):
        return {"ok": False, "error": f"expected a map request, got {type(request).__name__}"}
    kind, payload = request.get("kind"), request.get("payload")
    fn = REGISTRY.get(kind) if isinstance(kind, str) else None
    if fn is None:
        return {"ok": False, "error": f"unknown action kind {kind!r}; known: {sorted(REGISTRY)}"}
    if not isinstance(payload, dict):
        return {"ok": False, "error": f"payload must be a map, got {type(payload).__name__}"}
    cpus = request.get("cpus")
    if cpus is not None:
        # allocate-on-execution: this action (and every process it forks) runs on exactly its allocated cores
        try:
            os.sched_setaffinity(0, [int(c) for c in cpus])
        except (OSError, ValueError, TypeError) as exc:
            return {"ok": False, "error": f"cannot bind the action to cores {cpus!r}: {exc}"}
    budget = request.get("timeout_s")
    token = time_budget_s.set(float(budget) if isinstance(budget, int | float) and budget > 0 else None)
    try:
        t0 = time.monotonic()
        result = fn(payload)
        return {"ok": True, "result": result, "exec_s": time.monotonic() - t0}
    except MemoryError:
        return {"ok": False, "error": "MemoryError: the action exceeded the worker memory limit"}
    except Exception as exc:
        tb = traceback.format_exc(limit=3)
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": tb}
    finally:
        time_budget_s.reset(token)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Chorus action worker (speaks length-prefixed msgpack on stdio).")
    p.add_argument("--memory-mb", type=int, default=512)
    p.add_argument("--preload", action="append", default=[],
                   help="a module to import before the ready frame (a dataset's grader that is slow to import)")
    args = p.parse_args(argv)
    limit = args.memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # The protocol owns the real stdout; anything an action prints goes to stderr instead.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer
    import services.actions.actions  # noqa: F401  - load the registry before the first request

    for module in args.preload:  # imported now, not inside the first request's time budget
        try:
            importlib.import_module(module)
        except Exception as exc:  # the action that needs it reports it as its error
            print(f"action worker: cannot preload {module}: {type(exc).__name__}: {exc}", file=sys.stderr)
    write_frame(out, {"ready": True, "pid": os.getpid()})
    while True:
        request = read_frame(inp)
        if request is None:
            return 0
        write_frame(out, run_one(request))


if __name__ == "__main__":
    sys.exit(main())
