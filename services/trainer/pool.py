"""FlexMARL's agent-centric training pool (§6): the models' trainers are tenants of ``train.pool.slots`` slots, each
a set of cores with a worker process; a model holds a slot only while it trains.

- :class:`SlotScheduler` is the policy, with no I/O (tested on a fake clock): a model asks for a slot when a
  micro-batch of it is ready and gets one at once if any is free (the one it last used when that one is free), else
  it waits, first come first served; no slot is idle while a model waits. After a micro-batch the model releases
  its slot, unless more of its micro-batches are ready and no other model waits (then it keeps it, and its state
  stays in place).
- :class:`StateStore` is the host-memory side of Set/Get (§6.2, §7): each model's swapped state is one file-backed
  buffer, in host memory (``/dev/shm``) within ``train.pool.budget_mb``, beyond it in the run directory (a spill to
  disk: our addition), written and read in place by the slot processes. Two buffers per model alternate, so a slot
  that dies in the middle of a Set leaves the last complete state intact.
- :class:`TrainingPool` runs it: slot worker processes (:mod:`services.trainer.slot`) pinned to their cores, the
  scheduler behind a lock, and a call interface: every learner call of a model runs in the slot it holds, Gets the
  model's state if the slot does not hold it, and Sets it back when the model gives the slot up (or after
  :data:`MAX_LOG` changing calls); the changing calls since the last Set are logged, so that a slot killed
  mid-micro-batch loses nothing: a fresh slot Gets the stored state, runs the logged calls again, then the call.
  ``train.pool.mode`` warm keeps the worker processes alive between tenants (only the state moves); destroy ends a
  slot's process whenever its model releases it (suspend-to-destroy: the next tenant starts a fresh one).
- :class:`PooledLearner` has the torch learner's surface (what :class:`~services.trainer.service.TrainerService`
  calls), each call forwarded to the model's slot.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any

from shared.kernel.config import ChorusConfig
from shared.kernel.files import sweep_dead_owners

SET_AFTER = frozenset({"describe", "load_state_dict", "restore_latest", "noop"})  # calls whose state is set at once
STORE_PREFIX = "chorus-pool-"  # + the pool's pid: a host-memory store, removed by the next pool once that pid is gone
MAX_LOG = 8  # changing calls a model's log holds at most: the next one Sets its state (a slot lost costs no more)


# --- the policy ---------------------------------------------------------------------------------------------------
@dataclass
class SlotInfo:
    index: int
    holder: str | None = None
    last: str | None = None  # the model that last held it (whose state may still be in place)
    since: float = 0.0  # when the holder got it
    busy_s: float = 0.0  # seconds held, finished grants
    grants: int = 0
    released_at: float = 0.0


class SlotScheduler:
    """Which model holds which slot. Not thread-safe: :class:`TrainingPool` calls it under its lock.

    A model of several ranks (a DeepSpeed group, ``sizes``) is a gang (§6.1): it takes as many slots as it has
    ranks, all at once or none, and gives them all back together; first come first served holds for gangs as for
    single slots (a gang at the head of the queue is not overtaken while it waits for enough slots, so it cannot
    starve)."""

    def __init__(self, slots: int, clock: Callable[[], float] = time.monotonic,
                 sizes: dict[str, int] | None = None) -> None:
        if slots < 1:
            raise ValueError(f"a training pool needs at least one slot, got {slots}")
        self.sizes = dict(sizes or {})
        too_big = {m: n for m, n in self.sizes.items() if n > slots}
        if too_big:
            raise ValueError(f"a gang needs as many slots as its ranks: {too_big} in a pool of {slots} slot(s)")
        self.clock = clock
        self.slots = [SlotInfo(i) for i in range(slots)]
        self.waiting: deque[str] = deque()
        self.gangs: dict[str, list[int]] = {}  # a gang's slots while it holds them, rank 0's first
        self.started = clock()
        self.last_slot: dict[str, int] = {}
        self.kept = 0  # releases in which the model kept its slot (more ready, nobody waiting)
        self.moved = 0  # grants to a slot other than the model's last one

    def holding(self, model: str) -> int | None:
        """The slot ``model`` holds (a gang's first one: where its rank 0 runs), or None."""
        if model in self.gangs:
            return self.gangs[model][0]
        for s in self.slots:
            if s.holder == model:
                return s.index
        return None

    def gang(self, model: str) -> list[int]:
        """Every slot ``model`` holds, rank 0's first."""
        return list(self.gangs.get(model, [s.index for s in self.slots if s.holder == model]))

    def size(self, model: str) -> int:
        return self.sizes.get(model, 1)

    def want(self, model: str) -> int | None:
        """``model`` has a micro-batch ready: the slot it holds (kept or granted now), or None when it waits."""
        held = self.holding(model)
        if held is not None:
            return held
        if model in self.waiting:
            return None
        free = [s for s in self.slots if s.holder is None]
        if len(free) < self.size(model) or self.waiting:  # first come, first served: nobody overtakes
            self.waiting.append(model)
            return None
        return self._grant_all(model, free)

    def _grant_all(self, model: str, free: list[SlotInfo]) -> int:
        """``model``'s slot (a gang: its slots, the first one chosen as a single slot is) out of ``free``."""
        first = self._choose(model, free)
        picked = [first] + [s for s in free if s is not first][: self.size(model) - 1]
        index = self._grant(model, first)
        for s in picked[1:]:
            s.holder, s.since = model, self.clock()
            s.grants += 1
        if len(picked) > 1:
            self.gangs[model] = [s.index for s in picked]
        return index

    def _serve_waiting(self) -> list[tuple[str, int]]:
        """Grants to the models at the head of the queue while enough slots are free for them."""
        grants: list[tuple[str, int]] = []
        while self.waiting:
            free = [s for s in self.slots if s.holder is None]
            if len(free) < self.size(self.waiting[0]):
                break
            nxt = self.waiting.popleft()
            grants.append((nxt, self._grant_all(nxt, free)))
        return grants

    def release(self, model: str, more: bool = False) -> list[tuple[str, int]]:
        """``model`` has trained a micro-batch. It keeps its slot when ``more`` of its micro-batches are ready and no
        other model waits; else the slot goes to the first waiting model, and ``model`` (with ``more``) waits
        again at the back. Returns the grants made."""
        index = self.holding(model)
        if index is None:
            return []
        if more and not self.waiting:
            self.kept += 1
            return []
        now = self.clock()
        for i in self.gang(model):
            slot = self.slots[i]
            slot.busy_s += now - slot.since
            slot.holder, slot.last, slot.released_at = None, model, now
        self.gangs.pop(model, None)
        grants = self._serve_waiting()
        if more:
            granted = self.want(model)
            if granted is not None:
                grants.append((model, granted))
        return grants

    def leave(self, model: str) -> list[tuple[str, int]]:
        """``model`` is gone (its trainer stopped): out of the queue, and its slot released."""
        with contextlib.suppress(ValueError):
            self.waiting.remove(model)
        if self.holding(model) is None:  # it may have been the head of the queue, holding up the others
            return self._serve_waiting()
        return self.release(model)

    def busy_seconds(self, now: float | None = None) -> list[float]:
        now = self.clock() if now is None else now
        return [s.busy_s + (now - s.since if s.holder is not None else 0.0) for s in self.slots]

    def utilisation(self, now: float | None = None) -> float:
        """Held slot-seconds over slot-seconds since the pool started."""
        now = self.clock() if now is None else now
        span = (now - self.started) * len(self.slots)
        return sum(self.busy_seconds(now)) / span if span > 0 else 0.0

    def _choose(self, model: str, free: list[SlotInfo]) -> SlotInfo:
        """The model's last slot when free (its state may still be there), else a free slot nobody's state is in,
        else the one released longest ago."""
        last = self.last_slot.get(model)
        for s in free:
            if s.index == last:
                return s
        fresh = [s for s in free if s.last is None]
        return fresh[0] if fresh else min(free, key=lambda s: s.released_at)

    def _grant(self, model: str, slot: SlotInfo) -> int:
        if self.last_slot.get(model) not in (None, slot.index):
            self.moved += 1
        slot.holder, slot.since = model, self.clock()
        slot.grants += 1
        self.last_slot[model] = slot.index
        return slot.index


# --- host memory: the swapped states ------------------------------------------------------------------------------
@dataclass
class StoredState:
    path: Path
    nbytes: int
    meta: bytes  # the learner's SwapMeta, pickled
    header: bytes  # the buffer's WeightsHeader, packed
    resident: bool  # in host memory (False: spilled to the run directory)
    generation: int = 0


class StateStore:
    """Where each model's swapped state lives between tenancies (host memory within a byte budget, else the run
    directory). Two files per model alternate: the one being written is never the one the store points at."""

    def __init__(self, budget_bytes: int, spill_dir: Path, tag: str) -> None:
        self.budget = budget_bytes
        shm = Path("/dev/shm")
        where = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
        sweep_dead_owners(where, STORE_PREFIX)  # the states a killed pool left in host memory
        self.memory_dir = Path(tempfile.mkdtemp(prefix=f"{STORE_PREFIX}{tag}-", dir=where))
        self.spill_dir = spill_dir
        self.states: dict[str, StoredState] = {}
        self.bytes_set = 0
        self.bytes_got = 0

    def resident_bytes(self) -> int:
        return sum(s.nbytes for s in self.states.values() if s.resident)

    def spilled_bytes(self) -> int:
        return sum(s.nbytes for s in self.states.values() if not s.resident)

    def target(self, model: str, nbytes: int) -> tuple[Path, bool]:
        """Where the next Set of ``model`` (about ``nbytes``) goes: the file the store does not point at, in host
        memory if the budget allows."""
        cur = self.states.get(model)
        others = self.resident_bytes() - (cur.nbytes if cur is not None and cur.resident else 0)
        resident = others + nbytes <= self.budget
        generation = (cur.generation + 1) if cur is not None else 0
        where = self.memory_dir if resident else self.spill_dir
        where.mkdir(parents=True, exist_ok=True)
        return where / f"{model}.{generation % 2}.state", resident

    def commit(self, model: str, path: Path, nbytes: int, header: bytes, meta: bytes, resident: bool) -> None:
        """The Set into ``path`` completed: the store points at it (and drops the other place's file)."""
        cur = self.states.get(model)
        generation = (cur.generation + 1) if cur is not None else 0
        if cur is not None and cur.path.parent != path.parent:
            _remove(cur.path)
        self.states[model] = StoredState(path, nbytes, meta, header, resident, generation)
        self.bytes_set += nbytes

    def get(self, model: str) -> StoredState | None:
        return self.states.get(model)

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.memory_dir, ignore_errors=True)


def _remove(path: Path) -> None:
    """A stored state: a file (a learner's buffer) or a directory (a gang's shards, every rank its own)."""
    import shutil

    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


# --- the slot workers ---------------------------------------------------------------------------------------------
class SlotLost(RuntimeError):
    """The slot's worker process exited in the middle of a call."""


def machine_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def slot_cores(slots: int, per_slot: int | None, cores: list[int] | None = None) -> list[list[int]]:
    """Each slot's cores: ``per_slot`` of this process's cores each (default: an equal share, at least one),
    consecutive, wrapping around when the slots ask for more cores than there are."""
    cores = cores or machine_cores()
    k = per_slot or max(1, len(cores) // slots)
    return [[cores[(i * k + j) % len(cores)] for j in range(k)] for i in range(slots)]


class SlotWorker:
    """One slot's worker process and the pipe to it (the calls are serial: one tenant at a time)."""

    def __init__(self, index: int, cores: list[int], spec: Path) -> None:
        self.index, self.cores, self.spec = index, cores, spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.resident: str | None = None  # whose latest state is in place (the store's copy and the logged calls)
        self.starts = 0
        self.calling: str | None = None  # the learner call in progress (what a fault test kills in the middle of)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.alive() and self.proc is not None else None

    def start(self) -> float:
        """A fresh process (the control cost of a swap); returns the seconds it took to answer."""
        t0 = time.perf_counter()
        ours, theirs = Pipe(duplex=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(len(self.cores)), "CHORUS_SLOT_PARENT": str(os.getpid())}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.trainer.slot", str(theirs.fileno()), str(self.spec), str(self.index),
             ",".join(map(str, self.cores))],
            pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.conn = ours
        self.resident = None
        self.starts += 1
        reply = self._recv()
        if reply[0] != "ready":
            raise SlotLost(f"slot {self.index}: the worker answered {reply[0]!r} instead of ready")
        return time.perf_counter() - t0

    def request(self, msg: tuple[Any, ...]) -> tuple[Any, ...]:
        if self.conn is None or not self.alive():
            raise SlotLost(f"slot {self.index}: no worker process")
        self.calling = str(msg[3]) if len(msg) > 3 else str(msg[0])
        try:
            self.conn.send(msg)
            return self._recv()
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise SlotLost(f"slot {self.index}: the worker is gone ({type(exc).__name__})") from exc
        finally:
            self.calling = None

    def _recv(self) -> tuple[Any, ...]:
        assert self.conn is not None
        try:
            reply = self.conn.recv()
        except (EOFError, ConnectionResetError, OSError) as exc:
            code = self.proc.wait(timeout=10) if self.proc is not None else None
            raise SlotLost(f"slot {self.index}: the worker process exited (code {code})") from exc
        if not isinstance(reply, tuple):
            raise SlotLost(f"slot {self.index}: the worker answered {type(reply).__name__}")
        return reply

    def stop(self) -> None:
        """Ask the process to exit (killed after 10 s)."""
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.send(("exit",))
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
        self.proc, self.conn, self.resident = None, None, None


@dataclass
class SwapTimes:
    control_s: float = 0.0  # process starts and learner builds
    get_s: float = 0.0  # state copied into a slot (data)
    set_s: float = 0.0  # state copied out of a slot (data)
    gets: int = 0
    sets: int = 0
    starts: int = 0
    builds: int = 0
    lost: int = 0  # calls whose slot died under them (run again)
    replayed: int = 0  # logged calls run again on a fresh slot, after the stored state was got back
    compute_s: float = 0.0  # seconds in micro-batches and steps (wall)
    compute_cpu_s: float = 0.0  # CPU seconds of the slot processes in them (every thread of a slot)

    @property
    def data_s(self) -> float:
        return self.get_s + self.set_s


@dataclass
class CallResult:
    value: Any
    version: int
    accumulated: int
    info: dict[str, Any] = field(default_factory=dict)


class TrainingPool:
    """The slots, their workers and the state store, for every model of a run (thread-safe: each model's trainer
    calls from its own worker thread)."""

    def __init__(self, cfg: ChorusConfig, *, slots: int | None = None, mode: str | None = None,
                 cores: list[list[int]] | None = None, budget_bytes: int | None = None,
                 clock: Callable[[], float] = time.monotonic, log: Any = None, swap: bool = True) -> None:
        pc = cfg.train.pool
        n = slots or pc.slots
        self.cfg = cfg
        self.mode = mode or pc.mode
        self.attempts = pc.attempts
        self.log = log
        # a DeepSpeed model is a gang of one slot per rank (its rank 0 in the first slot's process)
        self.sizes = {m: mc.trainer.deepspeed.ranks for m, mc in cfg.models.items()
                      if mc.trainer.backend == "deepspeed"}
        self.sched = SlotScheduler(n, clock, self.sizes)
        self.lock = threading.Condition()
        self.pool_dir = cfg.run_dir / "pool"
        self.pool_dir.mkdir(parents=True, exist_ok=True)
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.spec = self.pool_dir / f"config-{tag}.json"
        self.spec.write_text(json.dumps(cfg.model_dump(mode="json")))
        self.store = StateStore(int(pc.budget_mb * 2**20) if budget_bytes is None else budget_bytes,
                                self.pool_dir / "spill", tag)
        layout = cores or slot_cores(n, pc.cores)
        self.workers = [SlotWorker(i, layout[i], self.spec) for i in range(n)]
        self.times = SwapTimes()
        self.closed = False
        # False: a model's state never leaves its slot (static allocation: one slot per model, held the whole run;
        # what loadtests/bench_training_pool.py compares the pool with)
        self.swap = swap
        self.logs: dict[str, list[tuple[str, bytes]]] = {}  # per model: the changing calls since its last Set
        # called with the free cores (:meth:`free_cores`) whenever slots change hands: what lends them to rollouts
        self.listeners: list[Callable[[list[int]], None]] = []

    # --- tenancy ----------------------------------------------------------------------------------------------
    def acquire(self, model: str) -> int:
        """Block until ``model`` holds a slot; returns it."""
        with self.lock:
            slot = self.sched.want(model)
            granted = slot is not None
            while slot is None:
                if self.closed:
                    raise SlotLost("the training pool is closing")
                self.lock.wait(timeout=1.0)
                slot = self.sched.holding(model)
        if granted:
            self._changed()
        return slot

    def release(self, model: str, more: bool = False) -> None:
        """``model`` has trained a micro-batch. It keeps its slot (and its state stays in place, unset) when ``more``
        of its micro-batches are ready and no other model waits; else its state is set to the store while the slot
        is still its own, then the slot goes to the next model (destroy mode: its process ends)."""
        with self.lock:
            index = self.sched.holding(model)
            if index is None:
                return
            if more and not self.sched.waiting:
                self.sched.kept += 1
                return
        if self.swap and self.logs.get(model):
            self.call(model, "noop", set_state=True)  # Set: the calls since the last one are in the slot only
        if self.mode == "destroy" or model in self.sizes:
            # suspend-to-destroy: the process ends, its cores go back; while the slot is still this model's, so
            # that no next tenant is already using the process. A gang always ends its processes (every rank:
            # the next tenancy may get other slots, and DeepSpeed's process-wide state is not built twice)
            self.workers[index].stop()
        with self.lock:
            self.sched.release(model, more)
            self.lock.notify_all()
        self._changed()

    def leave(self, model: str) -> None:
        with self.lock:
            self.sched.leave(model)
            self.lock.notify_all()
        self._changed()

    def free_cores(self) -> list[int]:
        """The cores of the slots no model holds now (what the pool can lend to other work)."""
        with self.lock:
            held = {c for s in self.sched.slots if s.holder is not None for c in self.workers[s.index].cores}
        return sorted({c for w in self.workers for c in w.cores} - held)

    def _changed(self) -> None:
        if not self.listeners:
            return
        free = self.free_cores()
        for listener in list(self.listeners):
            try:
                listener(free)
            except Exception as exc:  # a listener's failure is its own: the pool goes on
                if self.log is not None:
                    self.log.warning("a free-cores listener failed", error=f"{type(exc).__name__}: {exc}")

    # --- calls ------------------------------------------------------------------------------------------------
    def call(self, model: str, method: str, *args: Any, mutates: bool = True,
             set_state: bool | None = None) -> CallResult:
        """``method(*args)`` on ``model``'s learner, in the slot it holds (acquired first if it holds none), with its
        state brought in if the slot does not hold it. A call that changes the state Sets it to the store after
        when ``set_state`` (default: a load, the first build, the :data:`MAX_LOG`-th changing call since the last
        Set; and :meth:`release`, when the model gives its slot up); the other changing calls (micro-batches,
        steps) are logged until the next Set. A slot
        that dies under a call is started afresh, the stored state is got back, the logged calls run again on it
        (the same numbers: one thread, the same order) and then the call (``train.pool.attempts`` times)."""
        with self.lock:
            index = self.sched.holding(model)
        if index is None:
            index = self.acquire(model)
        worker = self.workers[index]
        if set_state is None:
            set_state = method in SET_AFTER or (mutates and len(self.logs.get(model, ())) >= MAX_LOG - 1)
        data = pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
        for attempt in range(1, self.attempts + 1):
            try:
                return self._run(worker, model, method, data, mutates, set_state and self.swap)
            except SlotLost as exc:
                self.times.lost += 1
                if self.log is not None:
                    self.log.warning("a slot worker died during a call; running it again on a fresh process",
                                     slot=index, model=model, call=method, attempt=attempt, error=str(exc))
                worker.stop()
                if attempt == self.attempts:
                    raise
        raise AssertionError("unreachable")

    def _run(self, worker: SlotWorker, model: str, method: str, data: bytes, mutates: bool,
             put_state: bool) -> CallResult:
        if not worker.alive():
            took = worker.start()
            self.times.control_s += took
            self.times.starts += 1
        if worker.resident != model:
            self._bring(worker, model)
        put = None
        if put_state:
            stored = self.store.get(model)
            put = self.store.target(model, stored.nbytes if stored is not None else 0)
        worker.resident = None  # until the reply: a failed call leaves nothing trusted in place
        reply = worker.request(("call", model, None, method, data, None if put is None else (str(put[0]), put[1]),
                                self._extra(model)))
        if reply[0] == "error":
            _, kind, text, info = reply
            self._account(info, method)
            raise _rebuild(kind, text)  # the next call brings the state back as it was before this one
        _, value, info = reply
        self._account(info, method)
        if put is not None:
            nbytes, header, meta = info["set"]
            self.store.commit(model, put[0], nbytes, header, meta, put[1])
            self.logs.pop(model, None)
        elif mutates and self.swap:
            self.logs.setdefault(model, []).append((method, data))
        if mutates:
            for other in self.workers:  # a copy of an older state in another slot is not to be used again
                if other is not worker and other.resident == model:
                    other.resident = None
        worker.resident = model
        return CallResult(pickle.loads(value), info["version"], info["accumulated"], info)

    def _bring(self, worker: SlotWorker, model: str) -> None:
        """The model's state into ``worker``: Get the stored one, then run the calls logged since it was set."""
        stored = self.store.get(model) if self.swap else None
        extra = self._extra(model)
        if stored is not None:
            reply = worker.request(("call", model, (str(stored.path), stored.nbytes, stored.header, stored.meta),
                                    "noop", pickle.dumps(()), None, extra))
            self._check(reply, "noop")
        for method, data in self.logs.get(model, []):
            self._check(worker.request(("call", model, None, method, data, None, extra)), method)
            self.times.replayed += 1

    def _extra(self, model: str) -> dict[str, Any]:
        """What a slot needs to build ``model``'s learner beyond the config: a gang's other ranks' cores."""
        if model not in self.sizes:
            return {}
        with self.lock:
            gang = self.sched.gang(model)
        return {"ranks_cores": [self.workers[i].cores for i in gang[1:]]}

    def _check(self, reply: tuple[Any, ...], method: str) -> None:
        info = reply[-1] if isinstance(reply[-1], dict) else {}
        self._account(info, "")
        if reply[0] == "error":
            raise SlotLost(f"bringing the state back failed in {method}: {reply[1]}: {reply[2]}")

    def _account(self, info: dict[str, Any], method: str = "") -> None:
        t = self.times
        if method in ("micro_batch", "step"):
            t.compute_s += info.get("call_s", 0.0)
            t.compute_cpu_s += info.get("cpu_s", 0.0)
        t.control_s += info.get("build_s", 0.0)
        t.builds += int(info.get("build_s", 0.0) > 0)
        if "get_s" in info:
            t.get_s += info["get_s"]
            t.gets += 1
            self.store.bytes_got += int(info.get("get_bytes", 0))
        if "set_s" in info:
            t.set_s += info["set_s"]
            t.sets += 1

    # --- visibility -------------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            busy = self.sched.busy_seconds()
            slots = [{"slot": s.index, "holder": s.holder, "last": s.last, "busy_s": round(busy[s.index], 3),
                      "grants": s.grants, "cores": self.workers[s.index].cores, "pid": self.workers[s.index].pid,
                      "call": self.workers[s.index].calling, "starts": self.workers[s.index].starts} for s in self.sched.slots]
            waiting = list(self.sched.waiting)
            util = self.sched.utilisation()
            kept, moved = self.sched.kept, self.sched.moved
        t = self.times
        return {"mode": self.mode, "slots": slots, "waiting": waiting, "utilisation": round(util, 4),
                "kept": kept, "moved": moved,
                "swap": {"control_s": round(t.control_s, 3), "data_s": round(t.data_s, 3), "get_s": round(t.get_s, 3),
                         "set_s": round(t.set_s, 3), "gets": t.gets, "sets": t.sets, "starts": t.starts,
                         "builds": t.builds, "lost": t.lost, "replayed": t.replayed, "bytes_set": self.store.bytes_set,
                         "compute_s": round(t.compute_s, 3), "compute_cpu_s": round(t.compute_cpu_s, 3),
                         "bytes_got": self.store.bytes_got},
                "resident_bytes": self.store.resident_bytes(), "spilled_bytes": self.store.spilled_bytes()}

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify_all()
        for w in self.workers:
            w.stop()
        self.store.close()
        with contextlib.suppress(OSError):
            self.spec.unlink()


_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "RuntimeError": RuntimeError,
                                      "IndexError": IndexError, "KeyError": KeyError, "TypeError": TypeError}


def _rebuild(kind: str, text: str) -> Exception:
    """The slot's exception as the same type here (the trainer service tells learner errors by type)."""
    return _ERRORS.get(kind, RuntimeError)(text)


# --- the learner's surface ----------------------------------------------------------------------------------------
class PooledLearner:
    """A model's learner in the pool: what the trainer service calls, each call run in the model's slot."""

    def __init__(self, pool: TrainingPool, model: str) -> None:
        self.pool, self.model_name = pool, model
        self.global_batch = pool.cfg.train.global_batch
        self.marft = pool.cfg.marft_on
        info = self._call("describe", mutates=True).value  # builds the learner and stores its first state
        self.vocab_size: int = info["vocab_size"]
        self.context: int | None = info["context"]
        self.adapters: list[str] | None = info["adapters"]
        self.pool.release(model)

    version = 0
    accumulated = 0

    def _call(self, method: str, *args: Any, mutates: bool = True) -> CallResult:
        r = self.pool.call(self.model_name, method, *args, mutates=mutates)
        self.version, self.accumulated = r.version, r.accumulated
        return r

    def release(self, more: bool = False) -> None:
        self.pool.release(self.model_name, more)

    def ready(self) -> bool:
        if self.accumulated < self.global_batch:
            return False
        if self.marft:  # a MARFT batch may be larger than the global batch: the slot's learner knows
            return bool(self._call("ready", mutates=False).value)
        return True

    def micro_batch(self, samples: Any, keep_idx: Any, estimator: str) -> float:
        return float(self._call("micro_batch", list(samples), list(keep_idx), estimator).value)

    def step(self) -> Any:
        if not self.ready():
            return None
        return self._call("step").value

    def named_tensors(self) -> Any:
        return self._call("named_tensors", mutates=False).value

    def optimizer_state(self) -> Any:
        return self._call("optimizer_state", mutates=False).value

    def state_dict(self) -> Any:
        return self._call("state_dict", mutates=False).value

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)

    def save_checkpoint(self, directory: Path) -> Path:
        return Path(self._call("save_checkpoint", directory, mutates=False).value)

    def restore_latest(self, directory: Path) -> Path | None:
        path = self._call("restore_latest", directory).value
        return None if path is None else Path(path)

    def close(self) -> None:
        self.pool.leave(self.model_name)
