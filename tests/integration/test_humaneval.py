"""The 164 HumanEval canonical solutions pass through the real check_humaneval -> run_code path (the sandbox, in
namespaces where this machine allows), and wrong ones fail."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from services.actions.actions import REGISTRY
from services.actions.coderun import isolation
from services.coordinator import datasets


def _check(problem: dict, response: str) -> dict:
    return REGISTRY["check_humaneval"]({"response": response, "prompt": problem["prompt"],
                                        "entry_point": problem["entry_point"], "test": problem["test"],
                                        "timeout_s": 10.0})


def test_every_humaneval_canonical_solution_passes_and_a_wrong_one_fails():
    problems = datasets.humaneval_problems()
    assert len(problems) == 164
    isolation()  # the one-off trial run
    with ThreadPoolExecutor(2) as pool:  # each check is a sandbox subprocess: two at a time on two cores
        results = list(pool.map(lambda p: _check(p, p["canonical_solution"]), problems))
    failed = [(p["task_id"], r["error"]) for p, r in zip(problems, results, strict=True) if not r["passed"]]
    assert not failed, failed
    assert all(r["reward"] == 1.0 and r["tests_total"] == 1 for r in results)
    wrong = _check(problems[0], "    return not True\n")
    assert not wrong["passed"] and wrong["reward"] == 0.0 and "AssertionError" in wrong["error"]
    broken = _check(problems[1], "    return [\n")
    assert not broken["passed"] and broken["reward"] == 0.0


def test_a_fenced_full_function_is_run_alone():
    p = datasets.humaneval_problems()[2]  # truncate_number
    fenced = f"Sure.\n```python\ndef {p['entry_point']}(number: float) -> float:\n    return number % 1.0\n```"
    assert _check(p, fenced)["passed"]
