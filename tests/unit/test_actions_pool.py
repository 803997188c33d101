"""FCFS core scheduler, the worker subprocess pool and the check_answer reward (no broker)."""

from __future__ import annotations

import asyncio
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.actions.actions import check_answer, leading_number, score_answer
from services.actions.pool import WorkerPool
from services.actions.scheduler import FcfsScheduler


async def test_scheduler_grants_in_arrival_order_without_backfilling():
    sched = FcfsScheduler(2)
    order: list[str] = []
    release = asyncio.Event()

    async def job(name: str, cores: int) -> None:
        async with sched.slot(cores):
            order.append(name)
            await release.wait()

    first = asyncio.create_task(job("a", 1))
    await asyncio.sleep(0)
    big = asyncio.create_task(job("big", 2))  # must wait for "a"
    await asyncio.sleep(0)
    small = asyncio.create_task(job("small", 1))  # fits now, but arrived after "big"
    await asyncio.sleep(0.01)
    assert order == ["a"] and sched.waiting == 2
    release.set()
    await asyncio.gather(first, big, small)
    assert order == ["a", "big", "small"]
    assert sched.free == 2 and sched.waiting == 0


async def test_cancelled_waiter_leaves_the_queue_and_frees_the_head():
    sched = FcfsScheduler(1)
    await sched.acquire(1)
    waiter = asyncio.create_task(sched.acquire(1))
    nxt = asyncio.create_task(sched.acquire(1))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    sched.release(1)
    assert await asyncio.wait_for(nxt, 1) == 1
    assert sched.free == 0 and sched.waiting == 0


async def test_request_larger_than_budget_is_clamped_not_deadlocked():
    sched = FcfsScheduler(2)
    async with sched.slot(8) as granted:
        assert granted == 2 and sched.free == 0
    assert sched.free == 2


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=3), min_size=1, max_size=12), st.integers(1, 3))
def test_scheduler_never_overcommits_and_serves_everyone_in_order(needs: list[int], cores: int):
    async def scenario() -> list[int]:
        sched = FcfsScheduler(cores)
        started: list[int] = []

        async def job(i: int, n: int) -> None:
            async with sched.slot(n):
                assert sched.busy <= cores
                started.append(i)
                await asyncio.sleep(0)

        tasks = []
        for i, n in enumerate(needs):
            tasks.append(asyncio.create_task(job(i, n)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert sched.free == cores
        return started

    assert asyncio.run(scenario()) == list(range(len(needs)))


@pytest.mark.parametrize(
    ("response", "finished", "reward", "answer"),
    [
        ("7", True, 1.0, "7"),
        (" 7 ", True, 1.0, "7"),
        ("7", False, 1.0, "7"),
        ("7x", True, 1.0, "7"),
        ("3", True, 0.3, "3"),
        ("8", True, 0.45, "8"),
        ("-2", True, 0.05, "-2"),
        ("70", True, 0.0, "70"),
        ("x7", True, 0.0, ""),
        ("-", True, 0.0, ""),
        ("", True, 0.0, ""),
    ],
)
def test_check_answer_gives_partial_credit_for_near_numbers(response: str, finished: bool, reward: float,
                                                             answer: str):
    out = check_answer({"expected": "7", "response": response, "finished": finished})
    assert out["reward"] == pytest.approx(reward)
    assert (out["correct"], out["answer"], out["finished"]) == (reward == 1.0, answer, finished)


def test_non_integer_answers_are_scored_by_exact_text():
    assert score_answer("yes", " yes")["reward"] == 1.0
    assert score_answer("yes", "yes!")["reward"] == 0.0


@given(st.text(max_size=8), st.text(max_size=8), st.booleans())
def test_score_is_bounded_and_correct_only_at_one(expected: str, response: str, finished: bool):
    out = score_answer(expected, response, finished)
    assert 0.0 <= out["reward"] <= 1.0
    assert out["correct"] == (out["reward"] == 1.0)
    assert response.strip().startswith(out["answer"])
    assert out["answer"] == leading_number(response.strip())


@given(st.integers(-50, 50), st.integers(-50, 50))
def test_closer_numbers_never_score_lower(expected: int, got: int):
    near = score_answer(str(expected), str(got))["reward"]
    nearer = score_answer(str(expected), str(got + (1 if got < expected else -1 if got > expected else 0)))
    assert nearer["reward"] >= near


def test_check_answer_rejects_non_string_fields():
    with pytest.raises(ValueError, match="string 'expected'"):
        check_answer({"expected": 7, "response": "7"})


@pytest.fixture
async def pool():
    p = WorkerPool(2, memory_mb=256)
    await p.start()
    yield p
    await p.close()


async def test_pool_runs_actions_in_subprocesses(pool: WorkerPool):
    out = await pool.run("echo", {"x": 1}, timeout_s=5)
    assert out.error is None and out.result == {"x": 1}
    checked = await pool.run("check_answer", {"expected": "4", "response": "4", "finished": True}, 5)
    assert checked.result == {"reward": 1.0, "correct": True, "answer": "4", "finished": True}
    assert os.getpid() not in pool.pids()


async def test_sleeping_action_times_out_and_the_pool_recovers(pool: WorkerPool):
    before = set(pool.pids())
    slow, fast = await asyncio.gather(
        pool.run("echo", {"sleep_s": 30}, timeout_s=0.3),
        pool.run("echo", {"n": 2}, timeout_s=5),
    )
    assert slow.error == "timeout after 0.3s" and slow.result is None
    assert fast.result == {"n": 2}
    assert pool.counters["timeouts"] == 1 and pool.counters["restarts"] == 1
    assert set(pool.pids()) != before and None not in pool.pids()
    again = await asyncio.gather(*(pool.run("echo", {"i": i}, 5) for i in range(4)))
    assert [o.result for o in again] == [{"i": i} for i in range(4)]


async def test_crashing_and_raising_actions_give_errors_not_a_dead_pool(pool: WorkerPool):
    raised = await pool.run("echo", {"raise": "boom"}, 5)
    assert raised.error == "RuntimeError: boom"
    died = await pool.run("echo", {"exit_code": 3}, 5)
    assert died.error is not None and "exited with code 3" in died.error
    unknown = await pool.run("nope", {}, 5)
    assert unknown.error is not None and "unknown action kind 'nope'" in unknown.error
    ok = await pool.run("echo", {"fine": True}, 5)
    assert ok.result == {"fine": True}
    assert pool.counters["crashes"] == 1 and pool.counters["errors"] == 2


async def test_worker_memory_limit_turns_a_huge_allocation_into_an_error(pool: WorkerPool):
    out = await pool.run("echo", {"alloc_mb": 1024}, 5)
    assert out.error is not None and "MemoryError" in out.error
    assert (await pool.run("echo", {"alloc_mb": 8}, 5)).result == {"allocated": 8 * 1024 * 1024}


async def test_pool_serves_actions_first_come_first_served():
    p = WorkerPool(1, memory_mb=256)
    await p.start()
    try:
        done: list[int] = []

        async def one(i: int) -> None:
            await p.run("echo", {"sleep_s": 0.02, "i": i}, 5)
            done.append(i)

        tasks = []
        for i in range(5):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert done == [0, 1, 2, 3, 4]
    finally:
        await p.close()
