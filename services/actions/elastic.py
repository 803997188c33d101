"""ARL-Tangram's elastic, action-level scheduling (arXiv 2026, §4 and Appendices A-B), as pure synchronous code.

No I/O and no clock: the caller passes the waiting queue, the free units of each resource type and the remaining
durations of the executing actions; :func:`schedule` returns which actions start now and with how many units of
each resource. Unit tests, property tests and the discrete-event simulator of ``loadtests/bench_actions.py`` drive
it directly; the actions service drives it through its resource managers.

Names follow the paper: an action a_i has a cost vector C_i over the k managed resource types, each c_{i,j} a set of
feasible units (a range min..max or a discrete set); its key elasticity resource ``key``; its elasticity E(m) in
(0, 1]; its single-unit duration T_ori, so that (Eq. 1)

    a.getDur(m) = T_ori / (E(m) * m)

The scheduler (Algorithm 1) takes the FCFS prefix of the waiting queue W that fits at minimum units as candidates
C, splits them by key resource, starts a group with no scalable member at its minimums, and otherwise greedily
evicts the group's last candidate (scalable or not: what is evicted is always a suffix, so nobody passes an earlier
action) while the approximated objective (Algorithm 2: the exact ACTs of the candidates from the DP allocation
DPArrange, Algorithm 3, a non-scalable member with its minimum as its one feasible count, plus the ACTs of the rest
of the queue estimated at minimum units through the completion heap, the first of them trying its ``depth``
smallest unit counts) keeps falling. Evicting the whole group (t = |C_j|) lets the head wait for the next
completion, still first in the queue.

Where this code reads the listings differently from their letter, the reason is given where it happens and in
docs/actions.md: the estimate uses one copy of the heap per ``depth`` choice; DPArrange takes the best DP state
using at most the free units (a discrete unit set may not reach exactly all of them); the head is never evicted
while nothing runs on its key resource (no completion would wake it).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

INF = float("inf")


# --- §4.1 action formulation -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Units:
    """The feasible units c_{i,j} of one resource type: a range ``lo..hi`` or a discrete set ``choices``."""

    lo: int = 1
    hi: int | None = None  # None: as many as the resource has (capped by the scheduler)
    choices: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.choices is not None:
            if not self.choices or any(c < 0 for c in self.choices):
                raise ValueError(f"a discrete unit set needs non-negative members, got {self.choices}")
            object.__setattr__(self, "choices", tuple(sorted(set(self.choices))))
        elif self.lo < 0 or (self.hi is not None and self.hi < self.lo):
            raise ValueError(f"units {self.lo}..{self.hi}: need 0 <= lo <= hi")

    @classmethod
    def fixed(cls, n: int) -> Units:
        return cls(lo=n, hi=n)

    @property
    def min(self) -> int:
        return self.choices[0] if self.choices is not None else self.lo

    def values(self, cap: int) -> list[int]:
        """The feasible unit counts up to ``cap``, ascending."""
        if self.choices is not None:
            return [c for c in self.choices if c <= cap]
        hi = cap if self.hi is None else min(self.hi, cap)
        return list(range(self.lo, hi + 1))

    def smallest(self, count: int) -> list[int]:
        """The ``count`` smallest feasible unit counts, whatever is free now."""
        if self.choices is not None:
            return sorted(self.choices)[:count]
        hi = self.lo + count - 1 if self.hi is None else min(self.hi, self.lo + count - 1)
        return list(range(self.lo, hi + 1))

    def elastic_at_all(self) -> bool:
        return len(self.choices) > 1 if self.choices is not None else (self.hi is None or self.hi > self.lo)


@dataclass(frozen=True)
class Elasticity:
    """E(m) in (0, 1] of the key resource: ``linear`` (E = 1), ``amdahl`` with a serial fraction s
    (speed-up 1 / (s + (1 - s) / m), so E(m) = 1 / (s m + 1 - s)), ``table`` (E given per unit count; between
    entries the nearest lower one), or ``zero`` (S = 0: more units do not help)."""

    kind: str = "linear"
    serial: float = 0.0
    table: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "amdahl", "table", "zero"):
            raise ValueError(f"elasticity {self.kind!r} is not one of linear, amdahl, table, zero")
        if not 0.0 <= self.serial <= 1.0:
            raise ValueError(f"Amdahl's serial fraction must be in [0, 1], got {self.serial}")
        if self.kind == "table" and (not self.table or any(not 0 < e <= 1 for _, e in self.table)):
            raise ValueError("an elasticity table needs entries (units, E) with 0 < E <= 1")

    def __call__(self, m: int) -> float:
        if m <= 0:
            raise ValueError(f"E(m) needs m >= 1, got {m}")
        if self.kind == "linear":
            return 1.0
        if self.kind == "amdahl":
            return 1.0 / (self.serial * m + 1.0 - self.serial)
        if self.kind == "zero":
            return 1.0 / m  # getDur(m) = T_ori whatever m
        below = [e for u, e in sorted(self.table) if u <= m]
        return below[-1] if below else sorted(self.table)[0][1]


@dataclass
class Action:
    """One action a_i: its cost vector (feasible units per resource type), key elasticity resource, elasticity and
    profiled single-unit duration T_ori (None: not profiled)."""

    id: str
    kind: str
    cost: dict[str, Units]
    key: str | None = None
    elasticity: Elasticity | None = None  # None: unknown
    t_ori: float | None = None
    trajectory: str | None = None
    arrival: float = 0.0

    def __post_init__(self) -> None:
        if self.key is not None and self.key not in self.cost:
            raise ValueError(f"action {self.id}: key resource {self.key!r} is not in its cost vector {sorted(self.cost)}")

    def min_units(self) -> dict[str, int]:
        return {r: u.min for r, u in self.cost.items()}

    def get_dur(self, m: int | None = None) -> float:
        """Eq. 1: T_ori / (E(m) m) on ``m`` units of the key resource (its minimum when None)."""
        t = self.t_ori if self.t_ori is not None else 0.0
        if self.key is None or self.elasticity is None:
            return t
        m = self.cost[self.key].min if m is None else m
        if m <= 0:
            return t
        return t / (self.elasticity(m) * m)

    def scalable(self) -> bool:
        """Elastic on its key resource: a known, non-zero elasticity, a profiled duration and more than one feasible
        unit count (Algorithm 1, line 6: a group of which no member is scalable starts at its minimums)."""
        return (self.key is not None and self.elasticity is not None and self.elasticity.kind != "zero"
                and self.t_ori is not None and self.cost[self.key].elastic_at_all())


class DurationProfile:
    """T_ori per action kind as a running average of observed single-unit durations (an action whose caller gave
    none is scheduled with its kind's average: observed seconds times E(m) m)."""

    def __init__(self) -> None:
        self._sum: dict[str, float] = {}
        self._n: dict[str, int] = {}

    def observe(self, action: Action, units: int, seconds: float) -> None:
        e = action.elasticity(units) if action.elasticity is not None and units > 0 else 1.0
        single = seconds * e * max(units, 1) if action.elasticity is not None else seconds
        self._sum[action.kind] = self._sum.get(action.kind, 0.0) + single
        self._n[action.kind] = self._n.get(action.kind, 0) + 1

    def t_ori(self, kind: str) -> float | None:
        n = self._n.get(kind, 0)
        return self._sum[kind] / n if n else None

    def fill(self, action: Action) -> Action:
        if action.t_ori is None:
            action.t_ori = self.t_ori(action.kind)
        return action


# --- Appendix B: DPArrange -------------------------------------------------------------------------------------------
class BasicDPOperator:
    """Algorithm 3's Basic DP Operator: units of one resource are interchangeable (a CPU node's cores)."""

    @staticmethod
    def start(sets: Sequence[Sequence[int]]) -> int:
        return sum(min(s) for s in sets)

    @staticmethod
    def end_units(free: int) -> int:
        return free

    @staticmethod
    def end_sets(sets: Sequence[Sequence[int]]) -> int:
        return sum(max(s) for s in sets)

    @staticmethod
    def prev(j: int, k: int) -> int:
        return j - k


@dataclass
class Arrangement:
    """DPArrange's result for one prefix of the candidates: the sum of their durations and each one's units."""

    total: float
    units: list[int]
    durations: list[float]


class DPArrange:
    """Algorithm 3 (topology-agnostic DPArrange) with the Basic DP Operator, over the candidates in FCFS order.

    One table serves every prefix: row i is the optimum of the first i candidates, so the eviction loop of
    Algorithm 1 reads ``C[:-t]`` from row ``m - t`` without running the DP again. ``dp[i][j]`` is the least sum of
    durations of the first i candidates using exactly j units; the answer of a prefix is its best row entry with
    j <= n (the listing reads ``dp[m][n]``, all units used, which a discrete unit set may not reach, and which with
    durations that fall as units rise is that best entry whenever it is reachable). Each row runs vectorised over j.
    """

    def __init__(self, candidates: Sequence[Action], resource: str, free: int,
                 op: BasicDPOperator | None = None) -> None:
        self.candidates = list(candidates)
        self.op = op or BasicDPOperator()
        # a member that is not scalable (zero or unknown elasticity, no profile) has one feasible count: its minimum
        sets = [c.cost[resource].values(free) if c.scalable() else [c.cost[resource].min] for c in self.candidates]
        self.sets = sets
        m = len(self.candidates)
        # line 3: n <- min{End(U), End(S)}
        self.n = min(self.op.end_units(free), self.op.end_sets(sets)) if sets else 0
        if any(not s for s in sets) or self.op.start(sets) > self.n:
            raise ValueError(f"DPArrange: {m} candidates need at least {self.op.start(sets) if all(sets) else '?'} "
                             f"units of {resource!r}, {free} are free")  # line 5: each task needs its minimum
        n = self.n
        self.dp = np.full((m + 1, n + 1), INF)
        self.choice = np.zeros((m + 1, n + 1), dtype=np.int64)
        self.dp[0, 0] = 0.0
        for i, (c, units) in enumerate(zip(self.candidates, sets, strict=True), start=1):
            row = self.dp[i]
            for k in units:  # line 13: all k in S_i
                dur = c.get_dur(k) if c.scalable() else c.get_dur()  # line 17: T_i(k)
                # lines 14-20 for every j at once: j' = Prev(j, k) = j - k; a state is valid iff dp[i-1][j'] < inf
                cand = np.full(n + 1, INF)
                if k <= n:
                    cand[k:] = self.dp[i - 1][: n + 1 - k] + dur
                better = cand < row
                row[better] = cand[better]
                self.choice[i][better] = k

    def arrange(self, count: int) -> Arrangement:
        """The optimal allocation of the first ``count`` candidates (lines 23-27: backtrack through ``choice``)."""
        if count == 0:
            return Arrangement(0.0, [], [])
        row = self.dp[count]
        j = int(np.argmin(row))
        total = float(row[j])
        if not math.isfinite(total):
            raise ValueError(f"DPArrange: no feasible allocation of {count} candidates in {self.n} units")
        units = [0] * count
        for i in range(count, 0, -1):
            k = int(self.choice[i][j])
            units[i - 1] = k
            j = self.op.prev(j, k)
        return Arrangement(total, units, [c.get_dur(k) if c.scalable() else c.get_dur()
                                          for c, k in zip(self.candidates[:count], units, strict=True)])


# --- Appendix A: the approximated objective ----------------------------------------------------------------------------
def estimate(heap: Sequence[float], rest: Sequence[Action], depth: int, resource: str, free: int) -> float:
    """Algorithm 2's ``estimate``: the ACTs of the actions ``rest`` still waiting after the candidates, each at its
    minimum units in FCFS order, starting when the earliest slot of the completion heap frees; the first of them
    tries the ``depth`` smallest feasible allocations of its key resource and the best is kept.

    The listing pops the inner loop from ``heap`` while pushing onto ``tmpHeap``; read literally, each ``d`` would
    consume the heap the next one starts from. Each ``d`` here works on its own copy of the heap. An empty heap
    (nothing running, no candidate: :func:`schedule` never asks for it) is one slot, free at time 0.
    """
    if not rest:
        return 0.0
    first = rest[0]
    choices = first.cost[first.key].smallest(max(depth, 1)) if first.scalable() else [None]
    choices = choices or [None]
    best = INF
    for d in choices:  # line 10: d = 1 -> depth
        tmp = list(heap)
        heapq.heapify(tmp)
        obj = 0.0
        for i, a in enumerate(rest):
            t = a.get_dur(d) if i == 0 and d is not None else a.get_dur()  # lines 11 and 15
            ts = heapq.heappop(tmp) if tmp else 0.0
            obj += ts + t  # lines 13 and 16
            heapq.heappush(tmp, ts + t)
        best = min(best, obj)  # line 17
    return best


@dataclass
class Objective:
    """getApproximatedObjective(C_j, R_j) of one prefix: exact + approximated ACTs, and the prefix's allocation."""

    value: float
    arrangement: Arrangement


def approximated_objective(dp: DPArrange, count: int, rest: Sequence[Action], executing: Sequence[float],
                           depth: int, resource: str, free: int) -> Objective:
    """Algorithm 2's ``getApproximatedObjective``: the candidates' exact ACTs from DPArrange (they start now) plus
    the estimate of ``rest`` (the other waiting actions of this key resource, evicted candidates first) over the
    completion heap of the executing actions and the arranged candidates."""
    arr = dp.arrange(count)
    new_heap = [*executing, *arr.durations]
    return Objective(arr.total + estimate(new_heap, rest, depth, resource, free), arr)


# --- Algorithm 1 -------------------------------------------------------------------------------------------------------
@dataclass
class Decision:
    """Actions to start now, each with its units per resource type."""

    start: list[tuple[Action, dict[str, int]]] = field(default_factory=list)
    evicted: int = 0  # scalable candidates left waiting so that the others scale up


Accommodate = Callable[[Sequence[Mapping[str, int]]], bool]


def fits(free: Mapping[str, int]) -> Accommodate:
    """R.accommodate for interchangeable units: the sums of the minimum requirements fit the free units."""

    def accommodate(mins: Sequence[Mapping[str, int]]) -> bool:
        total: dict[str, int] = {}
        for m in mins:
            for r, u in m.items():
                total[r] = total.get(r, 0) + u
        return all(u <= free.get(r, 0) for r, u in total.items())

    return accommodate


def schedule(waiting: Sequence[Action], free: Mapping[str, int], executing: Mapping[str, Sequence[float]] | None = None,
             depth: int = 2, accommodate: Accommodate | None = None) -> Decision:
    """Algorithm 1 over the waiting queue ``waiting`` (FCFS order) and the free units ``free`` of each resource type
    R_j. ``executing[r]``: the remaining durations of the actions running on resource r (the completion heap).
    ``accommodate``: R.accommodate of the resource manager's topology (default: sums of minimums fit)."""
    executing = executing or {}
    accommodate = accommodate or fits(free)
    # line 3: C <- W[:n], n = max{i | R.accommodate(W[:i])}, at minimum units
    n = 0
    mins: list[dict[str, int]] = []
    for a in waiting:
        mins.append(a.min_units())
        if not accommodate(mins):
            mins.pop()
            break
        n += 1
    candidates = list(waiting[:n])
    decision = Decision()
    if not candidates:
        return decision
    keyed: dict[str | None, list[Action]] = {}
    for a in candidates:  # line 5: C_j <- C.split(R_j)
        keyed.setdefault(a.key, []).append(a)
    chosen: dict[int, dict[str, int]] = {}  # index in W -> units
    index = {id(a): i for i, a in enumerate(waiting)}
    for key, group in keyed.items():
        if key is None or not any(a.scalable() for a in group):  # lines 6-7: no member scalable: all at the minimum
            for a in group:
                chosen[index[id(a)]] = a.min_units()
            continue
        # The key units the group shares: the free units less what the candidates of other groups take of this
        # resource at their minimum (scaling along the key resource leaves the others' allocations alone).
        members = {id(a) for a in group}
        units_left = free.get(key, 0) - sum(a.min_units().get(key, 0) for a in candidates if id(a) not in members)
        rest_all = [a for a in waiting[n:] if a.key == key]  # AC_j = W.split(R_j) - C_j
        dp = DPArrange(group, key, units_left)
        heap = list(executing.get(key, ()))
        # line 8: obj <- getApproximatedObjective(C_j, R_j)
        best = approximated_objective(dp, len(group), rest_all, heap, depth, key, units_left)
        kept = len(group)
        # line 9: t = 1 -> |C_j|; t = |C_j| evicts the whole group, the head too: it then waits for the next
        # completion, still first in the queue. With nothing running on the key resource no completion would wake
        # it, so there the head is never evicted.
        last = len(group) if heap else len(group) - 1
        for t in range(1, last + 1):
            count = len(group) - t
            new = approximated_objective(dp, count, [*group[count:], *rest_all], heap, depth, key, units_left)
            if new.value >= best.value:  # line 11: stop once eviction no longer lowers the objective
                break
            best, kept = new, count  # line 12
        decision.evicted += len(group) - kept
        for a, k in zip(group[:kept], best.arrangement.units, strict=True):  # line 13: Selected += C_j[:-t+1]
            chosen[index[id(a)]] = {**a.min_units(), key: k}
    decision.start = [(waiting[i], chosen[i]) for i in sorted(chosen)]
    return decision


def total_units(decision: Decision) -> dict[str, int]:
    """Units of each resource type the decision allocates."""
    out: dict[str, int] = {}
    for _, units in decision.start:
        for r, u in units.items():
            out[r] = out.get(r, 0) + u
    return out
