"""A memory cap per process, and the evidence that the kernel's out-of-memory killer ended one.

``models.<m>.trainer.memory_mb`` caps every process of a model's trainer (the torch learner, or each rank of a
DeepSpeed group) through a cgroup v1 memory group of its own (``/sys/fs/cgroup/memory/chorus/<run>/<name>``,
root only): the process enters it before it runs anything (:meth:`MemoryGroup.enter`, from ``preexec_fn``), and
a process past its limit is killed by the kernel (exit status 137, SIGKILL). Such an exit is told from any other
SIGKILL by the group's own counter (``memory.oom_control``'s ``oom_kill``), read after the exit; without a group,
by the machine's (``/proc/vmstat``'s ``oom_kill``) having moved while the process ran.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

CGROUP_MEMORY = Path(os.environ.get("CHORUS_CGROUP_MEMORY", "/sys/fs/cgroup/memory"))
VMSTAT = Path("/proc/vmstat")
KILLED = (-signal.SIGKILL, 128 + signal.SIGKILL)  # Popen's and a shell's way of saying SIGKILL
MEMORY_GROUP_ENV = "CHORUS_MEMORY_GROUP"  # a trainer's own group: its DeepSpeed ranks make theirs beside it
MEMORY_LIMIT_ENV = "CHORUS_MEMORY_LIMIT"  # the cap in bytes, for those ranks
LAST_EXIT_ENV = "CHORUS_LAST_EXIT"  # JSON: how the last start of this service ended, when the OOM killer ended it


def unavailable() -> str | None:
    """Why a memory cap cannot be set here (None: it can)."""
    if not (CGROUP_MEMORY / "memory.limit_in_bytes").is_file():
        return f"no cgroup v1 memory controller at {CGROUP_MEMORY} (a memory cap needs one)"
    if not os.access(CGROUP_MEMORY, os.W_OK):
        return f"{CGROUP_MEMORY} is not writable: memory caps need root (or a delegated cgroup)"
    return None


def machine_oom_kills() -> int:
    """The kernel's count of processes its OOM killer ended since boot (0 where /proc/vmstat lacks it)."""
    with contextlib.suppress(OSError, ValueError):
        for line in VMSTAT.read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return 0


@dataclass(frozen=True)
class MemoryGroup:
    """One cgroup v1 memory group."""

    path: Path

    @classmethod
    def for_process(cls, run: str, name: str) -> MemoryGroup:
        return cls(CGROUP_MEMORY / "chorus" / run / name)

    def create(self, limit_bytes: int, *, fresh: bool = False) -> MemoryGroup:
        """Make the group (and its parents) with this limit, swap included where the kernel accounts it. ``fresh``:
        a group left by an earlier process (empty) is made again, so that its counters start from zero."""
        if fresh:
            self.remove(parents=False)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        with contextlib.suppress(OSError):  # memory+swap: absent where swap accounting is off
            (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        with contextlib.suppress(OSError):
            (self.path / "memory.failcnt").write_text("0")
            (self.path / "memory.max_usage_in_bytes").write_text("0")
        return self

    def enter(self, pid: int | None = None) -> None:
        """Move ``pid`` (default: this process) into the group; its children are born there."""
        (self.path / "cgroup.procs").write_text(str(pid or os.getpid()))

    def _read(self, name: str) -> str:
        try:
            return (self.path / name).read_text()
        except OSError:
            return ""

    def oom_kills(self) -> int:
        """Processes of this group its limit's OOM killer ended (``oom_kill`` of memory.oom_control)."""
        for line in self._read("memory.oom_control").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def failcnt(self) -> int:
        text = self._read("memory.failcnt").strip()
        return int(text) if text.isdigit() else 0

    def max_usage(self) -> int:
        text = self._read("memory.max_usage_in_bytes").strip()
        return int(text) if text.isdigit() else 0

    def limit(self) -> int:
        text = self._read("memory.limit_in_bytes").strip()
        return int(text) if text.isdigit() else 0

    def remove(self, *, parents: bool = True) -> None:
        """Remove the group (it must hold no process); with ``parents``, its parents too while they are empty,
        up to chorus/."""
        path = self.path
        while path != CGROUP_MEMORY and path.name and CGROUP_MEMORY in path.parents:
            try:
                path.rmdir()
            except OSError:
                return
            if not parents or path.parent == CGROUP_MEMORY / "chorus":
                return
            path = path.parent


def rank_groups(group: MemoryGroup) -> list[tuple[int, MemoryGroup]]:
    """The groups of a DeepSpeed trainer's ranks 1..N-1, beside rank 0's (``<group>-rank<r>``), by rank."""
    found = []
    for path in group.path.parent.glob(f"{group.path.name}-rank*"):
        rank = path.name.rsplit("-rank", 1)[1]
        if rank.isdigit() and path.is_dir():
            found.append((int(rank), MemoryGroup(path)))
    return sorted(found, key=lambda rg: rg[0])


def group_from_env() -> tuple[MemoryGroup, int] | None:
    """This process's own group and cap, as its supervisor set them (CHORUS_MEMORY_GROUP / _LIMIT), if any."""
    path, limit = os.environ.get(MEMORY_GROUP_ENV), os.environ.get(MEMORY_LIMIT_ENV)
    if not path or not limit or not limit.isdigit():
        return None
    return MemoryGroup(Path(path)), int(limit)


@dataclass(frozen=True)
class OutOfMemory:
    """What shows an exit was the OOM killer's: the cap, the group's counters, or the machine's counter."""

    limit_bytes: int | None
    group_oom_kills: int | None
    failcnt: int | None
    max_usage_bytes: int | None
    machine_oom_kills: int | None  # how much the machine's counter moved while the process ran (no group)

    def evidence(self) -> str:
        if self.group_oom_kills is not None:
            return (f"memory cap {self.limit_bytes / 2**20:.0f} MB (cgroup oom_kill {self.group_oom_kills}, failcnt "
                    f"{self.failcnt}, peak {self.max_usage_bytes / 2**20:.0f} MB)" if self.limit_bytes
                    and self.max_usage_bytes is not None else f"cgroup oom_kill {self.group_oom_kills}")
        return (f"killed with no memory cap while the machine's OOM-kill count rose by {self.machine_oom_kills} "
                "(/proc/vmstat): probably the OOM killer")

    def as_dict(self) -> dict[str, int | None]:
        return {"limit_bytes": self.limit_bytes, "group_oom_kills": self.group_oom_kills, "failcnt": self.failcnt,
                "max_usage_bytes": self.max_usage_bytes, "machine_oom_kills": self.machine_oom_kills}


def out_of_memory(returncode: int | None, group: MemoryGroup | None = None, oom_before: int = 0,
                  machine_before: int | None = None) -> OutOfMemory | None:
    """The evidence that an exit with ``returncode`` was the OOM killer's, or None. ``oom_before``: the group's
    ``oom_kill`` when the process started; ``machine_before``: the machine's, for a process without a group."""
    if returncode not in KILLED:
        return None
    if group is not None:
        kills = group.oom_kills()
        if kills > oom_before:
            return OutOfMemory(group.limit(), kills - oom_before, group.failcnt(), group.max_usage(), None)
        return None
    if machine_before is not None:
        moved = machine_oom_kills() - machine_before
        if moved > 0:
            return OutOfMemory(None, None, None, None, moved)
    return None


def advice(model: str, backend: str, ranks: int, stage: int) -> str:
    """What to change when a model's trainer does not fit its memory."""
    if backend == "deepspeed" and stage == 3:
        return (f"give models.{model}.trainer.deepspeed more ranks (now {ranks}), offload_optimizer: true, or more "
                "memory (trainer.memory_mb)")
    if backend == "deepspeed":
        return (f"use ZeRO-3 (models.{model}.trainer.deepspeed.zero_stage: 3, now {stage}) or more ranks (now "
                f"{ranks}), or more memory (trainer.memory_mb)")
    return (f"shard it: models.{model}.trainer.backend: deepspeed with deepspeed.ranks >= 2 and zero_stage: 3 (the "
            "deepspeed extra), or give it more memory (trainer.memory_mb)")
