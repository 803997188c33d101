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

Chorus's extensions (:class:`Policy`, each off in :data:`PAPER`, each measured against it by
``loadtests/bench_actions.py``): an estimate that counts the units a running action frees when it ends, not one
completion per action whatever it holds (``freed_units``); shortest-expected-first order of the queue with an ageing
bound (``order="sef"``, ``age_s``); and malleable suites (:class:`MalleableSuite`), whose cases are handed to cores
as they free up.

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
def _first_choices(rest: Sequence[Action], depth: int) -> list[int | None]:
    """The unit counts the first waiting action tries in an estimate: its ``depth`` smallest feasible counts of its
    key resource when it is scalable, else its minimum (None)."""
    first = rest[0]
    key = first.key
    choices: list[int | None] = (list(first.cost[key].smallest(max(depth, 1)))
                                 if first.scalable() and key is not None else [])  # scalable() has a key
    return choices or [None]


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
    best = INF
    for d in _first_choices(rest, depth):  # line 10: d = 1 -> depth
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


def estimate_units(running: Sequence[tuple[float, int]], free: int, rest: Sequence[Action], depth: int) -> float:
    """Chorus's estimate: like :func:`estimate`, but a waiting action starts once as many units as its minimum (the
    first of them: each of its ``depth`` smallest counts) are free, counting the units each running action frees at
    its end (``running``: (remaining seconds, units)) and the ``free`` units nobody holds now. The paper's estimate
    counts one completion per running action whatever it holds, so many actions started on one unit each look
    cheap to the queue behind them."""
    if not rest:
        return 0.0
    best = INF
    for d in _first_choices(rest, depth):
        events = [(t, u) for t, u in running if u > 0]
        if free > 0:
            events.append((0.0, free))
        heapq.heapify(events)
        obj = 0.0
        for i, a in enumerate(rest):
            need = d if i == 0 and d is not None else (a.cost[a.key].min if a.key is not None else 1)
            t = a.get_dur(d) if i == 0 and d is not None else a.get_dur()
            got, start = 0, 0.0
            while got < need and events:
                ts, u = heapq.heappop(events)
                got, start = got + u, ts
            if got > need:
                heapq.heappush(events, (start, got - need))
            obj += start + t
            held = min(got, need)  # less than its minimum only where the resource has fewer units in all
            if held > 0:
                heapq.heappush(events, (start + t, held))
        best = min(best, obj)
    return best


@dataclass(frozen=True)
class Policy:
    """The scheduler's settings beyond ``depth``. :data:`PAPER` is ARL-Tangram's Algorithms 1-3 as published;
    :data:`CHORUS` turns on Chorus's extensions (docs/actions.md).

    - ``freed_units``: Algorithm 2's estimate through :func:`estimate_units` (units freed) instead of
      :func:`estimate` (completions).
    - ``order``: ``fcfs`` (the paper) or ``sef``: shortest expected duration at minimum units first (a tool call
      ahead of a test suite when their profiled durations say so; an action without a profile counts as 0 s), but
      an action that has waited ``age_s`` goes ahead of every younger one, the aged in arrival order: nothing waits
      behind younger work past the bound.
    """

    freed_units: bool = False
    order: str = "fcfs"
    age_s: float = 30.0

    def __post_init__(self) -> None:
        if self.order not in ("fcfs", "sef"):
            raise ValueError(f"queue order {self.order!r} is not fcfs or sef")
        if self.age_s < 0:
            raise ValueError(f"the ageing bound must be >= 0 s, got {self.age_s}")


PAPER = Policy()
CHORUS = Policy(freed_units=True, order="sef")


def order_queue(waiting: Sequence[Action], now: float, policy: Policy) -> list[Action]:
    """The queue in the order Algorithm 1 reads it: as given (FCFS) or :class:`Policy` ``sef`` with ageing."""
    if policy.order == "fcfs":
        return list(waiting)
    aged = [a for a in waiting if now - a.arrival >= policy.age_s]
    young = [(a.get_dur(), i, a) for i, a in enumerate(waiting) if now - a.arrival < policy.age_s]
    young.sort(key=lambda x: (x[0], x[1]))
    return [*aged, *(a for _, _, a in young)]


@dataclass
class Objective:
    """getApproximatedObjective(C_j, R_j) of one prefix: exact + approximated ACTs, and the prefix's allocation."""

    value: float
    arrangement: Arrangement


def approximated_objective(dp: DPArrange, count: int, rest: Sequence[Action], executing: Sequence[tuple[float, int]],
                           depth: int, resource: str, free: int, freed_units: bool = False) -> Objective:
    """Algorithm 2's ``getApproximatedObjective``: the candidates' exact ACTs from DPArrange (they start now) plus
    the estimate of ``rest`` (the other waiting actions of this key resource, evicted candidates first) over the
    completion heap of the executing actions (remaining seconds, units held) and the arranged candidates
    (``freed_units``: over the units they free, :func:`estimate_units`)."""
    arr = dp.arrange(count)
    if freed_units:
        running = [*executing, *zip(arr.durations, arr.units, strict=True)]
        return Objective(arr.total + estimate_units(running, free - sum(arr.units), rest, depth), arr)
    new_heap = [*(t for t, _ in executing), *arr.durations]
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


def schedule(waiting: Sequence[Action], free: Mapping[str, int],
             executing: Mapping[str, Sequence[float | tuple[float, int]]] | None = None,
             depth: int = 2, accommodate: Accommodate | None = None, policy: Policy = PAPER,
             now: float = 0.0) -> Decision:
    """Algorithm 1 over the waiting queue ``waiting`` (FCFS order) and the free units ``free`` of each resource type
    R_j. ``executing[r]``: the remaining durations of the actions running on resource r (the completion heap), each
    a float or (remaining seconds, units held). ``accommodate``: R.accommodate of the resource manager's topology
    (default: sums of minimums fit). ``policy``: the paper's (default) or with Chorus's extensions; ``now`` (the
    clock of the actions' ``arrival``) serves its ageing bound."""
    executing = executing or {}
    accommodate = accommodate or fits(free)
    waiting = order_queue(waiting, now, policy)
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
        # the completion heap, each entry (remaining seconds, units held): a bare float holds one unit
        heap = [(float(e), 1) if isinstance(e, int | float) else (float(e[0]), int(e[1]))
                for e in executing.get(key, ())]
        # line 8: obj <- getApproximatedObjective(C_j, R_j)
        units = policy.freed_units
        best = approximated_objective(dp, len(group), rest_all, heap, depth, key, units_left, units)
        kept = len(group)
        # line 9: t = 1 -> |C_j|; t = |C_j| evicts the whole group, the head too: it then waits for the next
        # completion, still first in the queue. With nothing running on the key resource no completion would wake
        # it, so there the head is never evicted.
        last = len(group) if heap else len(group) - 1
        for t in range(1, last + 1):
            count = len(group) - t
            new = approximated_objective(dp, count, [*group[count:], *rest_all], heap, depth, key, units_left, units)
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


# --- Chorus's malleable suites ------------------------------------------------------------------------------------------
class MalleableSuite:
    """A test suite whose ``cases`` are handed to the cores it holds one at a time, so that its degree of parallelism
    grows when cores free up and shrinks at case boundaries when others wait (Chorus's extension; a suite of the
    paper keeps the cores it started with). Pure bookkeeping: the caller runs the cases and keeps the clock.

    Invariants: ``running <= held <= max_units``, and ``pending + running + done == cases``."""

    def __init__(self, cases: int, max_units: int) -> None:
        if cases < 1 or max_units < 1:
            raise ValueError(f"a malleable suite needs cases >= 1 and max_units >= 1, got {cases} and {max_units}")
        self.cases = cases
        self.max_units = max_units
        self.pending = cases
        self.running = 0
        self.done = 0
        self.held = 0
        self.peak = 0  # the most cores it held at once

    def wanted(self) -> int:
        """Cores it could use beyond those it holds: one per case not yet run, up to ``max_units``."""
        return max(0, min(self.max_units, self.pending + self.running) - self.held)

    def grant(self, n: int) -> int:
        """Take up to ``n`` more cores (no more than :meth:`wanted`); returns how many it took."""
        took = max(0, min(n, self.wanted()))
        self.held += took
        self.peak = max(self.peak, self.held)
        return took

    def start_cases(self) -> int:
        """Start a case on every held core without one; returns how many started."""
        k = min(self.pending, self.held - self.running)
        self.pending -= k
        self.running += k
        return k

    def case_done(self, others_wait: bool, stop: bool = False) -> bool:
        """A case ended on one of its cores. Returns True when the suite gives that core back: nothing left to start
        on it, ``others_wait`` and the suite keeps at least one core, or ``stop`` (the suite runs nothing more: its
        last core goes back too). Otherwise the caller starts the next case on it (:meth:`start_cases`)."""
        if self.running < 1:
            raise ValueError("case_done with no case running")
        self.running -= 1
        self.done += 1
        if stop or self.pending == 0 or (others_wait and self.held > 1):
            self.held -= 1
            return True
        return False

    @property
    def finished(self) -> bool:
        return self.done == self.cases
