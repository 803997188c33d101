"""Files a reader must never see half-written (run ids, run summaries, the best version's record and weights), and
scratch directories a killed owner leaves behind."""

from __future__ import annotations

import os
import shutil
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


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's process counts as alive: it is not ours to clean up)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_dead_owners(root: Path, prefix: str) -> list[Path]:
    """Remove the directories ``root/<prefix><pid>-*`` whose owning process ``pid`` is gone (a process SIGKILLed or
    crashed cannot clean up its scratch space, on tmpfs held in memory until a reboot); returns what was removed."""
    removed = []
    for d in root.glob(f"{prefix}*-*"):
        pid = d.name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed
