"""FCFS core scheduler, the worker subprocess pool, check_answer / check_math rewards and run_code (no broker)."""

from __future__ import annotations

import asyncio
import json
import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.actions.actions import check_answer, check_math, leading_number, score_answer
from services.actions.pool import WorkerPool
from services.actions.sandbox_init import Unserialisable, decode, encode, parse_json, to_json
from services.actions.scheduler import FcfsScheduler
from services.actions.verdicts import plan_tests
from tests.waits import wait_until


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
def test_check_answer_gives_partial_credit_for_near_numbers_when_asked(response: str, finished: bool, reward: float,
                                                                       answer: str):
    out = check_answer({"expected": "7", "response": response, "finished": finished, "partial_credit": True})
    assert out["reward"] == pytest.approx(reward)
    assert (out["correct"], out["answer"], out["finished"]) == (reward == 1.0, answer, finished)
    plain = check_answer({"expected": "7", "response": response, "finished": finished})  # off by default
    assert plain["reward"] == (1.0 if reward == 1.0 else 0.0) and plain["answer"] == answer


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
    near = score_answer(str(expected), str(got), partial_credit=True)["reward"]
    nearer = score_answer(str(expected), str(got + (1 if got < expected else -1 if got > expected else 0)),
                          partial_credit=True)
    assert nearer["reward"] >= near


def test_check_answer_rejects_non_string_fields():
    with pytest.raises(ValueError, match="string 'expected'"):
        check_answer({"expected": 7, "response": "7"})


def test_the_ageing_bound_reaches_chorus_scheduling_and_only_it():
    from dataclasses import replace

    from services.actions.elastic import CHORUS, PAPER
    from shared.kernel.config import ActionsConfig

    assert WorkerPool(2, 256, policy="chorus", age_s=5.0).settings == replace(CHORUS, age_s=5.0)
    assert WorkerPool(2, 256, policy="chorus").settings == CHORUS
    assert WorkerPool(2, 256, policy="elastic", age_s=5.0).settings == PAPER  # the paper's order has no bound
    assert ActionsConfig(age_s=0.0).age_s == 0.0  # zero: every waiting action is aged, arrival order
    with pytest.raises(ValueError, match="age_s"):
        ActionsConfig(age_s=-1.0)


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


# --- run_code and check_math ----------------------------------------------------------------
ADD_TESTS = "assert add(1, 2) == 3\nassert add(0, 0) == 0\nbase = 10\nassert add(base, -1) == 9\n"
GOOD_ADD = "def add(a, b):\n    return a + b\n"


def _proc_gone(pid: int) -> bool:
    """Not running: no such process, or a zombie waiting for its reaper."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return True


async def test_run_code_scores_each_top_level_assert(pool: WorkerPool):
    good = await pool.run("run_code", {"code": GOOD_ADD + "print('hello')", "tests": ADD_TESTS}, 5)
    assert good.error is None and good.result == {
        "passed": True, "tests_passed": 3, "tests_total": 3, "reward": 1.0, "error": None, "stdout": "hello\n"}
    wrong = await pool.run("run_code", {"code": "def add(a, b):\n    return a * b\n", "tests": ADD_TESTS}, 5)
    assert wrong.result is not None
    assert (wrong.result["passed"], wrong.result["tests_passed"], wrong.result["tests_total"]) == (False, 1, 3)
    assert wrong.result["reward"] == pytest.approx(1 / 3)
    assert wrong.result["error"] == "AssertionError in `assert add(1, 2) == 3`"
    broken = await pool.run("run_code", {"code": "def add(a, b:\n", "tests": ADD_TESTS}, 5)
    assert broken.result is not None and broken.result["reward"] == 0.0
    assert broken.result["error"].startswith("SyntaxError")


@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("while True:\n    pass\n", "timeout after 1.5s"),
        ("x = bytearray(10**10)\n", "MemoryError"),
        ("x = []\nwhile True:\n    x.append(' ' * 10**6)\n", "MemoryError"),
        ("import sys\nsys.exit(0)\n", "SystemExit: 0"),
        ("raise KeyboardInterrupt\n", "KeyboardInterrupt"),
        ("import os\nos._exit(0)\n", "the code's process exited with status 0"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "the code's process was killed by SIGKILL"),
        # Forged reports earn nothing: the code holds no pipe to the outside, and what it writes to the tests'
        # process can only be the answers to their requests, which are checked for their shape there.
        ("import os\nfor fd in range(3, 8):\n    try:\n        os.write(fd, b'{\"event\": \"test\", \"ok\": true}\\n')\n"
         "    except OSError:\n        pass\nos._exit(0)\n", "the code's process sent a malformed message"),
    ],
)
async def test_runaway_code_is_an_error_result_and_the_worker_lives_on(pool: WorkerPool, code: str, error: str):
    pids = pool.pids()
    # The loop is stopped by its own 1.5 s limit; every other case has 60 s to meet its end (filling the memory
    # limit takes seconds where first-touch page faults are slow, on a loaded machine), so a timeout there fails.
    limit = 1.5 if error.startswith("timeout") else 60.0
    out = await pool.run("run_code", {"code": code, "tests": ADD_TESTS, "timeout_s": limit}, limit + 30)
    assert out.error is None and out.result is not None
    assert out.result["passed"] is False and out.result["tests_passed"] == 0 and out.result["reward"] == 0.0
    assert out.result["error"].startswith(error)
    assert pool.pids() == pids and pool.counters["restarts"] == 0  # only the code's own process died
    again = await pool.run("run_code", {"code": GOOD_ADD, "tests": ADD_TESTS}, 5)
    assert again.result is not None and again.result["passed"] is True


async def test_a_loop_in_one_test_keeps_the_credit_of_the_tests_before_it(pool: WorkerPool):
    code = "def add(a, b):\n    while a == 0:\n        pass\n    return a + b\n"
    out = await pool.run("run_code", {"code": code, "tests": ADD_TESTS, "timeout_s": 0.3}, 5)
    assert out.result is not None and out.result["tests_passed"] == 1 and out.result["error"] == "timeout after 0.3s"


async def test_code_deadline_stays_inside_the_pool_timeout_so_the_worker_is_not_replaced(pool: WorkerPool):
    # a pool timeout of 5 s: the code's own deadline is a second inside it (4 s), room for the kill and the answer
    out = await pool.run("run_code", {"code": "while True:\n    pass\n", "tests": ADD_TESTS, "timeout_s": 60}, 5.0)
    assert out.error is None and out.result is not None and out.result["error"] == "timeout after 4s"
    assert pool.counters["timeouts"] == 0 and pool.counters["restarts"] == 0


def _running_with_arg(arg: bytes) -> list[int]:
    """Host processes (not zombies) whose command line has ``arg``."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if arg in f.read().split(b"\0") and not _proc_gone(int(name)):
                    pids.append(int(name))
        except (FileNotFoundError, ProcessLookupError, ValueError, NotADirectoryError):
            continue
    return pids


async def test_processes_started_by_the_code_are_killed_with_it(pool: WorkerPool):
    # The pid the code sees is its namespace's own, so the host looks for the program by its arguments.
    code = "import subprocess\np = subprocess.Popen(['sleep', '61.2345'])\nprint(p.pid)\n" + GOOD_ADD
    out = await pool.run("run_code", {"code": code, "tests": ADD_TESTS}, 5)
    assert out.result is not None and out.result["passed"] is True and int(out.result["stdout"]) > 0
    # unisolated, the kill is not waited for
    await wait_until(lambda: not _running_with_arg(b"61.2345"), "the killed code gone", interval_s=0.02)
    assert _running_with_arg(b"61.2345") == []


async def test_flooding_output_is_truncated(pool: WorkerPool):
    out = await pool.run("run_code", {"code": "print('x' * 100_000)\n" + GOOD_ADD, "tests": ADD_TESTS}, 5)
    assert out.result is not None and out.result["passed"] is True
    assert out.result["stdout"].endswith("[output truncated]") and len(out.result["stdout"]) < 5000


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ({"code": 1, "tests": ADD_TESTS}, "run_code needs string 'code' and 'tests', got int and str"),
        ({"code": GOOD_ADD, "tests": "x = 1"}, "have no top-level assert"),
        ({"code": GOOD_ADD, "tests": "assert ("}, "'tests' do not parse"),
        ({"code": GOOD_ADD, "tests": ADD_TESTS, "timeout_s": -1}, "'timeout_s' must be a positive number"),
    ],
)
async def test_bad_run_code_payloads_are_errors(pool: WorkerPool, payload: dict, error: str):
    out = await pool.run("run_code", payload, 5)
    assert out.result is None and out.error is not None and error in out.error


@pytest.mark.parametrize(
    ("response", "expected", "correct", "answer"),
    [
        ("3 + 4 = 7, so the answer is 7.", "7", True, "7"),
        ("We get \\boxed{\\frac{1}{2}}", "0.5", True, "1/2"),
        ("It is 1,000 in total", "1000", True, "1,000"),
        ("So 8", "7", False, "8"),
        ("So 27", "7", False, "27"),
        ("It is 1/2", "7", False, "1/2"),
        ("no idea", "7", False, ""),
    ],
)
def test_check_math_uses_the_final_answer(response: str, expected: str, correct: bool, answer: str):
    out = check_math({"expected": expected, "response": response})
    assert out == {"reward": 1.0 if correct else 0.0, "correct": correct, "answer": answer, "judged": "number"}
    # Asked for by name, a near miss (8 for 7) earns check_answer's partial credit 0.5 * (1 - 1/10); 20 away none.
    shaped = check_math({"expected": expected, "response": response, "partial_credit": True})
    assert shaped["reward"] == pytest.approx(1.0 if correct else 0.45 if answer == "8" else 0.0)


# math-verify's own kinds of answer (its README and tests): fractions, radicals, sets, intervals, \boxed{}, units,
# expressions; each judged by value against a differently written reference.
@pytest.mark.parametrize(
    ("expected", "response", "correct"),
    [
        ("\\frac{1}{2}", "The answer is $\\boxed{0.5}$", True),
        ("0.5", "so we get $\\boxed{\\frac{1}{2}}$", True),
        ("\\frac{\\sqrt{3}}{2}", "$\\boxed{\\frac{\\sqrt3}{2}}$", True),
        ("2\\sqrt{2}", "Hence $\\boxed{\\sqrt{8}}$.", True),
        ("\\{1,3\\} \\cup \\{2,4\\}", "$\\boxed{\\{1,2,3,4\\}}$", True),
        ("(0,1]", "the interval $\\boxed{(0,1]}$", True),
        ("(0,1]", "the interval $\\boxed{[0,1]}$", False),
        ("x^2+2x+1", "$\\boxed{(x+1)^2}$", True),
        ("\\pi/2", "$\\boxed{\\frac{\\pi}{2}}$", True),
        ("\\frac{1}{3}", "$\\boxed{0.33}$", False),
        ("\\frac{2}{3}", "$\\boxed{\\frac{3}{2}}$", False),
    ],
)
def test_check_math_judges_latex_answers_by_value_with_math_verify(expected: str, response: str, correct: bool):
    out = check_math({"expected": expected, "response": response, "partial_credit": True})
    assert out["correct"] is correct and out["reward"] == (1.0 if correct else 0.0), out
    assert out["judged"] in ("number", "math-verify")


def test_whole_numbers_are_judged_exactly_without_math_verify():
    # 7.0000001 is not 7, whatever a tolerance would say; math-verify is not asked (judged: number)
    assert check_math({"expected": "7", "response": "$\\boxed{7.0000001}$"}) == {
        "reward": 0.0, "correct": False, "answer": "7.0000001", "judged": "number"}
    assert check_math({"expected": "7", "response": "$\\boxed{\\frac{14}{2}}$"})["correct"] is True


async def test_check_math_runs_in_the_pool_and_rejects_bad_fields(pool: WorkerPool):
    ok = await pool.run("check_math", {"expected": "72", "response": "#### 72"}, 5)
    assert ok.result == {"reward": 1.0, "correct": True, "answer": "72", "judged": "number"}
    latex = await pool.run("check_math", {"expected": "\\frac{1}{2}", "response": "$\\boxed{0.5}$"}, 30)
    assert latex.result is not None and latex.result["correct"] is True, latex
    bad = await pool.run("check_math", {"expected": 72, "response": "72"}, 5)
    assert bad.error is not None and "check_math needs string 'expected'" in bad.error


async def test_output_without_a_newline_is_not_lost(pool: WorkerPool):
    code = "print('partial', end='')\n" + GOOD_ADD
    out = await pool.run("run_code", {"code": code, "tests": ADD_TESTS}, 5)
    assert out.result is not None and out.result["stdout"] == "partial"
    err = await pool.run("run_code", {"code": "print('before', end='')\nraise ValueError('bad')", "tests": ADD_TESTS}, 5)
    assert err.result is not None and err.result["stdout"] == "before" and err.result["error"] == "ValueError: bad"


# --- verdicts outside the sandbox: probes and their values --------------------------------------------------
@pytest.mark.parametrize(
    ("tests", "bind"),
    [
        ("assert add(2, 3) == 5", {"add": "add"}),
        ("import math\nassert math.isclose(f(1.0), 2.0, rel_tol=1e-6) and len(g()) == 3", {"f": "f", "g": "g",
                                                                                         "len": "len"}),
        ("cases = [(1, 2)]\nassert all(f(x) == y for x, y in cases)", {"f": "f", "all": "all"}),
        # a builtin the tests rebind is theirs; one they only read is the code's if the code defines it
        ("def sorted(x):\n    return x\nassert sorted(f()) == [1]", {"f": "f"}),
        ("assert 1 + 1 == 2", {}),
    ],
)
def test_the_tests_read_the_names_they_do_not_bind_from_the_code(tests: str, bind: dict[str, str]):
    plan = plan_tests(tests)
    assert plan.bind == bind
    assert plan.tests == 1 and [kind for kind, _ in plan.steps][-1] == "test"


def test_every_top_level_statement_is_one_step_and_each_assert_one_test():
    plan = plan_tests("x = 4\nassert add(2, 3) == 918273645\nfor i in range(2):\n    assert i < 5\n"
                      "assert add(x, 1) not in (7777777, -31337)\n")
    assert [kind for kind, _ in plan.steps] == ["setup", "test", "setup", "test"]
    assert plan.tests == 2 and plan.bind == {"add": "add", "range": "range"}


builtin_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=3) | st.integers(), inner, max_size=3)
    | st.sets(st.integers(), max_size=4) | st.frozensets(st.text(max_size=3), max_size=3),
    max_leaves=12,
)


def _types(value: object) -> object:
    """The value's exact types, all the way down."""
    if isinstance(value, list | tuple):
        return type(value), [_types(v) for v in value]
    if isinstance(value, dict):
        return dict, sorted((repr(k), _types(k), _types(v)) for k, v in value.items())
    if isinstance(value, set | frozenset):
        return type(value), sorted(type(v).__name__ for v in value)
    return type(value)


@given(builtin_values)
def test_values_cross_between_the_two_processes_with_their_exact_builtin_types(value: object):
    back = decode(json.loads(json.dumps(encode(value))))
    assert back == value and _types(back) == _types(value)
    again = decode(parse_json(to_json(encode(value)).encode()))  # the sandbox's own writer and reader
    assert again == value and _types(again) == _types(value)
    nan = decode(parse_json(to_json(encode([float("nan"), float("-inf")])).encode()))
    assert math.isnan(nan[0]) and nan[1] == float("-inf")


@pytest.mark.parametrize("line", [b"", b"[1,", b"NaN", b"[Infinity]", b"1 2", b"\xff", b"[" * 100_000])
def test_the_sandbox_reader_refuses_what_is_not_one_json_value(line: bytes):
    with pytest.raises(ValueError, match="malformed message"):
        parse_json(line)


class _Exports:
    """A stand-in for a channel: hands out a handle per object."""

    def __init__(self) -> None:
        self.objects: list[object] = []

    def export(self, value: object) -> int:
        self.objects.append(value)
        return len(self.objects)


def test_with_a_channel_what_is_not_data_crosses_as_a_handle_and_comes_back_as_itself():
    channel, thing = _Exports(), _EqualToAll()
    data = encode([1, thing, {"k": (thing,)}], 0, channel)  # type: ignore[arg-type]
    assert data == [1, {"h": 1}, {"d": [["k", {"t": [{"h": 2}]}]]}]
    seen = decode(data, 0, lambda tag, n: (tag, n))
    assert seen == [1, ("h", 1), {"k": (("h", 2),)}]
    with pytest.raises(ValueError):
        decode({"h": 1})  # without a channel a handle is not a value


class _EqualToAll:
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__


class _SneakyInt(int):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = int.__hash__


@pytest.mark.parametrize("value", [_EqualToAll(), _SneakyInt(3), [1, _SneakyInt(2)], {"k": object()}, range(3)])
def test_only_exact_builtin_types_are_reported(value: object):
    with pytest.raises(Unserialisable, match="unserialisable value of type"):
        encode(value)


@pytest.mark.parametrize("data", [1.5, {"x": 1}, {"f": 1}, {"t": "ab"}, {"d": [[[1], 2]]}, {"f": "1", "b": ""}])
def test_malformed_reports_are_not_values(data: object):
    with pytest.raises((ValueError, TypeError)):
        decode(data)


async def test_each_action_runs_on_exactly_the_cores_it_holds(pool: WorkerPool):
    allowed = sorted(os.sched_getaffinity(0))
    # two CPU-bound actions at once on a budget of 2: each holds one core, and its process may use only that one
    a, b = await asyncio.gather(pool.run("cpu_affinity", {"spin_s": 0.3}, timeout_s=10),
                                pool.run("cpu_affinity", {"spin_s": 0.3}, timeout_s=10))
    assert a.error is None and b.error is None, (a, b)
    assert len(a.result["cpus"]) == 1 and len(b.result["cpus"]) == 1
    assert set(a.result["cpus"]) | set(b.result["cpus"]) <= set(allowed)
    if len(allowed) >= 2:  # one core per action, never the same one twice at once
        assert a.result["cpus"] != b.result["cpus"]
    assert pool.cpu.nodes["local"].busy == set()  # both given back


def test_the_local_inventory_follows_numa_nodes_and_the_allowed_cpus(tmp_path):
    from services.actions.resources import _cpulist, local_node

    assert _cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    allowed = sorted(os.sched_getaffinity(0))
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "cpulist").write_text(f"{allowed[0]}\n")
    (tmp_path / "node1").mkdir()
    (tmp_path / "node1" / "cpulist").write_text(",".join(str(c) for c in allowed[1:]) + ",4096\n")
    node = local_node(len(allowed), sysfs=tmp_path)
    assert node.numa == [g for g in ([allowed[0]], allowed[1:]) if g]  # 4096 is not ours: left out
    wide = local_node(len(allowed) + 2, sysfs=tmp_path)  # a budget above the machine wraps around its CPUs
    assert len(wide.cores) == len(allowed) + 2
    assert wide.cpus(wide.cores) == allowed


async def test_the_elastic_pool_gives_an_elastic_test_suite_its_parallelism():
    pool = WorkerPool(2, memory_mb=256, policy="elastic")
    await pool.start()
    try:
        alone = await pool.run("cpu_tests", {"cases": 4, "case_s": 0.05, "t_ori": 0.2}, timeout_s=20)
        assert alone.error is None, alone
        # alone on a budget of 2: it gets both cores and really runs its cases in 2 processes
        assert alone.result["parallelism"] == 2 and alone.result["processes"] == 2 and alone.result["passed"] == 4
        probe = await pool.run("cpu_affinity", {}, timeout_s=10)  # a plain kind: one core
        assert len(probe.result["cpus"]) == 1
        assert pool.profile.t_ori("cpu_tests") is not None  # its run fed the kind's duration profile
    finally:
        await pool.close()


async def test_a_slow_action_does_not_delay_a_fast_one_submitted_with_it():
    pool = WorkerPool(2, memory_mb=256, policy="elastic")
    await pool.start()
    try:
        done: list[str] = []

        async def one(name: str, spin: float) -> None:
            out = await pool.run("cpu_affinity", {"spin_s": spin}, timeout_s=60)
            assert out.error is None, out
            done.append(name)

        await asyncio.gather(one("slow", 2.0), one("fast", 0.05))
        assert done == ["fast", "slow"], done  # answered as soon as it ended, not with the slow one
    finally:
        await pool.close()


async def test_a_malleable_suite_takes_idle_cores_and_gives_one_back_to_a_tool_call_at_a_case_boundary():
    pool = WorkerPool(2, memory_mb=256, policy="chorus", malleable=True)
    await pool.start()
    try:
        alone = await pool.run("cpu_tests", {"cases": 4, "case_s": 0.05, "t_ori": 0.2}, timeout_s=20)
        assert alone.error is None, alone
        assert alone.result == {**alone.result, "cases": 4, "passed": 4, "parallelism": 2, "malleable": True}
        assert pool.cpu.nodes["local"].free_cores() == 2  # every core back

        order: list[str] = []

        async def suite() -> None:
            out = await pool.run("cpu_tests", {"cases": 8, "case_s": 0.3, "t_ori": 2.4}, timeout_s=30)
            assert out.error is None and out.result["passed"] == 8 and out.result["parallelism"] == 2, out
            order.append("suite")

        async def tool() -> None:
            while len(pool.cpu.nodes["local"].busy) < 2:  # the suite holds both cores
                await asyncio.sleep(0.01)
            out = await pool.run("cpu_affinity", {"spin_s": 0.05}, timeout_s=10)
            assert out.error is None, out
            order.append("tool")

        await asyncio.gather(suite(), tool())
        # 8 cases of 0.3 s on two cores: the tool call got a core at the next case boundary, not at the suite's end
        assert order == ["tool", "suite"]
        assert pool.cpu.nodes["local"].free_cores() == 2
    finally:
        await pool.close()


async def test_a_malleable_suite_out_of_time_fails_and_gives_every_core_back():
    pool = WorkerPool(2, memory_mb=256, policy="chorus", malleable=True)
    await pool.start()
    try:
        out = await pool.run("cpu_tests", {"cases": 10, "case_s": 0.4, "t_ori": 4.0}, timeout_s=0.9)
        assert out.result is None and out.error is not None and "time" in out.error, out
        assert pool.cpu.nodes["local"].free_cores() == 2
        again = await pool.run("cpu_tests", {"cases": 2, "case_s": 0.01}, timeout_s=20)  # the pool serves on
        assert again.error is None and again.result["passed"] == 2, again
        bad = await pool.run("cpu_tests", {"cases": 0}, timeout_s=5)  # refused by the kind itself, run whole
        assert bad.error is not None and "cases must be" in bad.error, bad
    finally:
        await pool.close()


async def test_a_worker_imports_its_preloads_before_it_is_ready_and_a_missing_one_does_not_stop_it(tmp_path, monkeypatch):
    mark = tmp_path / "mark"
    monkeypatch.setenv("CHORUS_TEST_PRELOAD_MARK", str(mark))
    pool = WorkerPool(1, 512, preload=("tests.unit.preload_marker", "no_such_module_here"))
    await pool.start()
    try:
        assert mark.read_text() == str(pool.pids()[0])  # imported by the worker itself, before its ready frame
        out = await pool.run("echo", {"v": 1}, 30)
        assert out.error is None and out.result == {"v": 1}
    finally:
        await pool.close()
