"""Files a reader must never see half-written: run ids, run summaries, the best version's record and weights."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes | memoryview | str) -> None:
    """Write ``data`` to ``path`` through a hidden temporary file in the same folder and a rename: a reader (or a
    process that crashed mid-write and restarted) sees the old file or the new one, never part of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if isinstance(data, str):
        tmp.write_text(data)
    else:
        with open(tmp, "wb") as fh:
            fh.write(data)
    os.replace(tmp, path)
