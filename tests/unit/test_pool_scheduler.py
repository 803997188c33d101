"""The training pool's slot scheduler on a fake clock: no slot idle while a model waits, first come first served,
a model back on the slot it last used when that one is free, and every model trained to its target."""

from __future__ import annotations

import random

import pytest

from services.trainer.pool import SlotScheduler, slot_cores


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_free_slot_is_granted_at_once_and_a_busy_pool_queues_in_arrival_order():
    clock = Clock()
    s = SlotScheduler(2, clock)
    assert s.want("a") == 0 and s.want("b") == 1
    assert s.want("c") is None and s.want("d") is None and s.want("c") is None  # asking twice queues once
    assert list(s.waiting) == ["c", "d"]
    clock.t = 3.0
    assert s.release("b") == [("c", 1)]  # the first waiting model takes the freed slot
    assert s.release("a") == [("d", 0)]
    assert s.waiting == type(s.waiting)() and [x.holder for x in s.slots] == ["d", "c"]
    assert s.busy_seconds() == [3.0, 3.0]


def test_a_model_with_more_work_keeps_its_slot_only_while_nobody_waits():
    clock = Clock()
    s = SlotScheduler(1, clock)
    assert s.want("hot") == 0
    assert s.release("hot", more=True) == [] and s.holding("hot") == 0 and s.kept == 1
    assert s.want("cold") is None
    # someone waits: the slot goes to it, and the hot model queues behind
    assert s.release("hot", more=True) == [("cold", 0)]
    assert list(s.waiting) == ["hot"]
    assert s.release("cold") == [("hot", 0)]


def test_a_model_gets_the_slot_it_last_used_when_that_one_is_free():
    clock = Clock()
    s = SlotScheduler(3, clock)
    assert [s.want(m) for m in ("a", "b", "c")] == [0, 1, 2]
    for m, t in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        clock.t = t
        s.release(m)
    assert s.want("c") == 2 and s.want("a") == 0 and s.want("b") == 1
    for m in ("a", "b", "c"):
        s.release(m)
    # a newcomer takes the slot released longest ago (slot 0, a's), not one a model returned to more recently
    clock.t = 10.0
    s.release("x")
    assert s.want("new") == 0
    assert s.want("b") == 1 and s.moved == 0


def test_without_waiting_models_no_preference_holds_a_slot_back():
    s = SlotScheduler(2, Clock())
    assert s.want("a") == 0
    s.release("a")
    assert s.want("b") == 1  # b takes the slot nobody's state is in
    assert s.want("c") == 0  # a's last slot is free and c is ready: c takes it (no slot idles for a)


def simulate(slots: int, arrivals: list[tuple[float, str]], cost: dict[str, float]) -> dict:
    """An event-driven run of the pool over micro-batch ``arrivals`` (time, model), each costing ``cost[model]``
    seconds on a slot; the invariants are checked at every event, first come first served against a queue kept
    here independently of the scheduler's."""
    clock = Clock()
    s = SlotScheduler(slots, clock)
    ready = {m: 0 for m in cost}
    trained = {m: 0 for m in cost}
    running: dict[int, tuple[str, float]] = {}
    fifo: list[str] = []  # who waits, in the order they started waiting
    served_from_queue = 0
    pending = sorted(arrivals)

    def start(model: str, slot: int) -> None:
        assert slot not in running
        ready[model] -= 1
        running[slot] = (model, clock.t + cost[model])

    def check() -> None:
        if s.waiting:
            assert all(x.holder is not None for x in s.slots), "a slot idles while a model waits"
        for x in s.slots:  # every holder trains, every running micro-batch has its slot
            assert (x.holder is None) == (x.index not in running)
        waiting_ready = {m for m in cost if ready[m] > 0 and s.holding(m) is None}
        assert waiting_ready == set(s.waiting), (waiting_ready, list(s.waiting))
        assert list(s.waiting) == fifo

    while pending or running:
        t_arr = pending[0][0] if pending else float("inf")
        t_end = min((end for _, end in running.values()), default=float("inf"))
        clock.t = min(t_arr, t_end)
        if t_end <= t_arr:
            slot = next(i for i, (_, end) in running.items() if end == t_end)
            model, _ = running.pop(slot)
            trained[model] += 1
            more = ready[model] > 0
            head = fifo[0] if fifo else None
            grants = s.release(model, more=more)
            if head is not None:
                assert grants and grants[0] == (head, slot), (grants, head)  # the longest waiting gets the slot
                fifo.pop(0)
                served_from_queue += 1
            if more and s.holding(model) is None:
                fifo.append(model)  # released because others waited: it queues again, at the back
            for m, g in grants:
                if m == model and m in fifo:
                    fifo.remove(m)
                start(m, g)
            if s.holding(model) == slot and slot not in running:
                start(model, slot)  # kept: more was ready and nobody waited
        else:
            _, model = pending.pop(0)
            ready[model] += 1
            if s.holding(model) is None and model not in s.waiting:
                g = s.want(model)
                if g is None:
                    fifo.append(model)
                else:
                    start(model, g)
        check()
    return {"trained": trained, "sched": s, "served_from_queue": served_from_queue, "end": clock.t}


@pytest.mark.parametrize("seed", range(8))
def test_a_bursty_trace_trains_every_micro_batch_with_no_idle_slot_and_in_arrival_order(seed):
    rng = random.Random(seed)
    models = ["hot", "b", "c", "d"]
    arrivals = []
    t = 0.0
    for _ in range(60):  # bursts: a few micro-batches close together, then a gap; the hot agent gets about 3/4
        t += rng.expovariate(1.0)
        for _ in range(rng.randint(1, 4)):
            arrivals.append((t + rng.random() * 0.1, "hot" if rng.random() < 0.76 else rng.choice(models[1:])))
    cost = {m: rng.uniform(0.2, 0.8) for m in models}
    out = simulate(2, arrivals, cost)
    totals = {m: sum(1 for _, x in arrivals if x == m) for m in models}
    assert out["trained"] == totals  # every model reaches its target (all its micro-batches trained)
    assert out["served_from_queue"] > 0  # the trace did make models wait
    busy = sum(out["sched"].busy_seconds())
    assert busy == pytest.approx(sum(cost[m] * totals[m] for m in models))


def test_grants_to_waiting_models_follow_their_queue_order():
    clock = Clock()
    s = SlotScheduler(1, clock)
    s.want("a")
    order = ["d", "b", "c"]
    for m in order:
        assert s.want(m) is None
    got = []
    holder = "a"
    for _ in order:
        (m, slot), = s.release(holder)
        got.append(m)
        holder = m
    assert got == order


def test_slot_cores_share_the_machine_and_wrap_when_asked_for_more():
    assert slot_cores(2, None, [0, 1]) == [[0], [1]]
    assert slot_cores(1, None, [0, 1, 2, 3]) == [[0, 1, 2, 3]]
    assert slot_cores(4, None, [0, 1]) == [[0], [1], [0], [1]]
    assert slot_cores(2, 2, [4, 5, 6, 7]) == [[4, 5], [6, 7]]


def test_the_host_memory_of_a_killed_pool_is_swept_and_a_live_ones_kept(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys
    import tempfile

    from services.trainer.pool import STORE_PREFIX, StateStore

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{STORE_PREFIX}{gone.pid}-abc123-x"
    live = tmp_path / f"{STORE_PREFIX}{os.getpid()}-def456-y"
    for d in (dead, live):
        d.mkdir()
        (d / "m.0.state").write_bytes(b"\0" * 64)
    # a store starting where /dev/shm is not writable sweeps the temp directory instead: here, tmp_path
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    store = StateStore(0, tmp_path / "spill", f"{os.getpid()}-t")
    assert not dead.exists() and live.exists() and store.memory_dir.parent == tmp_path
    store.close()
    assert not store.memory_dir.exists()


def test_a_gang_takes_its_slots_at_once_waits_first_come_first_served_and_gives_them_back_together():
    clock = Clock()
    s = SlotScheduler(3, clock, sizes={"g": 2})
    assert s.want("a") == 0 and s.want("b") == 1
    assert s.want("g") is None  # one slot free, the gang needs two
    assert s.want("c") is None and list(s.waiting) == ["g", "c"]  # c does not overtake the gang at the head
    assert s.slots[2].holder is None  # the price of no overtaking: a free slot waits for the gang
    clock.t = 2.0
    grants = s.release("a")
    assert grants == [("g", 2)] or grants == [("g", 0)], grants
    assert sorted(s.gang("g")) == [0, 2] and s.holding("g") == s.gang("g")[0]
    assert [x.holder for x in s.slots] == ["g", "b", "g"] and list(s.waiting) == ["c"]
    clock.t = 5.0
    assert s.release("g") == [("c", s.holding("c"))] and s.gang("g") == []
    assert sorted(x.holder or "" for x in s.slots) == ["", "b", "c"]
    assert s.busy_seconds()[0] == pytest.approx(5.0) and s.busy_seconds()[2] == pytest.approx(3.0)
    # a gang that leaves while at the head of the queue lets the others through
    assert s.want("g") is None and s.want("d") is None
    assert s.leave("g") == [("d", next(x.index for x in s.slots if x.holder == "d"))]
    with pytest.raises(ValueError, match="as many slots as its ranks"):
        SlotScheduler(1, clock, sizes={"g": 2})


@pytest.mark.parametrize("seed", range(5))
def test_a_bursty_trace_with_a_gang_trains_everything_and_never_gives_a_gang_fewer_slots(seed):
    rng = random.Random(seed)
    clock = Clock()
    s = SlotScheduler(3, clock, sizes={"g": 2})
    models = ["g", "a", "b", "c"]
    left = {m: 10 for m in models}
    running: dict[str, float] = {}
    while any(left.values()) or running:
        for m in models:
            if left[m] and m not in running and m not in s.waiting and s.holding(m) is None and rng.random() < 0.5:
                if s.want(m) is not None:
                    running[m] = clock.t + rng.uniform(0.5, 2.0)
        clock.t += 0.25
        for m, end in list(running.items()):
            if end <= clock.t:
                left[m] -= 1
                del running[m]
                for got, _ in s.release(m):
                    running[got] = clock.t + rng.uniform(0.5, 2.0)
        assert len(s.gang("g")) in (0, 2)
        for m in running:
            assert s.holding(m) is not None
    assert not s.waiting and all(x.holder is None for x in s.slots)
