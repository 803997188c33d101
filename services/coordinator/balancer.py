"""FlexMARL's rollout manager (§5.2, hierarchical load balancing), as pure synchronous code.

No I/O and no clock of its own: the coordinator tells it which rollouter instances registered, what they report
and when, which generation requests it sent where and which answered; it answers where the next request goes and
which instances should move from one model to another.

- **Intra-agent balancing**: per model, a min-heap of its live instances keyed by their current load; a request
  goes to the instance with the lowest load. The load of an instance is the rows this manager has in flight on it,
  or what the instance last reported (queued + running rows) when that is more (another requester's work); ties
  go to fewer tokens in flight, then to the instance that got a request least recently (a new one first: light
  traffic spreads over every instance instead of always finding the same idle one), then to the name. The heap is lazy: every change of an instance's load
  pushes a fresh entry, and stale entries are skipped when they surface.
- **Fault tolerance**: an instance that misses ``misses`` heartbeats (its load reports) in a row, or that the
  caller finds dead, is removed, and the requests in flight on it are handed back to be re-run elsewhere. A
  request that times out is re-queued (sent to another instance) while its first attempt may still answer:
  the first answer wins, a later one is discarded and counted, so nothing is generated twice into training.
- **Inter-agent balancing**: :func:`plan_migrations` compares the models' queue lengths (requests waiting for an
  answer); when the disparity between the most and the least loaded model exceeds Δ, instances move from the
  least to the most loaded, as many as the difference in queue lengths, never leaving the donor without one.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

DELTA = 5  # FlexMARL's load-disparity threshold (§7.1: Δ = 5)
DONE_MEMORY = 65536  # answered request ids remembered to discard a late second answer


@dataclass
class Instance:
    """One live rollouter instance as the manager sees it."""

    model: str
    name: str
    rows: int = 0  # rows of requests this manager has in flight on it
    requests: int = 0  # requests this manager has in flight on it
    reported_rows: int = 0  # queued + running rows it reported last
    tokens: int = 0  # tokens in flight it reported last
    last_seen: float = 0.0
    draining: bool = False  # leaving (SIGTERM or a migration): no new requests
    last_sent: int = 0  # dispatch sequence number of the last request sent to it (0: none yet)
    stamp: int = 0  # bumps with every load change; heap entries with an older stamp are stale

    @property
    def load(self) -> int:
        return max(self.rows, self.reported_rows)


@dataclass
class Attempt:
    """One request sent to one instance."""

    request_id: str
    model: str
    instance: str
    rows: int


@dataclass(frozen=True)
class Migration:
    """Move ``instances`` (names, of ``donor``) to serve ``target``."""

    donor: str
    target: str
    instances: tuple[str, ...]


@dataclass
class RolloutManager:
    """The live instances of every model, their load, and the generation requests in flight on them."""

    heartbeat_s: float = 2.0
    misses: int = 3
    instances: dict[str, dict[str, Instance]] = field(default_factory=dict)  # model -> name -> instance
    attempts: dict[str, list[Attempt]] = field(default_factory=dict)  # request id -> its attempts in flight
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("dispatched", "requeued", "rerun_after_loss", "discarded", "instances_removed"), 0))
    _heaps: dict[str, list[tuple[int, int, int, str, int]]] = field(default_factory=dict)
    _done: OrderedDict[str, None] = field(default_factory=OrderedDict)
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    # --- registry ---------------------------------------------------------------------------------------------------
    def register(self, model: str, name: str, now: float) -> Instance:
        """An instance that registered (or reported) for ``model``: live from ``now``."""
        inst = self.instances.setdefault(model, {}).get(name)
        if inst is None:
            inst = self.instances[model][name] = Instance(model, name, last_seen=now)
            self._touch(inst)
        inst.last_seen = max(inst.last_seen, now)
        return inst

    def report(self, model: str, name: str, now: float, *, queued: int, running: int, tokens: int = 0,
               draining: bool = False) -> None:
        """A load report (a heartbeat): rows queued and running on the instance, tokens in flight."""
        inst = self.register(model, name, now)
        key = (inst.load, inst.tokens, inst.draining)
        inst.reported_rows, inst.tokens, inst.draining = max(0, queued) + max(0, running), max(0, tokens), draining
        if (inst.load, inst.tokens, inst.draining) != key:  # an unchanged heartbeat leaves its heap entry valid
            self._touch(inst)

    def suspend(self, model: str, name: str) -> None:
        """No new requests to this instance until it reports that it routes again (it answered no-responders, or
        it is migrating)."""
        inst = self.instances.get(model, {}).get(name)
        if inst is not None and not inst.draining:
            inst.draining = True
            self._touch(inst)

    def remove(self, model: str, name: str) -> list[Attempt]:
        """Forget an instance (dead, gone, or moved to another model); its attempts in flight come back, to be
        sent elsewhere (a request with another attempt still in flight is not handed back twice)."""
        inst = self.instances.get(model, {}).pop(name, None)
        if inst is None:
            return []
        self.counters["instances_removed"] += 1
        lost = []
        for rid, tries in list(self.attempts.items()):
            mine = [a for a in tries if a.model == model and a.instance == name]
            if not mine:
                continue
            tries[:] = [a for a in tries if a not in mine]
            if not tries:
                del self.attempts[rid]
                lost.append(mine[0])
        self.counters["rerun_after_loss"] += len(lost)
        return lost

    def expire(self, now: float) -> list[tuple[str, str, list[Attempt]]]:
        """Remove every instance whose last heartbeat is older than ``misses`` intervals: (model, name, its lost
        attempts) for each."""
        limit = self.heartbeat_s * self.misses
        out = []
        for model, insts in self.instances.items():
            for name in [n for n, i in insts.items() if now - i.last_seen > limit]:
                out.append((model, name))
        return [(m, n, self.remove(m, n)) for m, n in out]

    def live(self, model: str) -> list[str]:
        return sorted(n for n, i in self.instances.get(model, {}).items() if not i.draining)

    # --- intra-agent balancing --------------------------------------------------------------------------------------
    def _touch(self, inst: Instance) -> None:
        inst.stamp += 1
        heap = self._heaps.setdefault(inst.model, [])
        heapq.heappush(heap, (inst.load, inst.tokens, inst.last_sent, inst.name, inst.stamp))
        live = self.instances.get(inst.model, {})
        if len(heap) > 4 * len(live) + 64:  # stale entries pile up where nothing is picked: keep only the live ones
            heap[:] = [(i.load, i.tokens, i.last_sent, i.name, i.stamp) for i in live.values()]
            heapq.heapify(heap)

    def pick(self, model: str, exclude: Iterable[str] = ()) -> str | None:
        """The live instance of ``model`` with the lowest load (the heap's top), not one of ``exclude``; None when
        there is none."""
        heap = self._heaps.get(model, [])
        insts = self.instances.get(model, {})
        skipped = []
        excluded = set(exclude)
        chosen = None
        while heap:
            _, _, _, name, stamp = heap[0]
            inst = insts.get(name)
            if inst is None or inst.stamp != stamp:
                heapq.heappop(heap)  # stale: the instance is gone or its load changed since
                continue
            if inst.draining or name in excluded:
                skipped.append(heapq.heappop(heap))
                continue
            chosen = name
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return chosen

    def dispatch(self, request_id: str, model: str, rows: int, exclude: Iterable[str] = ()) -> Attempt | None:
        """Send a request of ``rows`` prompts to the least-loaded instance of ``model`` (None: no live one)."""
        name = self.pick(model, exclude)
        if name is None:
            return None
        inst = self.instances[model][name]
        inst.rows += rows
        inst.requests += 1
        inst.last_sent = next(self._seq) + 1
        self._touch(inst)
        attempt = Attempt(request_id, model, name, rows)
        self.attempts.setdefault(request_id, []).append(attempt)
        self.counters["dispatched"] += 1
        return attempt

    def _release(self, attempt: Attempt) -> None:
        inst = self.instances.get(attempt.model, {}).get(attempt.instance)
        if inst is not None:
            inst.rows = max(0, inst.rows - attempt.rows)
            inst.requests = max(0, inst.requests - 1)
            self._touch(inst)
        tries = self.attempts.get(attempt.request_id)
        if tries is not None:
            tries[:] = [a for a in tries if a is not attempt]
            if not tries:
                del self.attempts[attempt.request_id]

    def requeue(self, attempt: Attempt) -> Attempt | None:
        """A request timed out on its instance: send it to another one as well (its first attempt stays in flight:
        whichever answers first wins). None when no other instance is live."""
        again = self.dispatch(attempt.request_id, attempt.model, attempt.rows, exclude=[attempt.instance])
        if again is not None:
            self.counters["requeued"] += 1
        return again

    def abandon(self, attempt: Attempt) -> None:
        """An attempt that will not answer (its instance refused it, or the caller stopped waiting)."""
        self._release(attempt)

    def finish(self, attempt: Attempt) -> bool:
        """An answer arrived for ``attempt``: True if it is the request's first (use it), False if another attempt
        answered first (discard it; counted)."""
        self._release(attempt)
        if attempt.request_id in self._done:
            self.counters["discarded"] += 1
            return False
        self._done[attempt.request_id] = None
        if len(self._done) > DONE_MEMORY:
            self._done.popitem(last=False)
        # the request's other attempts no longer count as load: their answers will be discarded
        for other in list(self.attempts.get(attempt.request_id, [])):
            self._release(other)
        return True

    # --- inter-agent balancing --------------------------------------------------------------------------------------
    def queue_lengths(self) -> dict[str, int]:
        """Per model, the requests waiting for an answer (this manager's in flight; a model with instances but none
        in flight is 0)."""
        return {m: sum(i.requests for i in insts.values()) for m, insts in self.instances.items()}


def plan_migrations(queues: Mapping[str, int], instances: Mapping[str, Iterable[str]], delta: int = DELTA,
                    loads: Mapping[str, Mapping[str, int]] | None = None) -> list[Migration]:
    """FlexMARL's inter-agent balancing decision: the disparity between the most and the least loaded model (by
    queue length); above ``delta``, move instances from the least to the most loaded — as many as the difference
    in queue lengths, keeping at least one instance on the donor. The donor gives its least-loaded instances
    (``loads``: model -> instance -> load; ties and no loads: by name). Ties between models go to the model named
    first. Returns no migration or one."""
    models = sorted(m for m in queues if m in instances)
    if len(models) < 2:
        return []
    over = max(models, key=lambda m: queues[m])  # most loaded; the first name on ties
    under = min(models, key=lambda m: queues[m])  # least loaded; the first name on ties
    disparity = queues[over] - queues[under]
    if over == under or disparity <= delta:
        return []
    donors = sorted(instances[under], key=lambda n: ((loads or {}).get(under, {}).get(n, 0), n))
    count = min(disparity, len(donors) - 1)  # the donor keeps at least one instance
    if count <= 0:
        return []
    return [Migration(under, over, tuple(donors[:count]))]

