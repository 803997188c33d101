"""Tests as the sandbox runs them, and what its tests' process reported.

The tests are top-level statements: each ``assert`` is one test, everything else is setup. They run in the
sandbox's tests' process, apart from the code's process: the code's top-level names the tests read (``bind``) are
handles there, so a call of the code sends its arguments as data and gets its answer back as data (or as a handle
of an object that is not data), and every comparison, assert and verdict is made in the tests' process, which the
code cannot reach (sandbox_init, docs/sandbox.md). Nothing here trusts a report beyond its shape.
"""

from __future__ import annotations

import ast
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from services.actions.sandbox_init import ERROR_LIMIT

STDOUT_LIMIT = 4096  # bytes of the code's output kept in the result
_AST_LOCK = threading.Lock()


@dataclass
class Plan:
    steps: list[tuple[str, str]]  # ("setup" | "test", source of one top-level statement), in order
    wheres: list[str]  # per step, the statement (shortened) that errors name
    bind: dict[str, str]  # a name of the tests -> the code's top-level name it is bound to
    tests: int = 0

    @property
    def test_steps(self) -> list[int]:
        return [i for i, (kind, _) in enumerate(self.steps) if kind == "test"]


def _bound_names(body: list[ast.stmt]) -> set[str]:
    """Names the tests bind themselves (assignments, defs, imports, loop and comprehension targets)."""
    names: set[str] = set()
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def free_names(body: list[ast.stmt]) -> list[str]:
    """The names the tests read and do not bind: the code's, where the code defines them (a builtin's name too:
    code that defines ``filter`` is tested as that ``filter``)."""
    bound = _bound_names(body)
    read = {n.id for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return sorted(read - bound)


def plan_tests(tests: str, bind: dict[str, str] | None = None) -> Plan:
    """Split ``tests`` into top-level steps. ``bind`` maps the tests' names to the code's (default: each name the
    tests read and do not bind, to itself). One thread at a time: CPython 3.11's AST conversion keeps its recursion
    depth in the interpreter's state, so two threads parsing at once can fail with "AST constructor recursion depth
    mismatch"."""
    with _AST_LOCK:
        return _plan_tests(tests, bind)


def _plan_tests(tests: str, bind: dict[str, str] | None) -> Plan:
    try:
        body = ast.parse(tests, "<tests>").body
    except SyntaxError as exc:
        raise ValueError(f"run_code 'tests' do not parse: {exc.msg} (line {exc.lineno})") from None
    if not any(isinstance(s, ast.Assert) for s in body):
        raise ValueError("run_code 'tests' have no top-level assert statement: each assert is one test")
    if bind is None:
        bind = {name: name for name in free_names(body)}
    plan = Plan([], [], bind)
    for stmt in body:
        kind = "test" if isinstance(stmt, ast.Assert) else "setup"
        plan.steps.append((kind, ast.unparse(stmt)))
        plan.wheres.append(ast.unparse(stmt)[:200])
        plan.tests += kind == "test"
    return plan


# --- reports from the tests' process ------------------------------------------------------------------------
@dataclass
class Report:
    """What the tests' process said: the code's outcome, each test's error (None: passed) and setup errors."""

    plan: Plan
    code_seen: bool = False
    code_error: str | None = None
    done: bool = False
    steps: dict[int, str | None] = field(default_factory=dict)
    size: int = 0

    def feed(self, line: bytes) -> None:
        self.size += len(line)
        try:
            event = json.loads(line)
        except (ValueError, RecursionError):
            return
        if type(event) is not dict:
            return
        kind, i, error = event.get("event"), event.get("i"), event.get("error")
        if error is not None and type(error) is not str:
            return
        error = error[:ERROR_LIMIT] if error is not None else None
        if kind == "code" and not self.code_seen:
            self.code_seen, self.code_error = True, error
        elif kind == "done":
            self.done = True
        elif type(i) is int and 0 <= i < len(self.plan.steps) and self.plan.steps[i][0] == kind and (
                i not in self.steps) and (kind == "test" or error is not None):
            self.steps[i] = error

    @property
    def final(self) -> bool:
        return self.done or self.code_error is not None


def result(report: Report, stdout: bytes, timed_out: bool, exit_text: str, timeout_s: float) -> dict[str, Any]:
    plan, steps = report.plan, report.steps
    tests = plan.test_steps
    # a test's verdict: None passed, "" not reached (the run ended first), else its error
    if report.code_seen and report.code_error is None:
        verdicts = {i: steps[i] if i in steps else "" for i in tests}
    else:
        verdicts = {i: "" for i in tests}
    errors: list[str] = [report.code_error] if report.code_error else []
    for i, (kind, _) in enumerate(plan.steps):  # in the order of the statements, as they ran
        error = verdicts.get(i) if kind == "test" else steps.get(i)
        if error:
            errors.append(f"{error} in `{plan.wheres[i]}`"[:ERROR_LIMIT])
    if timed_out:
        errors.insert(0, f"timeout after {timeout_s:g}s")
    elif report.code_error is None and "" in verdicts.values():
        errors.insert(0, exit_text)
    passed, total = sum(v is None for v in verdicts.values()), plan.tests
    text = stdout[:STDOUT_LIMIT].decode("utf-8", errors="replace")
    if len(stdout) > STDOUT_LIMIT:
        text += "\n...[output truncated]"
    error = errors[0] if errors else None
    return {"passed": error is None and passed == total, "tests_passed": passed, "tests_total": total,
            "reward": passed / total if total else 0.0, "error": error, "stdout": text}

