"""A discrete-event simulation of actions on a CPU cluster under three allocation policies (ARL-Tangram §6.3-6.4).

- ``static``: trajectory-level allocation, the paper's Kubernetes baseline. Each trajectory holds a pod from its
  first action to its end, requesting 0.5 CPU with a limit of 4 (``POD_REQUEST``, ``POD_LIMIT``); a node admits
  pods while their requests fit its cores, a trajectory waits for room. Actions run at once inside their pod: a
  test suite with 4 processes (its limit), a tool call with one. The node's cores are shared among the running
  actions as the kernel's fair scheduler shares them among pods of equal requests: water-filling, each pod gets
  an equal share up to what its action can use; an action with d processes on c < d cores progresses at
  speedup(d) * c / d.
- ``fixed-<d>``: action-level allocation with a fixed degree of parallelism, FCFS per node: a test suite takes d
  cores (the action's maximum when lower), a tool call one; cores are exclusive.
- ``elastic``: ARL-Tangram's scheduler (:func:`services.actions.elastic.schedule`, depth 2) per node over FCFS
  queues: test suites scale within 1..32 cores by their Amdahl elasticity, tool calls take one core. It runs in
  scheduling rounds, once every ``window_s`` while a queue is not empty, over what gathered since the last round
  (run at every arrival, it would see a queue of one and give each early arrival all it can take).

Trajectories are placed on nodes by memory balance (the node with the least trajectory memory held) at their first
action, as the paper's CPU manager does; all later actions of a trajectory run there. The trace and every other
assumption is in :class:`TraceConfig` and docs/actions.md.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from services.actions.elastic import Action, Elasticity, Units, schedule

POD_REQUEST = 0.5  # CPU requested by each trajectory's pod (the paper's baseline)
POD_LIMIT = 4  # its CPU limit


@dataclass(frozen=True)
class TraceConfig:
    """A bursty agentic-coding trace: one burst of ``batch`` trajectories per RL step, each a few tool calls between
    LLM generations, then one long-tailed, elastic test-suite reward action."""

    nodes: int = 5
    cores_per_node: int = 256
    steps: int = 2  # RL steps; the next burst starts when every trajectory of the step has ended
    tools_min: int = 2
    tools_max: int = 6
    gen_median_s: float = 8.0  # LLM generation before each action, lognormal
    gen_sigma: float = 0.5
    tool_median_s: float = 1.5  # a tool call on one core, lognormal, not elastic
    tool_sigma: float = 0.8
    reward_median_s: float = 60.0  # the test suite on one core (T_ori), lognormal: a long tail
    reward_sigma: float = 1.0
    reward_max_s: float = 1800.0
    serial_min: float = 0.02  # Amdahl serial fraction of a test suite, uniform
    serial_max: float = 0.15
    max_dop: int = 32
    burst_jitter_s: float = 2.0
    window_s: float = 0.5  # the elastic scheduler runs once per window over the queue gathered since the last one


@dataclass
class Step:
    """One action of a trajectory: the generation time before it, then the action."""

    gen_s: float
    kind: str  # "tool" | "reward"
    t_ori: float
    serial: float = 0.0


def make_trace(cfg: TraceConfig, batch: int, seed: int) -> list[list[list[Step]]]:
    """Per RL step, per trajectory, its steps (same seed: the same trace for every policy)."""
    rng = random.Random(seed)
    trace = []
    for _ in range(cfg.steps):
        trajs = []
        for _ in range(batch):
            steps = [Step(rng.lognormvariate(math.log(cfg.gen_median_s), cfg.gen_sigma), "tool",
                          min(30.0, rng.lognormvariate(math.log(cfg.tool_median_s), cfg.tool_sigma)))
                     for _ in range(rng.randint(cfg.tools_min, cfg.tools_max))]
            steps.append(Step(rng.lognormvariate(math.log(cfg.gen_median_s), cfg.gen_sigma), "reward",
                              min(cfg.reward_max_s, rng.lognormvariate(math.log(cfg.reward_median_s), cfg.reward_sigma)),
                              rng.uniform(cfg.serial_min, cfg.serial_max)))
            trajs.append(steps)
        trace.append(trajs)
    return trace


def speedup(serial: float, d: int) -> float:
    """Amdahl: 1 / (s + (1 - s) / d)."""
    return 1.0 / (serial + (1.0 - serial) / d)


@dataclass
class Running:
    traj: int
    step: Step
    submit: float
    start: float
    dop: int
    remaining: float  # work left, in seconds at full speed on its dop processes


@dataclass
class Result:
    policy: str
    batch: int
    acts: list[float] = field(default_factory=list)  # per action: queue + execution
    queue: list[float] = field(default_factory=list)
    makespan: float = 0.0

    @property
    def mean_act(self) -> float:
        return sum(self.acts) / len(self.acts) if self.acts else 0.0

    @property
    def mean_queue(self) -> float:
        return sum(self.queue) / len(self.queue) if self.queue else 0.0


def simulate(cfg: TraceConfig, policy: str, trace: list[list[list[Step]]]) -> Result:
    """Mean ACT of every action of ``trace`` under ``policy`` (``static``, ``fixed-<d>`` or ``elastic``)."""
    if policy == "static":
        return _Shared(cfg, trace).run()
    if policy.startswith("fixed-"):
        return _Exclusive(cfg, trace, policy, fixed=int(policy.split("-", 1)[1])).run()
    if policy == "elastic":
        return _Exclusive(cfg, trace, policy, fixed=None).run()
    raise ValueError(f"policy {policy!r} is not static, fixed-<d> or elastic")


class _Base:
    def __init__(self, cfg: TraceConfig, trace: list[list[list[Step]]], policy: str) -> None:
        self.cfg = cfg
        self.trace = trace
        self.result = Result(policy, len(trace[0]) if trace else 0)
        self.now = 0.0
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
        for burst in self.trace:
            self.steps = [list(s) for s in burst]
            self.next_step = [0] * len(burst)
            self.node_of = {}
            self.node_mem = [0] * self.cfg.nodes
            self.live = len(burst)
            for i in range(len(burst)):
                self.push(self.now + rng.uniform(0, self.cfg.burst_jitter_s) + burst[i][0].gen_s, "submit", i)
            while self.live:
                self.handle(*heapq.heappop(self.events))
        self.result.makespan = self.now
        return self.result

    def handle(self, t: float, _seq: int, what: str, traj: int) -> None:
        """One event: the clock moves to ``t``, then a trajectory submits its next action or one wakes."""
        self.advance(t)
        self.now = t
        if what == "submit":
            self.submit(traj)
        else:
            self.wake(traj)

    def advance(self, t: float) -> None:
        pass

    def finished(self, r: Running) -> None:
        """Record the action; the trajectory generates its next step, or ends."""
        self.result.acts.append(self.now - r.submit)
        self.result.queue.append(r.start - r.submit)
        self.next_step[r.traj] += 1
        k = self.next_step[r.traj]
        if k < len(self.steps[r.traj]):
            self.push(self.now + self.steps[r.traj][k].gen_s, "submit", r.traj)
        else:
            self.end_trajectory(r.traj)
            self.live -= 1

    def end_trajectory(self, traj: int) -> None:
        node = self.node_of.get(traj)
        if node is not None:
            self.node_mem[node] -= 1

    def submit(self, traj: int) -> None:
        raise NotImplementedError

    def wake(self, traj: int) -> None:
        raise NotImplementedError


class _Exclusive(_Base):
    """Exclusive cores per action, FCFS per node: a fixed degree of parallelism, or the elastic scheduler."""

    def __init__(self, cfg: TraceConfig, trace: list[list[list[Step]]], policy: str, fixed: int | None) -> None:
        super().__init__(cfg, trace, policy)
        self.fixed = fixed
        self.free = [cfg.cores_per_node] * cfg.nodes
        self.queue: list[list[tuple[Action, int, float]]] = [[] for _ in range(cfg.nodes)]  # (action, traj, submit)
        self.running: list[dict[int, tuple[Running, float]]] = [{} for _ in range(cfg.nodes)]  # traj -> (run, end)

    def action(self, traj: int, step: Step) -> Action:
        if step.kind == "tool":
            return Action(f"{traj}", "tool", {"cpu": Units.fixed(1)}, key="cpu", elasticity=Elasticity("zero"),
                          t_ori=step.t_ori)
        units = Units(1, self.cfg.max_dop) if self.fixed is None else Units.fixed(min(self.fixed, self.cfg.max_dop))
        return Action(f"{traj}", "reward", {"cpu": units}, key="cpu", elasticity=Elasticity("amdahl", step.serial),
                      t_ori=step.t_ori)

    def submit(self, traj: int) -> None:
        node = self.node_of.get(traj)
        if node is None:
            node = self.place(traj)
        step = self.steps[traj][self.next_step[traj]]
        self.queue[node].append((self.action(traj, step), traj, self.now))
        self.dispatch_or_wait(node)

    def wake(self, traj: int) -> None:
        if traj < 0:  # a scheduling round of the elastic policy
            self.round_due = False
            for node in range(self.cfg.nodes):
                self.dispatch(node)
            if any(self.queue):
                self.ask_round()
            return
        node = self.node_of[traj]
        run, _ = self.running[node].pop(traj)
        self.free[node] += run.dop
        self.finished(run)
        self.dispatch_or_wait(node)

    round_due = False

    def ask_round(self) -> None:
        if not self.round_due:
            self.round_due = True
            window = self.cfg.window_s
            self.push((math.floor(self.now / window) + 1) * window, "done", -1)

    def dispatch_or_wait(self, node: int) -> None:
        if self.fixed is None:
            self.ask_round()  # the elastic scheduler decides in rounds
        else:
            self.dispatch(node)

    def dispatch(self, node: int) -> None:
        q = self.queue[node]
        if not q or self.free[node] <= 0:
            return
        if self.fixed is None:
            remaining = [end - self.now for _, end in self.running[node].values()]
            decision = schedule([a for a, _, _ in q], {"cpu": self.free[node]}, {"cpu": remaining}, depth=2)
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
            dur = a.get_dur(dop)
            run = Running(traj, step, submit, self.now, dop, dur)
            self.running[node][traj] = (run, self.now + dur)
            self.free[node] -= dop
            self.push(self.now + dur, "done", traj)
        self.queue[node] = left


class _Shared(_Base):
    """The pod baseline: actions start at once in their trajectory's pod and share the node's cores fairly."""

    def __init__(self, cfg: TraceConfig, trace: list[list[list[Step]]]) -> None:
        super().__init__(cfg, trace, "static")
        self.pods = [0] * cfg.nodes
        self.capacity = int(cfg.cores_per_node / POD_REQUEST)
        self.waiting: list[tuple[int, float]] = []  # (trajectory, its first submit) waiting for a pod, FCFS
        self.running: list[dict[int, Running]] = [{} for _ in range(cfg.nodes)]
        self.rate: list[dict[int, float]] = [{} for _ in range(cfg.nodes)]
        self.node_version = [0] * cfg.nodes  # a completion event is stale once the node's rates changed

    def submit(self, traj: int) -> None:
        node = self.node_of.get(traj)
        if node is None:
            free = [n for n in range(self.cfg.nodes) if self.pods[n] < self.capacity]
            if not free or self.waiting:
                self.waiting.append((traj, self.now))
                return
            node = min(free, key=lambda n: (self.pods[n], n))
            self.node_of[traj] = node
            self.pods[node] += 1
        self.start(node, traj, self.now)

    def start(self, node: int, traj: int, submit: float) -> None:
        step = self.steps[traj][self.next_step[traj]]
        dop = 1 if step.kind == "tool" else POD_LIMIT
        work = step.t_ori / (speedup(step.serial, dop) if step.kind == "reward" else 1.0)
        self.running[node][traj] = Running(traj, step, submit, self.now, dop, work)
        self.reschedule(node)

    def end_trajectory(self, traj: int) -> None:
        node = self.node_of.pop(traj)
        self.pods[node] -= 1
        while self.waiting and self.pods[node] < self.capacity:
            t, submit = self.waiting.pop(0)
            self.node_of[t] = node
            self.pods[node] += 1
            self.start(node, t, submit)  # it has waited for its pod since its first action was submitted

    def advance(self, t: float) -> None:
        dt = t - self.now
        if dt <= 0:
            return
        for node in range(self.cfg.nodes):
            runs = self.running[node]
            for traj, rate in self.rate[node].items():
                runs[traj].remaining -= rate * dt

    def reschedule(self, node: int) -> None:
        """Water-filling of the node's cores over its running actions (each uses up to its dop), then the node's
        next completion."""
        runs = self.running[node]
        cores = float(self.cfg.cores_per_node)
        left = len(runs)
        rate: dict[int, float] = {}
        for dop, traj in sorted((r.dop, traj) for traj, r in runs.items()):
            c = min(float(dop), cores / left)
            rate[traj] = c / dop  # seconds of full-speed work per second: c of its dop processes' cores
            cores -= c
            left -= 1
        self.rate[node] = rate
        self.node_version[node] += 1
        if runs:
            when = min(r.remaining / rate[t] for t, r in runs.items())
            self.push(self.now + max(when, 0.0), f"tick:{node}:{self.node_version[node]}", -1)

    def wake(self, traj: int) -> None:
        raise AssertionError("the shared policy completes actions by ticks")

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
        self.advance(t)
        self.now = t
        self.complete_due(node)

    def complete_due(self, node: int) -> None:
        runs = self.running[node]
        for traj in [t for t, r in runs.items() if r.remaining <= 1e-9 * max(1.0, r.step.t_ori)]:
            self.finished(runs.pop(traj))
        self.reschedule(node)


def batches() -> Iterator[int]:
    yield from (128, 256, 512, 1024, 1536)
