"""A discrete-event simulation of actions on a CPU cluster under the allocation policies of ARL-Tangram §6.1-6.4 and
Chorus's extensions; the action-level policies call the scheduler the actions service runs
(:func:`services.actions.elastic.schedule`), so what is simulated is what runs.

- ``static-1`` and ``static-4``: trajectory-level allocation, the paper's Kubernetes baseline (§6.1). Each
  trajectory holds a pod from its first action to its end, requesting 0.5 CPU with a limit of 4 (``POD_REQUEST``,
  ``POD_LIMIT``); a node admits pods while their requests fit its cores, a trajectory waits for room. Actions run at
  once inside their pod: a tool call on one process, a test suite on one process (``static-1``: the datasets' test
  commands are single-process, §5.2) or on four (``static-4``: ``pytest -n 4`` at the pod's limit, the strongest
  static variant). The node's cores are shared among the running actions as the kernel's fair scheduler shares them
  among pods of equal requests: water-filling, each pod an equal share up to what its action can use; an action
  with d processes on c < d cores progresses at speedup(d) * c / d.
- ``fixed-<d>``: action-level allocation with a fixed degree of parallelism, FCFS per node (§6.4's DoP baselines):
  a test suite takes d cores (the action's maximum when lower), a tool call one; cores are exclusive.
- ``elastic``: ARL-Tangram's scheduler (Algorithms 1-3, depth 2, DoP 1..32) per node over its FCFS queue, run at
  every arrival and every completion.
- ``elastic+units``, ``elastic+sef``, ``elastic+malleable``: the paper's scheduler with one of Chorus's extensions
  (:class:`services.actions.elastic.Policy` ``freed_units``, ``order="sef"``, and
  :class:`services.actions.elastic.MalleableSuite`); ``chorus``: all three.

A test suite is ``cases`` test cases of ``(1 - serial) * t_ori / cases`` seconds each after a serial part
(collection, set-up) of ``serial * t_ori`` seconds on one core (:func:`suite_seconds`). Under a fixed degree of
parallelism d its cases run in ``ceil(cases / d)`` waves, so it never beats Amdahl's figure ``t_ori / speedup(d)``
(the paper's Eq. 1, which is what the scheduler is told: the profile of the action, not its cases) and equals it
when d divides ``cases``; a malleable suite hands each case to whichever core it holds when the case is due.

Costs (parameters, 0 by default): ``exec_s`` is added to every action (the time to start a process in its
environment: ``kubectl exec`` for a pod, the sandbox's fork for an action-level policy; cores are held meanwhile),
``pod_start_s`` to a static trajectory's first action (its pod's creation).

Trajectories are placed on nodes by memory balance (the node with the least trajectory memory held) at their first
action, as the paper's CPU manager does; all later actions of a trajectory run there. The trace and every other
assumption is in :class:`TraceConfig` and docs/actions.md.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from services.actions.elastic import (
    CHORUS,
    PAPER,
    Action,
    Elasticity,
    MalleableSuite,
    Policy,
    Units,
    schedule,
)

POD_REQUEST = 0.5  # CPU requested by each trajectory's pod (the paper's baseline)
POD_LIMIT = 4  # its CPU limit

# the action-level policies built on the paper's scheduler: (its Policy, malleable suites)
ELASTIC_POLICIES: dict[str, tuple[Policy, bool]] = {
    "elastic": (PAPER, False),
    "elastic+units": (Policy(freed_units=True), False),
    "elastic+sef": (Policy(order="sef"), False),
    "elastic+malleable": (PAPER, True),
    "chorus": (CHORUS, True),
}


@dataclass(frozen=True)
class TraceConfig:
    """A bursty agentic-coding trace: one burst of ``batch`` trajectories per RL step, each a series of tool calls
    between LLM generations, then one long-tailed, elastic test-suite reward action.

    Calibrated to the paper's published figures, not to its trace (which is not public): with single-process tests
    and no contention, actions take about 47% of a trajectory's time (Fig. 3c) and tool calls about half of the
    action time (Fig. 7's 9.0x on tool calls, 2.8x on rewards and 4.3x in total solve to a tool share of 0.51).
    Unknowns, declared: the number of tool calls (uniform ``tools_min..tools_max``), the lognormal shapes of every
    duration, the Amdahl serial fraction (uniform ``serial_min..serial_max``; ``bench_actions.py`` sweeps it), the
    number of cases per suite, the burst jitter."""

    nodes: int = 5
    cores_per_node: int = 256
    steps: int = 2  # RL steps; the next burst starts when every trajectory of the step has ended
    tools_min: int = 4
    tools_max: int = 20
    gen_median_s: float = 15.0  # LLM generation before each action, lognormal
    gen_sigma: float = 0.5
    tool_median_s: float = 5.0  # a tool call on one core, lognormal, not elastic
    tool_sigma: float = 1.0
    tool_max_s: float = 120.0
    reward_median_s: float = 60.0  # the test suite on one core (T_ori), lognormal: a long tail
    reward_sigma: float = 1.0
    reward_max_s: float = 1800.0
    serial_min: float = 0.02  # Amdahl serial fraction of a test suite, uniform
    serial_max: float = 0.15
    cases_min: int = 16  # test cases per suite, uniform
    cases_max: int = 64
    max_dop: int = 32
    burst_jitter_s: float = 2.0
    exec_s: float = 0.0  # added to every action (process start in its environment)
    pod_start_s: float = 0.0  # added to a static trajectory's first action (pod creation)
    age_s: float = 30.0  # the ageing bound of the sef order


@dataclass
class Step:
    """One action of a trajectory: the generation time before it, then the action."""

    gen_s: float
    kind: str  # "tool" | "reward"
    t_ori: float
    serial: float = 0.0
    cases: int = 1


def make_trace(cfg: TraceConfig, batch: int, seed: int) -> list[list[list[Step]]]:
    """Per RL step, per trajectory, its steps (same seed: the same trace for every policy)."""
    rng = random.Random(seed)
    trace = []
    for _ in range(cfg.steps):
        trajs = []
        for _ in range(batch):
            steps = [Step(rng.lognormvariate(math.log(cfg.gen_median_s), cfg.gen_sigma), "tool",
                          min(cfg.tool_max_s, rng.lognormvariate(math.log(cfg.tool_median_s), cfg.tool_sigma)))
                     for _ in range(rng.randint(cfg.tools_min, cfg.tools_max))]
            steps.append(Step(rng.lognormvariate(math.log(cfg.gen_median_s), cfg.gen_sigma), "reward",
                              min(cfg.reward_max_s, rng.lognormvariate(math.log(cfg.reward_median_s), cfg.reward_sigma)),
                              rng.uniform(cfg.serial_min, cfg.serial_max), rng.randint(cfg.cases_min, cfg.cases_max)))
            trajs.append(steps)
        trace.append(trajs)
    return trace


def speedup(serial: float, d: int) -> float:
    """Amdahl: 1 / (s + (1 - s) / d)."""
    return 1.0 / (serial + (1.0 - serial) / d)


def suite_seconds(step: Step, d: int) -> float:
    """A test suite's seconds on ``d`` cores held from its start to its end: its serial part, then its cases in
    waves of ``d`` (a tool call: its duration)."""
    if step.kind != "reward":
        return step.t_ori
    return step.serial * step.t_ori + math.ceil(step.cases / d) * (1.0 - step.serial) * step.t_ori / step.cases


@dataclass
class Running:
    traj: int
    step: Step
    submit: float
    start: float
    dop: int
    remaining: float  # work left, in seconds at full speed on its dop processes
    end: float = 0.0  # exclusive policies: when it ends (a malleable suite: the estimate the scheduler sees)


@dataclass
class Result:
    """Per action its ACT (queue + execution); per trajectory the sum of its actions' ACTs (the paper's §6.3
    measure: total ACT per trajectory, averaged over trajectories), split into tool calls and rewards."""

    policy: str
    batch: int
    acts: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    traj_tool: dict[tuple[int, int], float] = field(default_factory=dict)
    traj_reward: dict[tuple[int, int], float] = field(default_factory=dict)
    gen_s: float = 0.0  # generation seconds of every trajectory, for the action share
    makespan: float = 0.0
    peak_dop: list[int] = field(default_factory=list)  # malleable suites: the most cores each held

    @property
    def mean_act(self) -> float:
        """Mean total ACT per trajectory."""
        n = len(self.traj_reward)
        return (sum(self.traj_tool.values()) + sum(self.traj_reward.values())) / n if n else 0.0

    @property
    def mean_tool(self) -> float:
        n = len(self.traj_reward)
        return sum(self.traj_tool.values()) / n if n else 0.0

    @property
    def mean_reward(self) -> float:
        n = len(self.traj_reward)
        return sum(self.traj_reward.values()) / n if n else 0.0

    @property
    def mean_action_act(self) -> float:
        return sum(self.acts) / len(self.acts) if self.acts else 0.0

    @property
    def mean_queue(self) -> float:
        return sum(self.queue) / len(self.queue) if self.queue else 0.0

    @property
    def action_share(self) -> float:
        """Action time over trajectory time (generation + actions)."""
        total = sum(self.acts)
        return total / (total + self.gen_s) if total else 0.0


def simulate(cfg: TraceConfig, policy: str, trace: list[list[list[Step]]]) -> Result:
    """Every action of ``trace`` under ``policy`` (``static-1``, ``static-4``, ``fixed-<d>``, ``elastic``,
    ``elastic+units``, ``elastic+sef``, ``elastic+malleable`` or ``chorus``)."""
    if policy in ("static-1", "static-4"):
        return _Shared(cfg, trace, policy, tests_dop=int(policy[-1])).run()
    if policy.startswith("fixed-"):
        return _Exclusive(cfg, trace, policy, fixed=int(policy.split("-", 1)[1])).run()
    if policy in ELASTIC_POLICIES:
        return _Exclusive(cfg, trace, policy, fixed=None).run()
    raise ValueError(f"policy {policy!r} is not static-1, static-4, fixed-<d>, {', '.join(ELASTIC_POLICIES)}")


class _Base:
    def __init__(self, cfg: TraceConfig, trace: list[list[list[Step]]], policy: str) -> None:
        self.cfg = cfg
        self.trace = trace
        self.result = Result(policy, len(trace[0]) if trace else 0)
        self.now = 0.0
        self.burst = 0
        self.node_of: dict[int, int] = {}
        self.node_mem = [0] * cfg.nodes  # trajectories held: memory balance
        self.events: list[tuple[float, int, str, int]] = []
        self.seq = 0
        self.steps: list[list[Step]] = []
        self.next_step: list[int] = []
        self.live = 0

    def push(self, t: float, what: str, traj: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, what, traj))

    def place(self, traj: int) -> int:
        node = min(range(self.cfg.nodes), key=lambda n: (self.node_mem[n], n))
        self.node_of[traj] = node
        self.node_mem[node] += 1
        return node

    def run(self) -> Result:
        rng = random.Random(1)
        for b, burst in enumerate(self.trace):
            self.burst = b
            self.steps = [list(s) for s in burst]
            self.next_step = [0] * len(burst)
            self.node_of = {}
            self.node_mem = [0] * self.cfg.nodes
            self.live = len(burst)
            for i in range(len(burst)):
                self.result.traj_tool[(b, i)] = 0.0
                self.result.traj_reward[(b, i)] = 0.0
                self.result.gen_s += sum(s.gen_s for s in burst[i])
                self.push(self.now + rng.uniform(0, self.cfg.burst_jitter_s) + burst[i][0].gen_s, "submit", i)
            while self.live:
                self.handle(*heapq.heappop(self.events))
        self.result.makespan = self.now
        return self.result

    def handle(self, t: float, _seq: int, what: str, traj: int) -> None:
        """One event: the clock moves to ``t``, then a trajectory submits its next action or one wakes."""
        self.now = t
        if what == "submit":
            self.submit(traj)
        else:
            self.wake(what, traj)

    def finished(self, traj: int, step: Step, submit: float, start: float) -> None:
        """Record the action; the trajectory generates its next step, or ends."""
        act = self.now - submit
        self.result.acts.append(act)
        self.result.queue.append(start - submit)
        self.result.kinds.append(step.kind)
        book = self.result.traj_tool if step.kind == "tool" else self.result.traj_reward
        book[(self.burst, traj)] += act
        self.next_step[traj] += 1
        k = self.next_step[traj]
        if k < len(self.steps[traj]):
            self.push(self.now + self.steps[traj][k].gen_s, "submit", traj)
        else:
            self.end_trajectory(traj)
            self.live -= 1

    def end_trajectory(self, traj: int) -> None:
        node = self.node_of.get(traj)
        if node is not None:
            self.node_mem[node] -= 1

    def submit(self, traj: int) -> None:
        raise NotImplementedError

    def wake(self, what: str, traj: int) -> None:
        raise NotImplementedError


@dataclass
class _Suite:
    """A malleable suite in flight: its bookkeeping and its timing."""

    run: Running
    book: MalleableSuite
    case_s: float
    serial_end: float | None  # None once its cases run


class _Exclusive(_Base):
    """Exclusive cores per action, FCFS per node: a fixed degree of parallelism, or the paper's scheduler (with or
    without Chorus's extensions), run at every arrival and completion."""

    def __init__(self, cfg: TraceConfig, trace: list[list[list[Step]]], policy: str, fixed: int | None) -> None:
        super().__init__(cfg, trace, policy)
        self.fixed = fixed
        policy_, self.malleable = ELASTIC_POLICIES.get(policy, (PAPER, False))
        self.policy = replace(policy_, age_s=cfg.age_s)
        self.free = [cfg.cores_per_node] * cfg.nodes
        self.queue: list[list[tuple[Action, int, float]]] = [[] for _ in range(cfg.nodes)]  # (action, traj, submit)
        self.running: list[dict[int, Running]] = [{} for _ in range(cfg.nodes)]  # traj -> run
        self.suites: dict[int, _Suite] = {}

    def action(self, traj: int, step: Step) -> Action:
        if step.kind == "tool":
            return Action(f"{traj}", "tool", {"cpu": Units.fixed(1)}, key="cpu", elasticity=Elasticity("zero"),
                          t_ori=step.t_ori, arrival=self.now)
        units = Units(1, self.cfg.max_dop) if self.fixed is None else Units.fixed(min(self.fixed, self.cfg.max_dop))
        return Action(f"{traj}", "reward", {"cpu": units}, key="cpu", elasticity=Elasticity("amdahl", step.serial),
                      t_ori=step.t_ori, arrival=self.now)

    def submit(self, traj: int) -> None:
        node = self.node_of.get(traj)
        if node is None:
            node = self.place(traj)
        step = self.steps[traj][self.next_step[traj]]
        self.queue[node].append((self.action(traj, step), traj, self.now))
        self.dispatch(node)

    def wake(self, what: str, traj: int) -> None:
        node = self.node_of[traj]
        if what == "done":
            run = self.running[node].pop(traj)
            self.free[node] += run.dop
            self.finished(traj, run.step, run.submit, run.start)
        elif what == "serial":
            suite = self.suites[traj]
            suite.serial_end = None
            self.start_cases(node, traj, suite)
        else:  # "case": one case of a malleable suite ended on one of its cores
            suite = self.suites[traj]
            if suite.book.case_done(others_wait=bool(self.queue[node])):
                self.free[node] += 1
            if suite.book.finished:
                del self.suites[traj]
                run = self.running[node].pop(traj)
                self.result.peak_dop.append(suite.book.peak)
                self.finished(traj, run.step, run.submit, run.start)
            else:
                self.start_cases(node, traj, suite)
        self.dispatch(node)

    def start_cases(self, node: int, traj: int, suite: _Suite) -> None:
        for _ in range(suite.book.start_cases()):
            self.push(self.now + suite.case_s, "case", traj)
        b = suite.book
        suite.run.dop = b.held
        suite.run.end = self.now + (b.pending + b.running) * suite.case_s / max(b.held, 1)

    def remaining(self, node: int) -> list[tuple[float, int]]:
        """The completion heap the scheduler sees: each running action's remaining seconds and cores held."""
        out = []
        for traj, run in self.running[node].items():
            suite = self.suites.get(traj)
            if suite is not None and suite.serial_end is not None:
                b = suite.book
                left = suite.serial_end - self.now + b.pending * suite.case_s / max(b.held, 1)
            else:
                left = run.end - self.now
            out.append((max(0.0, left), run.dop))
        return out

    def dispatch(self, node: int) -> None:
        q = self.queue[node]
        if q and self.free[node] > 0:
            self.start(node, q)
        if self.malleable and not self.queue[node] and self.free[node] > 0:
            self.grow(node)

    def start(self, node: int, q: list[tuple[Action, int, float]]) -> None:
        if self.fixed is None:
            decision = schedule([a for a, _, _ in q], {"cpu": self.free[node]}, {"cpu": self.remaining(node)},
                                depth=2, policy=self.policy, now=self.now)
            picked = {id(a): u["cpu"] for a, u in decision.start}
        else:
            picked = {}
            free = self.free[node]
            for a, _, _ in q:  # FCFS, no backfilling
                need = a.cost["cpu"].min
                if need > free:
                    break
                picked[id(a)] = need
                free -= need
        if not picked:
            return
        left = []
        for a, traj, submit in q:
            dop = picked.get(id(a))
            if dop is None:
                left.append((a, traj, submit))
                continue
            step = self.steps[traj][self.next_step[traj]]
            self.free[node] -= dop
            if self.malleable and step.kind == "reward":
                book = MalleableSuite(step.cases, self.cfg.max_dop)
                took = book.grant(dop)
                self.free[node] += dop - took  # more cores than cases: the rest go back at once
                serial = self.cfg.exec_s + step.serial * step.t_ori
                case_s = (1.0 - step.serial) * step.t_ori / step.cases
                run = Running(traj, step, submit, self.now, took, 0.0, self.now + serial + step.cases * case_s / took)
                self.running[node][traj] = run
                self.suites[traj] = _Suite(run, book, case_s, self.now + serial)
                self.push(self.now + serial, "serial", traj)
                continue
            dur = self.cfg.exec_s + suite_seconds(step, dop)
            self.running[node][traj] = Running(traj, step, submit, self.now, dop, dur, self.now + dur)
            self.push(self.now + dur, "done", traj)
        self.queue[node] = left

    def grow(self, node: int) -> None:
        """Idle cores and nobody waiting: hand them to the running malleable suites that have cases left, the one
        with the least work left first (it ends soonest)."""
        suites = [(s.book.pending * s.case_s, t, s) for t, s in self.suites.items()
                  if self.node_of[t] == node and s.serial_end is None and s.book.wanted() > 0]
        for _, traj, suite in sorted(suites, key=lambda x: (x[0], x[1])):
            if self.free[node] <= 0:
                break
            self.free[node] -= suite.book.grant(self.free[node])
            self.start_cases(node, traj, suite)


class _Shared(_Base):
    """The pod baseline: actions start in their trajectory's pod and share the node's cores fairly."""

    def __init__(self, cfg: TraceConfig, trace: list[list[list[Step]]], policy: str, tests_dop: int) -> None:
        super().__init__(cfg, trace, policy)
        self.tests_dop = tests_dop
        self.pods = [0] * cfg.nodes
        self.capacity = int(cfg.cores_per_node / POD_REQUEST)
        self.waiting: list[tuple[int, float]] = []  # (trajectory, its first submit) waiting for a pod, FCFS
        self.running: list[dict[int, Running]] = [{} for _ in range(cfg.nodes)]
        self.rate: list[dict[int, float]] = [{} for _ in range(cfg.nodes)]
        self.node_version = [0] * cfg.nodes  # a completion event is stale once the node's rates changed
        self.node_clock = [0.0] * cfg.nodes  # when the node's running actions' remaining work was last brought up
        self.submitted: dict[int, float] = {}  # actions in their exec or pod-start delay: their submit time

    def submit(self, traj: int) -> None:
        node = self.node_of.get(traj)
        if node is None:
            free = [n for n in range(self.cfg.nodes) if self.pods[n] < self.capacity]
            if not free or self.waiting:
                self.waiting.append((traj, self.now))
                return
            node = min(free, key=lambda n: (self.pods[n], n))
            self.admit(node, traj, self.now)
            return
        self.begin(traj, self.now, self.cfg.exec_s)

    def admit(self, node: int, traj: int, submit: float) -> None:
        self.node_of[traj] = node
        self.pods[node] += 1
        self.begin(traj, submit, self.cfg.pod_start_s + self.cfg.exec_s)

    def begin(self, traj: int, submit: float, delay: float) -> None:
        if delay > 0:
            self.submitted[traj] = submit
            self.push(self.now + delay, "go", traj)
        else:
            self.start(self.node_of[traj], traj, submit)

    def start(self, node: int, traj: int, submit: float) -> None:
        step = self.steps[traj][self.next_step[traj]]
        dop = 1 if step.kind == "tool" else self.tests_dop
        work = suite_seconds(step, dop)
        self.catch_up(node)
        self.running[node][traj] = Running(traj, step, submit, self.now, dop, work)
        self.reschedule(node)

    def end_trajectory(self, traj: int) -> None:
        node = self.node_of.pop(traj)
        self.pods[node] -= 1
        while self.waiting and self.pods[node] < self.capacity:
            t, submit = self.waiting.pop(0)
            self.admit(node, t, submit)  # it has waited for its pod since its first action was submitted

    def catch_up(self, node: int) -> None:
        """The node's running actions progress at their rates from its clock to now (a node's rates change only when
        one of its actions starts or ends, so the others are left alone)."""
        dt = self.now - self.node_clock[node]
        self.node_clock[node] = self.now
        if dt <= 0:
            return
        runs = self.running[node]
        for traj, rate in self.rate[node].items():
            runs[traj].remaining -= rate * dt

    def reschedule(self, node: int) -> None:
        """Water-filling of the node's cores over its running actions (each uses up to its dop), then the node's
        next completion."""
        self.catch_up(node)
        runs = self.running[node]
        cores = float(self.cfg.cores_per_node)
        left = len(runs)
        by_dop: dict[int, list[int]] = {}
        for traj, r in runs.items():
            by_dop.setdefault(r.dop, []).append(traj)
        rate: dict[int, float] = {}
        for dop in sorted(by_dop):  # the smallest users first; everyone of one dop gets the same share
            members = by_dop[dop]
            c = min(float(dop), cores / left)
            for traj in members:
                rate[traj] = c / dop  # seconds of full-speed work per second: c of its dop processes' cores
            cores -= c * len(members)
            left -= len(members)
        self.rate[node] = rate
        self.node_version[node] += 1
        if runs:
            when = min(r.remaining / rate[t] for t, r in runs.items())
            self.push(self.now + max(when, 0.0), f"tick:{node}:{self.node_version[node]}", -1)

    def wake(self, what: str, traj: int) -> None:
        if what != "go":
            raise AssertionError(f"the shared policy has no {what!r} events")
        self.start(self.node_of[traj], traj, self.submitted.pop(traj))

    def handle(self, t: float, seq: int, what: str, traj: int) -> None:
        """A completion tick of a node (skipped, clock untouched, once the node's rates changed after it was set),
        else :meth:`_Base.handle`."""
        if not what.startswith("tick:"):
            super().handle(t, seq, what, traj)
            return
        _, node_s, version = what.split(":")
        node = int(node_s)
        if int(version) != self.node_version[node]:
            return
        self.now = t
        self.complete_due(node)

    def complete_due(self, node: int) -> None:
        self.catch_up(node)
        runs = self.running[node]
        for traj in [t for t, r in runs.items() if r.remaining <= 1e-9 * max(1.0, r.step.t_ori)]:
            run = runs.pop(traj)
            self.finished(traj, run.step, run.submit, run.start)
        self.reschedule(node)


def batches() -> Iterator[int]:
    yield from (128, 256, 512, 1024, 1280, 1536)
