"""What deployments (compose, Kubernetes, systemd) need beside ``chorus serve``: a fresh run id per deployment,
shared through a file, and the health probe of one service instance through its NATS micro-service ping.

Kept light on imports: ``chorus health`` runs as a container probe every few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.kernel.files import write_atomic
from shared.kernel.subjects import Names, check_token

RUN_FILE_POLL_S = 0.2


def unique_run_id(base: str, now: float | None = None) -> str:
    """``<base>-YYYYmmdd-HHMMSS``: the run id `chorus up` makes from ``run.id``."""
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"


def new_run_id(base: str, now: float | None = None) -> str:
    """``<base>-YYYYmmdd-HHMMSS-<4 hex>``: unique per deployment even when two start in the same second."""
    return check_token(f"{unique_run_id(base, now)}-{secrets.token_hex(2)}", "run id")


def write_run_file(path: Path, run_id: str) -> None:
    """Write the run id atomically (a reader never sees half a file)."""
    write_atomic(path, run_id + "\n")


def read_run_file(path: Path) -> str | None:
    """The run id in ``path``, or None while the file is missing or empty; ValueError if it is not a run id."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    if not text:
        return None
    return check_token(text, f"run id in {path}")


class Interrupted(Exception):
    """SIGTERM or SIGINT arrived while waiting."""


def wait_run_file(path: Path, timeout_s: float | None = None, on_wait: Callable[[], None] | None = None) -> str:
    """Block until ``path`` holds a run id. SIGTERM/SIGINT end the wait with :class:`Interrupted` (a container's
    PID 1 gets no default signal handling, so the handlers are explicit); TimeoutError after ``timeout_s``.
    ``on_wait`` is called once the signals are handled, before the first look at the file."""
    stop = False

    def on_signal(signum: int, frame: Any) -> None:  # noqa: ARG001 - signal handler signature
        nonlocal stop
        stop = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        if on_wait is not None:
            on_wait()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if stop:
                raise Interrupted(f"interrupted while waiting for the run file {path}")
            run_id = read_run_file(path)
            if run_id is not None:
                return run_id
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no run id in {path} after {timeout_s:g} s")
            time.sleep(RUN_FILE_POLL_S)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_matches(answer_run: str, run: str | None, base: str) -> bool:
    """Whether a ping answer's run is the one asked for: exactly ``run`` when it is known, else the config's
    ``run.id`` itself or one made from it by ``chorus up`` / ``chorus new-run`` (``<base>-...``)."""
    if run is not None:
        return answer_run == run
    return answer_run == base or answer_run.startswith(base + "-")


async def probe(url: str, service: str, *, model: str | None, instance: str, run: str | None, base: str,
                timeout_s: float, connect_timeout_s: float, nats_cfg: Any = None) -> tuple[bool, str]:
    """Ping every ``chorus-<service>`` on the bus and wait for the answer of this instance (model, instance, run).
    ``nats_cfg``: the credentials of an observer (a secured server). Returns (healthy, one-line reason)."""
    from shared.kernel.bus import connect

    deadline = time.monotonic() + timeout_s
    try:
        nc = await asyncio.wait_for(connect(url, f"chorus-health.{service}", timeout_s=connect_timeout_s,
                                            nats_cfg=nats_cfg, kind="observer" if nats_cfg is not None else None),
                                    max(0.1, timeout_s))
    except Exception as exc:  # nats raises its own error types for an unreachable server, asyncio a TimeoutError
        return False, f"cannot reach NATS at {url} within {timeout_s:g} s ({type(exc).__name__}: {exc})"
    found = asyncio.Event()
    seen: list[str] = []
    try:
        inbox = nc.new_inbox()

        async def on_reply(msg: Any) -> None:
            with contextlib.suppress(ValueError):
                data = json.loads(msg.data)
                meta = data.get("metadata") or {} if isinstance(data, dict) else {}
                seen.append(f"{meta.get('run')}/{meta.get('model') or '-'}/{meta.get('instance')}")
                if (str(meta.get("instance")) == instance and (meta.get("model") or None) == model
                        and run_matches(str(meta.get("run")), run, base)):
                    found.set()

        sub = await nc.subscribe(inbox, cb=on_reply)
        await nc.publish(Names.srv_ping(service), b"", reply=inbox)
        await nc.flush(timeout=max(0.1, deadline - time.monotonic()))  # type: ignore[arg-type]  # seconds, float
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(found.wait(), max(0.05, deadline - time.monotonic()))
        await sub.unsubscribe()
    except Exception as exc:
        return False, f"ping of chorus-{service} at {url} failed: {type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 2.0)
    who = f"{service}[{model or '-'}/{instance}] of run {run or base + '*'}"
    if found.is_set():
        return True, f"{who} answered at {url}"
    others = f"; answers from other instances: {', '.join(sorted(seen))}" if seen else ""
    return False, f"no answer from {who} at {url} within {timeout_s:g} s{others}"
