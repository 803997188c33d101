"""A run's footprint on the server: which streams and buckets belong to it, whether it exists, removing it.

A run owns its events, trajectory and ready streams (every subject under ``chorus.<run>.``), its KV bucket and its
object store. ``chorus up`` refuses a run id that already has any of them unless it resumes the run (KV versions are
never inherited silently); ``chorus clean <run>`` deletes them.
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import StreamInfo
from nats.js.errors import NotFoundError

from shared.kernel.subjects import Names


async def run_streams(js: JetStreamContext, run: str) -> list[str]:
    """Names of the streams on the server that belong to ``run``, sorted: its message streams (every subject of
    theirs under ``chorus.<run>.``), its KV bucket's and its object store's."""
    names = Names(run)
    own = {f"KV_{names.kv_bucket}", f"OBJ_{names.obj_bucket}"}
    found = []
    infos: list[StreamInfo] = []
    while page := await js.streams_info(offset=len(infos)):  # a page holds up to 256 streams
        infos += page
    for info in infos:
        subjects = info.config.subjects or []
        name = info.config.name or ""
        if name in own or (subjects and all(s.startswith(names.prefix + ".") for s in subjects)):
            found.append(name)
    return sorted(found)


async def run_exists(js: JetStreamContext, run: str) -> bool:
    """Whether any stream or bucket of ``run`` is on the server."""
    return bool(await run_streams(js, run))


async def clean_run(js: JetStreamContext, run: str) -> list[str]:
    """Delete every stream and bucket of ``run``; returns what was removed (empty: there was nothing)."""
    removed = []
    for stream in await run_streams(js, run):
        try:
            await js.delete_stream(stream)
        except NotFoundError:  # removed concurrently
            continue
        removed.append(stream)
    return removed


def describe_stream(stream: str, run: str) -> str:
    """``KV_chorus_r1`` -> ``KV bucket chorus_r1``, for people reading what ``chorus clean`` removed."""
    names = Names(run)
    if stream == f"KV_{names.kv_bucket}":
        return f"KV bucket {names.kv_bucket}"
    if stream == f"OBJ_{names.obj_bucket}":
        return f"object store {names.obj_bucket}"
    return f"stream {stream}"
