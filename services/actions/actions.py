"""Registered action kinds: plain functions of a payload dict, run inside a worker subprocess."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from services.actions import rewardfn
from services.actions.coderun import run_code as run_code_in_child
from shared.rlmath import gsm8k, mathverify, rgym
from shared.rlmath.mathanswer import extract_answer, math_equal

Action = Callable[[dict[str, Any]], dict[str, Any]]
# The pool's timeout for the action being run, set by the worker: actions with their own deadline stay
# inside it so that they answer before the pool gives up on the worker.
time_budget_s: ContextVar[float | None] = ContextVar("time_budget_s", default=None)
DEFAULT_CODE_TIMEOUT_S = 5.0

REGISTRY: dict[str, Action] = {}


def register(kind: str) -> Callable[[Action], Action]:
    """Register ``fn`` as the action ``kind``."""

    def wrap(fn: Action) -> Action:
        REGISTRY[kind] = fn
        return fn

    return wrap


_LEADING_INT = re.compile(r"^-?\d+")
NEAR_MISS_SCALE = 10.0  # a wrong number earns 0.5 * (1 - distance / NEAR_MISS_SCALE), floored at 0


def leading_number(text: str) -> str:
    """The signed integer at the start of ``text`` (``"-12ab"`` -> ``"-12"``), or ``""``."""
    match = _LEADING_INT.match(text)
    return match.group(0) if match else ""


def near_miss(answer: str, expected: str) -> float:
    """Partial credit of a wrong integer answer, ``0.5 * max(0, 1 - |got - expected| / 10)``; 0 unless both
    are integers."""
    if _LEADING_INT.fullmatch(answer) is None or _LEADING_INT.fullmatch(expected) is None:
        return 0.0
    distance = abs(int(answer) - int(expected))
    return 0.5 * max(0.0, 1.0 - distance / NEAR_MISS_SCALE) if distance else 0.0


def score_answer(expected: str, response: str, finished: bool = True, partial_credit: bool = False) -> dict[str, Any]:
    """Reward of one answer on a 0-1 scale, from the integer the response starts with.

    1.0 when that integer equals the expected one, else 0; with ``partial_credit`` (shaping a config asks for by
    name, ``reward.partial_credit``) a wrong integer earns ``0.5 * max(0, 1 - |got - expected| / 10)``. A
    non-integer ``expected`` is scored by exact text. ``finished`` (stopped on EOS) is reported, not scored:
    trailing text after the number costs nothing, so a model that has the number right is never pushed away.
    """
    text = response.strip()
    expected = expected.strip()
    answer = leading_number(text)
    if _LEADING_INT.fullmatch(expected) is None:
        reward = 1.0 if text == expected else 0.0
    elif answer and int(answer) == int(expected):
        reward = 1.0
    else:
        reward = near_miss(answer, expected) if partial_credit else 0.0
    return {"reward": reward, "correct": reward == 1.0, "answer": answer, "finished": bool(finished)}


def expected_and_response(kind: str, payload: dict[str, Any]) -> tuple[str, str]:
    """The two strings every answer check reads; anything else is a ValueError naming the action."""
    expected, response = payload.get("expected"), payload.get("response")
    if not isinstance(expected, str) or not isinstance(response, str):
        raise ValueError(
            f"{kind} needs string 'expected' and 'response', got {type(expected).__name__} "
            f"and {type(response).__name__}"
        )
    return expected, response


@register("check_answer")
def check_answer(payload: dict[str, Any]) -> dict[str, Any]:
    """Payload ``{"expected", "response", "finished", "partial_credit"?}`` -> ``{"reward", "correct", "answer",
    "finished"}``."""
    expected, response = expected_and_response("check_answer", payload)
    return score_answer(expected, response, bool(payload.get("finished", False)),
                        payload.get("partial_credit") is True)


@register("check_math")
def check_math(payload: dict[str, Any]) -> dict[str, Any]:
    """Payload ``{"expected", "response", "partial_credit"?}`` -> ``{"reward", "correct", "answer", "judged"}``.

    A whole-number answer is judged exactly, on the response's final answer (``shared.rlmath.mathanswer``). Any
    other is judged by value: a plain number first, then math-verify (LaTeX, fractions, radicals, sets,
    intervals, ``\\boxed{}``) within its own timeout, kept inside the action's time budget; out of time it is
    wrong (``"judged": "timeout"``). 1.0 when equal, else 0; with ``partial_credit`` a wrong whole number close
    to a whole-number answer earns ``check_answer``'s shaping."""
    expected, response = expected_and_response("check_math", payload)
    answer = extract_answer(response) or ""
    correct: bool | None = math_equal(answer, expected)
    judged = "number"
    if not correct and not mathverify.is_integer(expected):
        budget = time_budget_s.get()
        limit = mathverify.TIMEOUT_S if budget is None else max(1, min(mathverify.TIMEOUT_S, int(budget / 3)))
        correct, read = mathverify.equivalent(expected, response, limit)
        judged = "math-verify" if correct is not None else "timeout"
        answer = read or answer
    reward = 1.0 if correct else near_miss(answer, expected.strip()) if payload.get("partial_credit") is True else 0.0
    return {"reward": reward, "correct": bool(correct), "answer": answer, "judged": judged}


def code_deadline(requested: Any) -> float:
    """Seconds the code may run: the payload's ``timeout_s`` (default 5), kept inside the pool's timeout."""
    if requested is None:
        seconds = DEFAULT_CODE_TIMEOUT_S
    elif isinstance(requested, int | float) and not isinstance(requested, bool) and requested > 0:
        seconds = float(requested)
    else:
        raise ValueError(f"run_code 'timeout_s' must be a positive number of seconds, got {requested!r}")
    budget = time_budget_s.get()
    if budget is not None:
        # Leave room to kill the child and answer before the pool's own timeout replaces the worker: a fifth of the
        # budget, up to a second (on a loaded machine the kill and the answer can take more than half a second).
        seconds = min(seconds, budget - max(0.05, min(1.0, 0.2 * budget)))
    return max(0.01, seconds)


@register("run_code")
def run_code(payload: dict[str, Any]) -> dict[str, Any]:
    """Payload ``{"code", "tests", "timeout_s"?}`` -> ``{"passed", "tests_passed", "tests_total", "reward",
    "error", "stdout"}``; each top-level assert of ``tests`` is one test, run in a child process."""
    code, tests = payload.get("code"), payload.get("tests")
    if not isinstance(code, str) or not isinstance(tests, str):
        raise ValueError(
            f"run_code needs string 'code' and 'tests', got {type(code).__name__} and {type(tests).__name__}"
        )
    return run_code_in_child(code, tests, code_deadline(payload.get("timeout_s")))


@register("check_gsm8k")
def check_gsm8k(payload: dict[str, Any]) -> dict[str, Any]:
    """Payload ``{"expected", "response"}`` -> ``{"reward", "correct", "answer"}``: 1.0 when the response's final
    number (``shared.rlmath.gsm8k``) equals the expected one, else 0.0."""
    expected, response = expected_and_response("check_gsm8k", payload)
    reward, answer = gsm8k.score(response, expected)
    return {"reward": reward, "correct": reward == 1.0, "answer": answer}


@register("score_reasoning_gym")
def score_reasoning_gym(payload: dict[str, Any]) -> dict[str, Any]:
    """Payload ``{"response", "dataset", "config", "seed", "size", "index", "flexible"?}`` -> that reasoning-gym
    dataset's own ``score_answer`` of the response's ``<answer>`` (with ``flexible``, of its final answer when it
    has no tags; the entry is regenerated here, cached per worker)."""
    response, name, config = payload.get("response"), payload.get("dataset"), payload.get("config") or {}
    seed, size, index = payload.get("seed"), payload.get("size"), payload.get("index")
    if not isinstance(response, str) or not isinstance(name, str) or not isinstance(config, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in (seed, size, index)):
        raise ValueError("score_reasoning_gym needs string 'response' and 'dataset', dict 'config' and integer "
                         f"'seed', 'size', 'index'; got {sorted(payload)}")
    assert isinstance(seed, int) and isinstance(size, int) and isinstance(index, int)
    return rgym.score(name, config, seed, size, index, response, flexible=payload.get("flexible") is True)


def humaneval_program(response: str, prompt: str, entry_point: str) -> str:
    """The program a HumanEval response stands for: its fenced (or whole) code alone when it defines
    ``entry_point``, else the prompt followed by it (a body completion)."""
    blocks = re.findall(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:```|$)", response, re.DOTALL | re.IGNORECASE)
    code = blocks[-1] if blocks else response
    if re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        # the prompt's imports (typing, math) stay: a full function often leans on them
        imports = "".join(line + "\n" for line in prompt.splitlines() if line.startswith(("import ", "from ")))
        return imports + code
    return prompt + code


@register("check_humaneval")
def check_humaneval(payload: dict[str, Any]) -> dict[str, Any]:
    """Payload ``{"response", "prompt", "entry_point", "test", "timeout_s"?}`` -> ``run_code``'s result with one
    test, ``check(candidate)`` returning cleanly: the program (:func:`humaneval_program`) runs in the code's
    process; the problem's prompt (its helpers, such as ``poly``), its ``check`` and every comparison run in the
    tests' process, where ``candidate`` is the program's ``entry_point`` seen through the sandbox's channel."""
    response, prompt = payload.get("response"), payload.get("prompt")
    entry_point, test = payload.get("entry_point"), payload.get("test")
    if not all(isinstance(v, str) for v in (response, prompt, entry_point, test)):
        raise ValueError("check_humaneval needs string 'response', 'prompt', 'entry_point' and 'test'")
    assert isinstance(response, str) and isinstance(prompt, str) and isinstance(entry_point, str)
    if not entry_point.isidentifier():
        raise ValueError(f"check_humaneval: entry_point must be a Python name, got {entry_point!r:.60}")
    # the prompt's stub of entry_point is the candidate too (a test may call it by name, as HumanEval/33 does)
    tests = f"{prompt}\n\n{test}\n\n{entry_point} = candidate\nassert check(candidate) is None\n"
    return run_code_in_child(humaneval_program(response, prompt, entry_point), tests,
                             code_deadline(payload.get("timeout_s")), bind={"candidate": entry_point})


@register("compute_score")
def compute_score(payload: dict[str, Any]) -> dict[str, Any]:
    """The user's reward function (``reward.function``) on ``{"function", "data_source", "solution_str",
    "ground_truth", "extra_info"}`` -> ``{"reward", "correct", "scores"}``; raises when it fails."""
    return rewardfn.compute(payload)


@register("echo")
def echo(payload: dict[str, Any]) -> dict[str, Any]:
    """Return the payload. Test hooks: ``sleep_s`` waits, ``raise`` fails, ``exit_code`` kills the worker,
    ``alloc_mb`` allocates memory (to meet the worker's address-space limit)."""
    if "sleep_s" in payload:
        time.sleep(float(payload["sleep_s"]))
    if "raise" in payload:
        raise RuntimeError(str(payload["raise"]))
    if "exit_code" in payload:
        os._exit(int(payload["exit_code"]))
    if "alloc_mb" in payload:
        blob = bytearray(int(payload["alloc_mb"]) * 1024 * 1024)
        return {"allocated": len(blob)}
    return dict(payload)


@register("cpu_affinity")
def cpu_affinity(payload: dict[str, Any]) -> dict[str, Any]:
    """Where actions run: the CPUs this action's process (and what it forks) may use, and its pid. With
    ``{"spin_s": x}`` it also keeps each of them busy for x seconds (a CPU-bound action for the scheduler's tests
    and benchmark)."""
    spin = payload.get("spin_s", 0.0)
    if not isinstance(spin, int | float) or not 0 <= spin <= 60:
        raise ValueError(f"cpu_affinity: spin_s must be a number of seconds in [0, 60], got {spin!r}")
    if spin:
        end = time.monotonic() + float(spin)
        while time.monotonic() < end:
            pass
    return {"cpus": sorted(os.sched_getaffinity(0)), "pid": os.getpid()}


def tests_spec(payload: dict[str, Any]) -> tuple[int, float, float]:
    """A ``cpu_tests`` suite's ``cases``, ``case_s`` and ``serial_s`` (defaults 1, 0.1, 0), checked: ValueError
    names what is wrong."""
    cases, case_s, serial_s = payload.get("cases", 1), payload.get("case_s", 0.1), payload.get("serial_s", 0.0)
    if not isinstance(cases, int) or not 1 <= cases <= 10_000:
        raise ValueError(f"cpu_tests: cases must be an integer in [1, 10000], got {cases!r}")
    for name, value in (("case_s", case_s), ("serial_s", serial_s)):
        if not isinstance(value, int | float) or not 0 <= value <= 60:
            raise ValueError(f"cpu_tests: {name} must be seconds in [0, 60], got {value!r}")
    return cases, float(case_s), float(serial_s)


@register("cpu_tests")
def cpu_tests(payload: dict[str, Any]) -> dict[str, Any]:
    """An elastic test suite of real CPU work: ``serial_s`` seconds of setup on one core, then ``cases`` test cases
    of ``case_s`` seconds each, run in parallel by ``parallelism`` processes (the cores the scheduler gave it; the
    processes inherit the action's core binding). Every case passes; the result says how they were spread."""
    cases, case_s, serial_s = tests_spec(payload)
    k = payload.get("parallelism", 1)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"cpu_tests: parallelism must be a positive integer, got {k!r}")
    t0 = time.monotonic()
    _spin(float(serial_s))
    k = min(k, cases)
    parent = os.getpid()
    children = []
    for i in range(k):
        pid = os.fork()
        if pid == 0:  # a test process: its share of the cases, then out (never back into the worker's loop)
            try:
                for _ in range(i, cases, k):
                    _spin(float(case_s), parent)
            finally:
                os._exit(0)
        children.append(pid)
    failed = 0
    for pid in children:
        _, status = os.waitpid(pid, 0)
        failed += status != 0
    return {"cases": cases, "passed": cases if not failed else 0, "parallelism": k, "processes": len(children),
            "seconds": time.monotonic() - t0}


def _spin(seconds: float, parent: int | None = None) -> None:
    """Busy CPU for ``seconds``; a child stops early when its parent (the worker) is gone."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
        if parent is not None and n % 4096 == 0 and os.getppid() != parent:
            return
