"""ARL-Tangram's resource managers (§5) as pure bookkeeping: no I/O, the clock passed in.

- :class:`BasicManager` (§5.1): resources that cannot scale — a concurrency limit, or a quota per period (an
  external API's requests per minute). An action that would exceed either waits (``admit`` says no, with when it
  could go); it is never sent and failed.
- :class:`CpuManager` (§5.2): per node, the cores of each action chosen within one NUMA node where the machine has
  several, each core held by one action at a time (allocate-on-execution: the worker binds the action's process
  to exactly these cores); per-trajectory memory held across a trajectory's actions; the node of a trajectory's
  first action chosen by memory balance among the nodes with enough cores and memory.
- :class:`GpuServiceManager` (§5.3): evict-on-execution service cache with LRU eviction; GPUs handed out as
  buddy chunks ``(start, end)`` with ``end - start = 2^a`` and ``start`` aligned to ``2^a``; among chunks of the
  level needed, one that already caches the service is preferred. Different parallelism degrees of one service are
  separate services (``name@dop``).
"""

from __future__ import annotations

import os
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


# --- §5.1 basic manager ----------------------------------------------------------------------------------------------
@dataclass
class BasicManager:
    """A resource with ``concurrency`` uses at once (None: unlimited) and ``quota`` uses per ``period_s`` (None:
    unlimited), e.g. an API's rate limit."""

    concurrency: int | None = None
    quota: int | None = None
    period_s: float = 60.0
    in_use: int = 0
    _starts: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 or None, got {self.concurrency}")
        if self.quota is not None and self.quota < 1:
            raise ValueError(f"quota must be >= 1 or None, got {self.quota}")
        if self.period_s <= 0:
            raise ValueError(f"period_s must be > 0, got {self.period_s}")

    def _expire(self, now: float) -> None:
        while self._starts and self._starts[0] <= now - self.period_s:
            self._starts.popleft()

    def wait_s(self, now: float) -> float:
        """0 when one more use may start at ``now``; else how long until the quota admits one (inf: only a release
        of a concurrent use can)."""
        self._expire(now)
        if self.concurrency is not None and self.in_use >= self.concurrency:
            return float("inf")
        if self.quota is not None and len(self._starts) >= self.quota:
            return self._starts[0] + self.period_s - now
        return 0.0

    def admit(self, now: float) -> bool:
        """Start one use at ``now`` if both limits allow it."""
        if self.wait_s(now) > 0:
            return False
        self.in_use += 1
        if self.quota is not None:
            self._starts.append(now)
        return True

    def release(self) -> None:
        if self.in_use <= 0:
            raise ValueError("release without a use in progress")
        self.in_use -= 1

    def used_in_period(self, now: float) -> int:
        self._expire(now)
        return len(self._starts)


# --- §5.2 CPU manager ------------------------------------------------------------------------------------------------
@dataclass
class CpuNode:
    """One machine: its cores grouped by NUMA node, and its memory."""

    name: str
    numa: list[list[int]]  # core ids per NUMA node
    memory_mb: int
    busy: set[int] = field(default_factory=set)
    reserved_mb: int = 0  # memory held for the trajectories placed here
    physical: dict[int, int] | None = None  # core id -> the CPU it runs on, when they differ (see local_node)

    @property
    def cores(self) -> list[int]:
        return [c for group in self.numa for c in group]

    def cpus(self, cores: Sequence[int]) -> list[int]:
        """The CPUs to bind ``cores`` to (``sched_setaffinity``)."""
        if self.physical is None:
            return sorted(cores)
        return sorted({self.physical[c] for c in cores})

    def free_cores(self) -> int:
        return len(self.cores) - len(self.busy)


def local_node(cores: int, memory_mb: int = 0, sysfs: Path = Path("/sys/devices/system/node")) -> CpuNode:
    """This machine as a :class:`CpuNode` of ``cores`` cores: the cores this process may run on, grouped by the
    NUMA nodes of ``sysfs`` (one group where it lists none). When the budget exceeds the cores there are, core ids
    beyond them wrap around (two actions then share a physical core; the budget, not the machine, is the limit)."""
    allowed = sorted(os.sched_getaffinity(0))
    groups: list[list[int]] = []
    for node in sorted(sysfs.glob("node[0-9]*"), key=lambda d: int(d.name[4:])):
        try:
            listed = _cpulist((node / "cpulist").read_text())
        except OSError:
            continue
        group = [c for c in listed if c in allowed]
        if group:
            groups.append(group)
    if not groups:
        groups = [allowed]
    ordered = [c for g in groups for c in g]
    if cores <= len(ordered):
        chosen = set(ordered[:cores])
        return CpuNode("local", [[c for c in g if c in chosen] for g in groups if any(c in chosen for c in g)],
                       memory_mb)
    # a budget above the machine: logical cores i >= len(ordered) run on physical ordered[i % len(ordered)]
    return CpuNode("local", [list(range(cores))], memory_mb, physical={i: ordered[i % len(ordered)]
                                                                     for i in range(cores)})


def _cpulist(text: str) -> list[int]:
    """``0-3,8,10-11`` -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


class CpuManager:
    """Cores and memory of one or more nodes; a trajectory's actions all run on the node of its first one."""

    def __init__(self, nodes: Sequence[CpuNode]) -> None:
        if not nodes:
            raise ValueError("a CPU manager needs at least one node")
        self.nodes = {n.name: n for n in nodes}
        self.trajectories: dict[str, tuple[str, int]] = {}  # trajectory -> (node, memory held)

    def place(self, trajectory: str, cores: int, memory_mb: int) -> str | None:
        """The node of ``trajectory``: where it was placed, else among the nodes with ``cores`` free cores and
        ``memory_mb`` of memory left for it, the one with the least memory held (None: no node can take it now)."""
        if trajectory in self.trajectories:
            return self.trajectories[trajectory][0]
        fit = [n for n in self.nodes.values()
               if n.free_cores() >= cores and n.memory_mb - n.reserved_mb >= memory_mb]
        if not fit:
            return None
        node = min(fit, key=lambda n: (n.reserved_mb / max(n.memory_mb, 1), n.name))
        node.reserved_mb += memory_mb
        self.trajectories[trajectory] = (node.name, memory_mb)
        return node.name

    def end_trajectory(self, trajectory: str) -> None:
        """Give back the memory the trajectory held."""
        placed = self.trajectories.pop(trajectory, None)
        if placed is not None:
            self.nodes[placed[0]].reserved_mb -= placed[1]

    def allocate(self, node: str, count: int) -> list[int] | None:
        """``count`` free cores of ``node``, all within one NUMA node when one has room (the one with the fewest
        free cores that fits: big holes stay whole), else across NUMA nodes; None when fewer are free."""
        n = self.nodes[node]
        if count < 1 or n.free_cores() < count:
            return None
        free_by_numa = [[c for c in group if c not in n.busy] for group in n.numa]
        fitting = [g for g in free_by_numa if len(g) >= count]
        if fitting:
            chosen = min(fitting, key=len)[:count]
        else:
            chosen = [c for g in sorted(free_by_numa, key=len, reverse=True) for c in g][:count]
        n.busy.update(chosen)
        return sorted(chosen)

    def release(self, node: str, cores: Sequence[int]) -> None:
        n = self.nodes[node]
        missing = [c for c in cores if c not in n.busy]
        if missing:
            raise ValueError(f"cores {missing} of {node} are not allocated")
        n.busy.difference_update(cores)


# --- §5.3 GPU service manager ----------------------------------------------------------------------------------------
Chunk = tuple[int, int]  # (start, end) GPU indices of one node, end - start = 2^a, start % 2^a == 0


def level_of(m: int) -> int:
    """a with 2^(a-1) < m <= 2^a."""
    if m < 1:
        raise ValueError(f"a chunk holds at least one GPU, asked for {m}")
    return (m - 1).bit_length()


@dataclass
class ServiceSpec:
    """A service (a model at one degree of parallelism): its GPUs and the memory it needs on each."""

    name: str
    gpus: int
    memory_gb: float  # per GPU


@dataclass
class GpuGrant:
    node: int
    chunk: Chunk
    service: str
    restored: bool  # the service was not cached on this chunk: restored from CPU memory
    evicted: list[tuple[str, Chunk]]  # cached services dropped to make room


class GpuServiceManager:
    """Buddy chunks over ``nodes`` nodes of ``gpus_per_node`` GPUs (a power of two) with ``memory_gb`` each, and an
    evict-on-execution cache of services on chunks, least recently used evicted first."""

    def __init__(self, nodes: int, gpus_per_node: int, memory_gb: float, services: Sequence[ServiceSpec]) -> None:
        if gpus_per_node < 1 or gpus_per_node & (gpus_per_node - 1):
            raise ValueError(f"gpus_per_node must be a power of two, got {gpus_per_node}")
        self.gpus_per_node = gpus_per_node
        self.memory_gb = memory_gb
        self.services = {s.name: s for s in services}
        for s in services:
            if s.gpus > gpus_per_node or s.memory_gb > memory_gb:
                raise ValueError(f"service {s.name!r} needs {s.gpus} GPUs x {s.memory_gb} GB; a node has "
                                 f"{gpus_per_node} x {memory_gb} GB")
        self.free: list[set[Chunk]] = [{(0, gpus_per_node)} for _ in range(nodes)]
        # the cache: (node, chunk, service) in LRU order (oldest first)
        self.cache: OrderedDict[tuple[int, Chunk, str], None] = OrderedDict()
        self.hits = 0
        self.restores = 0

    # buddy allocation -----------------------------------------------------------------------------------------------
    def _cached_on(self, node: int, chunk: Chunk, service: str) -> bool:
        return (node, chunk, service) in self.cache

    def allocate(self, service: str) -> GpuGrant | None:
        """A chunk for one action of ``service``: the smallest free level that fits its GPUs, split down to its own
        level; among free chunks of that level, one caching the service first. None: no chunk is free."""
        spec = self.services[service]
        a = level_of(spec.gpus)
        size = 1 << a
        exact = [(n, c) for n, chunks in enumerate(self.free) for c in chunks if c[1] - c[0] == size]
        if exact:
            cached = [(n, c) for n, c in exact if self._cached_on(n, c, service)]
            node, chunk = min(cached or exact)
            self.free[node].discard(chunk)
        else:
            bigger = sorted((c[1] - c[0], n, c) for n, chunks in enumerate(self.free) for c in chunks
                            if c[1] - c[0] > size)
            if not bigger:
                return None
            _, node, chunk = bigger[0]
            self.free[node].discard(chunk)
            while chunk[1] - chunk[0] > size:  # split: keep the lower half, free the upper buddy
                mid = (chunk[0] + chunk[1]) // 2
                self.free[node].add((mid, chunk[1]))
                chunk = (chunk[0], mid)
        return self._place(node, chunk, service)

    def release(self, grant: GpuGrant) -> None:
        """Free the chunk, merging it with its buddy while the buddy is free (the service stays cached)."""
        node, chunk = grant.node, grant.chunk
        while True:
            size = chunk[1] - chunk[0]
            if size >= self.gpus_per_node:
                break
            start = chunk[0] ^ size  # the buddy of an aligned chunk
            buddy = (start, start + size)
            if buddy not in self.free[node]:
                break
            self.free[node].discard(buddy)
            chunk = (min(chunk[0], buddy[0]), max(chunk[1], buddy[1]))
        self.free[node].add(chunk)

    # evict-on-execution cache ---------------------------------------------------------------------------------------
    def _used_gb(self, node: int, gpu: int) -> float:
        return sum(self.services[s].memory_gb for (n, c, s) in self.cache if n == node and c[0] <= gpu < c[1])

    def _place(self, node: int, chunk: Chunk, service: str) -> GpuGrant:
        key = (node, chunk, service)
        if key in self.cache:
            self.cache.move_to_end(key)
            self.hits += 1
            return GpuGrant(node, chunk, service, restored=False, evicted=[])
        need = self.services[service].memory_gb
        evicted: list[tuple[str, Chunk]] = []
        gpus = range(chunk[0], chunk[1])
        while any(self._used_gb(node, g) + need > self.memory_gb + 1e-9 for g in gpus):
            victim = next((k for k in self.cache if k[0] == node and k[1][0] < chunk[1] and chunk[0] < k[1][1]), None)
            if victim is None:  # cannot happen: a service fits an empty GPU (checked at construction)
                raise RuntimeError(f"no cached service to evict on node {node} chunk {chunk}")
            del self.cache[victim]
            evicted.append((victim[2], victim[1]))
        self.cache[key] = None
        self.restores += 1
        return GpuGrant(node, chunk, service, restored=True, evicted=evicted)

    def cached(self) -> list[tuple[int, Chunk, str]]:
        """Cached (node, chunk, service), least recently used first."""
        return list(self.cache)
