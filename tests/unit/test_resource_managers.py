"""ARL-Tangram's resource managers (services/actions/resources.py): the basic manager's concurrency and quota, the
CPU manager's core sets and trajectory placement, the GPU service manager's buddy chunks and LRU service cache on a
configured inventory (no GPU needed)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.actions.resources import (
    BasicManager,
    CpuManager,
    CpuNode,
    GpuServiceManager,
    ServiceSpec,
    level_of,
)


# --- basic manager -----------------------------------------------------------------------------------------------------
def test_a_quota_per_period_is_never_exceeded_under_a_burst():
    api = BasicManager(quota=5, period_s=60.0)
    rng = random.Random(0)
    starts: list[float] = []
    waiting = list(range(40))  # a burst of 40 calls at t = 0; each retries when told it may go
    now = 0.0
    while waiting:
        wait = api.wait_s(now)
        if wait > 0:
            now += wait
            continue
        assert api.admit(now)
        api.release()
        starts.append(now)
        waiting.pop()
        now += rng.uniform(0, 3)
    for t in starts:  # in every window of one period, at most 5 calls started
        assert sum(t <= s < t + 60.0 for s in starts) <= 5
    assert len(starts) == 40 and starts[-1] >= 7 * 60.0  # 40 calls at 5 per minute need 7 full periods


def test_a_concurrency_limit_admits_again_only_after_a_release():
    m = BasicManager(concurrency=2)
    assert m.admit(0.0) and m.admit(0.0)
    assert not m.admit(0.0) and m.wait_s(0.0) == float("inf")
    m.release()
    assert m.admit(1.0)
    with pytest.raises(ValueError):
        BasicManager(quota=0)


# --- CPU manager -------------------------------------------------------------------------------------------------------
def two_numa_node(name: str = "n0", memory_mb: int = 1000) -> CpuNode:
    return CpuNode(name, numa=[[0, 1, 2, 3], [4, 5, 6, 7]], memory_mb=memory_mb)


def test_cores_come_from_one_numa_node_when_one_has_room():
    cpu = CpuManager([two_numa_node()])
    a = cpu.allocate("n0", 3)
    assert a == [0, 1, 2]
    b = cpu.allocate("n0", 2)  # NUMA 0 has 1 free, NUMA 1 has 4: the pair stays within NUMA 1
    assert b == [4, 5]
    c = cpu.allocate("n0", 1)  # the fullest NUMA node with room: core 3, leaving NUMA 1's pair whole
    assert c == [3]
    d = cpu.allocate("n0", 2)
    assert d == [6, 7]
    assert cpu.allocate("n0", 1) is None  # every core is held by one action
    cpu.release("n0", a)
    assert cpu.allocate("n0", 3) == [0, 1, 2]
    with pytest.raises(ValueError):
        cpu.release("n0", [a[0], 99])


def test_a_trajectory_stays_on_the_node_chosen_by_memory_balance():
    cpu = CpuManager([two_numa_node("a", 1000), two_numa_node("b", 1000)])
    assert cpu.place("t1", 2, 600) == "a"
    assert cpu.place("t2", 2, 300) == "b"  # a holds 60% of its memory, b nothing
    assert cpu.place("t3", 1, 300) == "b"  # a 60%, b 30%
    assert cpu.place("t1", 8, 0) == "a"  # its later actions: the same node
    assert cpu.place("t4", 1, 500) is None  # 400 MB left on each: no node can hold it
    cpu.end_trajectory("t1")
    assert cpu.place("t4", 1, 500) == "a"


# --- GPU service manager -----------------------------------------------------------------------------------------------
SERVICES = [ServiceSpec("judge@1", 1, 40.0), ServiceSpec("judge@2", 2, 40.0), ServiceSpec("teacher@4", 4, 60.0),
            ServiceSpec("small@1", 1, 30.0), ServiceSpec("other@1", 1, 30.0)]


def test_chunks_are_aligned_powers_of_two_split_and_merged_like_a_buddy_allocator():
    assert [level_of(m) for m in (1, 2, 3, 4, 5, 8)] == [0, 1, 2, 2, 3, 3]
    gpu = GpuServiceManager(1, 8, 80.0, SERVICES)
    one = gpu.allocate("judge@1")
    assert one.chunk == (0, 1) and gpu.free[0] == {(1, 2), (2, 4), (4, 8)}
    two = gpu.allocate("judge@2")
    assert two.chunk == (2, 4)
    four = gpu.allocate("teacher@4")
    assert four.chunk == (4, 8)
    assert gpu.allocate("teacher@4") is None  # no 4-GPU chunk left
    gpu.release(one)
    gpu.release(two)
    assert gpu.free[0] == {(0, 4)}  # (0, 1) + (1, 2) -> (0, 2), + (2, 4) -> (0, 4)
    gpu.release(four)
    assert gpu.free[0] == {(0, 8)}


def test_a_chunk_that_caches_the_service_is_preferred_and_reused_without_a_restore():
    gpu = GpuServiceManager(2, 8, 80.0, SERVICES)
    a = gpu.allocate("judge@1")
    b = gpu.allocate("small@1")
    c = gpu.allocate("other@1")
    d = gpu.allocate("judge@1")
    assert [g.chunk for g in (a, b, c, d)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert all(g.restored and g.node == 0 for g in (a, b, c, d))
    gpu.release(c)  # (3, 4) is held: (2, 3) stays a free 1-GPU chunk, caching other@1
    gpu.release(a)  # (1, 2) is held: (0, 1) stays free, caching judge@1
    assert gpu.free[0] == {(0, 1), (2, 3), (4, 8)}
    again = gpu.allocate("other@1")  # (0, 1) comes first in order, but (2, 3) caches other@1
    assert again.chunk == (2, 3) and not again.restored
    judge = gpu.allocate("judge@1")
    assert judge.chunk == (0, 1) and not judge.restored and gpu.hits == 2 and gpu.restores == 4


def test_the_least_recently_used_service_is_evicted_to_make_room():
    gpu = GpuServiceManager(1, 1, 80.0, [s for s in SERVICES if s.gpus == 1])
    for name in ("small@1", "other@1"):  # 30 + 30 GB cached on GPU 0
        gpu.release(gpu.allocate(name))
    gpu.release(gpu.allocate("small@1"))  # a hit: small@1 is now the most recent
    g = gpu.allocate("judge@1")  # needs 40 GB: 60 + 40 > 80, evict the LRU (other@1)
    assert g.restored and g.evicted == [("other@1", (0, 1))]
    assert [s for _, _, s in gpu.cached()] == ["small@1", "judge@1"]
    gpu.release(g)
    g = gpu.allocate("other@1")  # 30 + 40 + 30 > 80: small@1 is now the LRU
    assert g.evicted == [("small@1", (0, 1))]


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.sampled_from([s.name for s in SERVICES])), max_size=60))
def test_chunks_never_overlap_and_cached_memory_never_exceeds_a_gpu(ops):
    gpu = GpuServiceManager(2, 8, 80.0, SERVICES)
    held = []
    for alloc, name in ops:
        if alloc or not held:
            g = gpu.allocate(name)
            if g is not None:
                held.append(g)
        else:
            gpu.release(held.pop(0))
        for node in range(2):
            used = sorted([c for c in gpu.free[node]] + [g.chunk for g in held if g.node == node])
            for (_, e1), (s2, _) in zip(used, used[1:], strict=False):
                assert e1 <= s2, used  # no GPU in two chunks
            for s, e in used:
                assert (e - s) & (e - s - 1) == 0 and s % (e - s) == 0  # aligned powers of two
            assert sum(e - s for s, e in used) == 8  # nothing lost
            for g_ in range(8):
                assert gpu._used_gb(node, g_) <= 80.0 + 1e-9  # noqa: SLF001
