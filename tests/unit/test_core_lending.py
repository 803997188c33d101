"""The core lender (services/trainer/lending.py): the training pool's free cores lent to elastic rollout instances,
reclaimed when a slot takes them; fake borrowers, a fake clock and a fake pool."""

from __future__ import annotations

import threading

import pytest

from services.trainer.lending import CoreLender


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeWorker:
    """An elastic instance on one core: records what it was told, and whether it may run."""

    def __init__(self, fail: bool = False) -> None:
        self.events: list[tuple[str, int]] = []
        self.running = False
        self.fail = fail

    def lend(self, core: int) -> None:
        self.events.append(("lend", core))
        self.running = True

    def reclaim(self, core: int) -> None:
        self.events.append(("reclaim", core))
        self.running = False
        if self.fail:
            raise RuntimeError("the worker is gone")


def test_free_cores_are_lent_and_taken_back_when_a_slot_needs_them() -> None:
    clock = FakeClock()
    w0, w1 = FakeWorker(), FakeWorker()
    lender = CoreLender({0: w0, 1: w1}, clock=clock)
    lender([0, 1])  # no model holds a slot: both cores roll out
    assert (w0.running, w1.running) == (True, True)
    clock.t = 2.0
    lender([1])  # a model took the slot on core 0
    assert (w0.running, w1.running) == (False, True)
    assert w0.events == [("lend", 0), ("reclaim", 0)]
    clock.t = 3.0
    lender([1])  # nothing changed (a slot went from one model to another): nobody is told anything
    assert w0.events == [("lend", 0), ("reclaim", 0)] and w1.events == [("lend", 1)]
    clock.t = 5.0
    lender([0, 1])
    assert lender.lent() == [0, 1]
    assert lender.lent_seconds() == {0: 2.0 + 0.0, 1: 5.0}
    clock.t = 6.0
    assert lender.lent_seconds() == {0: 3.0, 1: 6.0}
    snap = lender.snapshot()
    assert snap["cores"][0] == {"core": 0, "lent": True, "lent_s": 3.0, "loans": 2, "reclaims": 1}
    assert snap["lent_share"] == pytest.approx(9.0 / 12.0)


def test_a_core_without_a_borrower_is_never_lent() -> None:
    w0 = FakeWorker()
    lender = CoreLender({0: w0}, clock=FakeClock())
    lender([0, 1, 7])
    assert lender.lent() == [0] and w0.events == [("lend", 0)]


def test_close_takes_every_core_back_and_ignores_later_notices() -> None:
    w0, w1 = FakeWorker(), FakeWorker()
    lender = CoreLender({0: w0, 1: w1}, clock=FakeClock())
    lender([0, 1])
    lender.close()
    assert not w0.running and not w1.running and lender.lent() == []
    lender([0, 1])
    assert not w0.running and not w1.running


def test_a_stale_notice_is_ignored_when_the_lender_reads_the_pool_itself() -> None:
    """The pool calls its listeners outside its lock: a notice computed before a grant can arrive after the grant's
    own. With ``current`` the lender trusts the pool's state at the time it runs, not the list it was handed."""
    state = {"free": [0, 1]}
    w0, w1 = FakeWorker(), FakeWorker()
    lender = CoreLender({0: w0, 1: w1}, current=lambda: state["free"], clock=FakeClock())
    lender([0, 1])
    stale = list(state["free"])  # another trainer's notice, computed before the grant below
    state["free"] = [1]  # a model is granted the slot on core 0
    lender([1])
    lender(stale)  # arrives last: core 0 must stay with the slot
    assert not w0.running and w1.running


def test_one_failing_borrower_does_not_keep_the_others_from_being_told() -> None:
    bad, good = FakeWorker(fail=True), FakeWorker()
    lender = CoreLender({0: bad, 1: good}, clock=FakeClock())
    lender([0, 1])
    with pytest.raises(RuntimeError, match="gone"):
        lender([])
    assert not good.running and lender.lent() == []


def test_concurrent_notices_end_in_the_pool_state() -> None:
    """Many trainers' threads notifying at once, each with the state it saw: the lender ends in the pool's final
    state, and each borrower alternates lend / reclaim (never two loans in a row)."""
    lock = threading.Lock()
    state = {"free": [0, 1]}
    workers = {0: FakeWorker(), 1: FakeWorker()}
    lender = CoreLender(workers, current=lambda: list(state["free"]))

    def trainer(core: int) -> None:
        for k in range(200):
            with lock:
                if k % 2 == 0:
                    state["free"] = [c for c in state["free"] if c != core]
                else:
                    state["free"] = sorted({*state["free"], core})
                seen = list(state["free"])
            lender(seen)

    threads = [threading.Thread(target=trainer, args=(c,)) for c in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert lender.lent() == sorted(state["free"])
    for w in workers.values():
        kinds = [k for k, _ in w.events]
        assert all(a != b for a, b in zip(kinds, kinds[1:], strict=False))
