"""Tests as the sandbox sees them and as they are judged: each top-level ``assert`` is split into the probes the
sandbox evaluates (the parts that need the code) and a check evaluated here on the probes' reported values, with
the whitelisted builtins only. Only the code, the setup statements and the probes' source enter the sandbox,
never an expected value.
"""

from __future__ import annotations

import ast
import json
import math
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from services.actions.sandbox_init import ERROR_LIMIT, decode

STDOUT_LIMIT = 4096  # bytes of the code's output kept in the result
PROBE, ITEM = "__chorus_probe", "__chorus_item"  # what stands for probe values in a check evaluated here
SAFE_NAMES: dict[str, Any] = {f.__name__: f for f in (
    abs, round, len, sorted, set, list, tuple, dict, min, max, sum, all, any, int, float, str, bool, frozenset,
    isinstance, type)}
SAFE_MATH = types.SimpleNamespace(isclose=math.isclose, isnan=math.isnan, isinf=math.isinf,
                                  isfinite=math.isfinite, pi=math.pi, e=math.e, tau=math.tau, inf=math.inf,
                                  nan=math.nan)
STRUCTURAL = (ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Compare, ast.IfExp, ast.List, ast.Tuple, ast.Set,
              ast.Dict)
COMPREHENSIONS = (ast.GeneratorExp, ast.ListComp, ast.SetComp)
_AST_LOCK = threading.Lock()

# --- tests -> steps for the sandbox, checks for here -------------------------------------------------------
@dataclass
class Check:
    """One test: its assert's condition with probe calls in place of the code's parts, compiled."""

    where: str
    code: types.CodeType
    probes: list[int]  # the steps it reads (at least one: a test counts once the sandbox got to it)
    message: str | None


@dataclass
class Plan:
    steps: list[tuple[str, str]]  # ("setup" | "probe", source): all that enters the sandbox besides the code
    wheres: list[str]  # per step, the statement it comes from
    order: list[tuple[str, int]]  # the statements: ("setup", step) or ("test", check)
    checks: list[Check] = field(default_factory=list)


class _Split(ast.NodeTransformer):
    """Replace each maximal part of an expression that this process must not evaluate with a probe."""

    def __init__(self, shadowed: set[str], ref: Callable[[int], ast.expr], nested: bool = False) -> None:
        self.shadowed, self.ref, self.nested = shadowed, ref, nested
        self.probes: list[ast.expr] = []

    def visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, ast.Constant) or self._safe_leaf(node):
            return node
        if not isinstance(node, ast.expr) or self._structural(node):
            return self.generic_visit(node)
        if isinstance(node, COMPREHENSIONS) and not self.nested and all(
                not g.ifs and not g.is_async for g in node.generators):
            return self._comprehension(node)
        return self._probe(node)

    def _safe_leaf(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in SAFE_NAMES and node.id not in self.shadowed
        return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "math"
                and "math" not in self.shadowed and hasattr(SAFE_MATH, node.attr))

    def _structural(self, node: ast.expr) -> bool:
        if any(isinstance(c, ast.Starred) for c in ast.iter_child_nodes(node)):
            return False
        if isinstance(node, STRUCTURAL):
            return True
        if not isinstance(node, ast.Call) or not self._safe_leaf(node.func):
            return False
        # sorted(x, key=lambda ...) runs whole in the sandbox: a function is not data.
        if any(k.arg is None or isinstance(k.value, ast.Lambda) for k in node.keywords) or any(
                isinstance(a, ast.Lambda) for a in node.args):
            return False
        # isinstance(x, C) is checked here only against builtin types: a class of the code is not data either.
        return not (isinstance(node.func, ast.Name) and node.func.id == "isinstance") or (
            len(node.args) == 2 and all(isinstance(n, ast.Tuple | ast.Load) or self._safe_leaf(n)
                                        for n in ast.walk(node.args[1])))

    def _comprehension(self, node: ast.GeneratorExp | ast.ListComp | ast.SetComp) -> ast.expr:
        """``[ELT for T in IT]``: the sandbox reports the probes of ELT for each item, ELT is evaluated here."""
        targets = {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        inner = _Split(self.shadowed | targets,
                       lambda j: ast.Subscript(ast.Name(ITEM, ast.Load()), ast.Constant(j), ast.Load()), True)
        elt = cast(ast.expr, inner.visit(node.elt))
        probe = self._probe(ast.ListComp(ast.Tuple(inner.probes, ast.Load()), node.generators))
        return type(node)(elt, [ast.comprehension(ast.Name(ITEM, ast.Store()), probe, [], 0)])

    def _probe(self, node: ast.expr) -> ast.expr:
        if isinstance(node, ast.GeneratorExp):  # reported as the list it yields
            node = ast.ListComp(node.elt, node.generators)
        self.probes.append(node)
        return self.ref(len(self.probes) - 1)


def _bound_names(body: list[ast.stmt]) -> set[str]:
    """Names the tests bind (setup statements, walruses): such a name is the sandbox's, even ``len``."""
    names: set[str] = set()
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names
                         if (a.name, a.asname) != ("math", None))
    return names


def _probe_call(first: int) -> Callable[[int], ast.expr]:
    return lambda j: ast.Call(ast.Name(PROBE, ast.Load()), [ast.Constant(first + j)], [])


def plan_tests(tests: str) -> Plan:
    """Split ``tests`` into the steps the sandbox runs and the checks evaluated here (one per top-level
    assert). One thread at a time: CPython 3.11's AST conversion keeps its recursion depth in the interpreter's
    state, so two threads parsing at once can fail with "AST constructor recursion depth mismatch"."""
    with _AST_LOCK:
        return _plan_tests(tests)


def _plan_tests(tests: str) -> Plan:
    try:
        body = ast.parse(tests, "<tests>").body
    except SyntaxError as exc:
        raise ValueError(f"run_code 'tests' do not parse: {exc.msg} (line {exc.lineno})") from None
    if not any(isinstance(s, ast.Assert) for s in body):
        raise ValueError("run_code 'tests' have no top-level assert statement: each assert is one test")
    shadowed = _bound_names(body)
    plan = Plan([], [], [])
    for stmt in body:
        where = ast.unparse(stmt)[:200]
        if not isinstance(stmt, ast.Assert):
            plan.order.append(("setup", len(plan.steps)))
            plan.steps.append(("setup", ast.unparse(stmt)))
            plan.wheres.append(where)
            continue
        first = len(plan.steps)
        split = _Split(shadowed, _probe_call(first))
        test = cast(ast.expr, split.visit(stmt.test))
        probes = split.probes or [ast.Constant(None)]  # a test that reads nothing waits for the sandbox too
        plan.steps += [("probe", ast.unparse(p)) for p in probes]
        plan.wheres += [where] * len(probes)
        msg = stmt.msg.value if isinstance(stmt.msg, ast.Constant) and isinstance(stmt.msg.value, str) else None
        code = compile(ast.fix_missing_locations(ast.Expression(test)), "<tests>", "eval")
        plan.order.append(("test", len(plan.checks)))
        plan.checks.append(Check(where, code, list(range(first, len(plan.steps))), msg))
    return plan


# --- reports from the sandbox: untrusted bytes -> builtin data -> verdicts ---------------------------------
class _Failed(Exception):
    """A step that raised in the sandbox; raised again here where a check reads its value."""


@dataclass
class Report:
    """What the sandbox said: the code's outcome and the first report of each step."""

    plan: Plan
    code_seen: bool = False
    code_error: str | None = None
    done: bool = False
    steps: dict[int, Any] = field(default_factory=dict)  # a probe's value, or _Failed
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
        error = error[:ERROR_LIMIT] if type(error) is str else None
        if kind == "code" and not self.code_seen:
            self.code_seen, self.code_error = True, error
        elif kind == "done":
            self.done = True
        elif type(i) is int and 0 <= i < len(self.plan.steps) and self.plan.steps[i][0] == kind and (
                i not in self.steps):
            if error is not None:
                self.steps[i] = _Failed(error)
            elif kind == "probe":
                try:
                    self.steps[i] = decode(event.get("value"))
                except (ValueError, TypeError, RecursionError):
                    self.steps[i] = _Failed("malformed value")

    @property
    def final(self) -> bool:
        return self.done or self.code_error is not None


def _judge(check: Check, steps: dict[int, Any]) -> str | None:
    """The test's error (None: passed), evaluated on decoded values with the whitelisted builtins only."""

    def probe(k: int) -> Any:
        if isinstance(steps[k], _Failed):
            raise steps[k]
        return steps[k]

    ns = {"__builtins__": {}, **SAFE_NAMES, "math": SAFE_MATH, PROBE: probe}
    try:
        ok = bool(eval(check.code, ns))  # the tests' own trusted shape, over plain data
    except _Failed as exc:
        return f"{exc} in `{check.where}`"[:ERROR_LIMIT]
    except Exception as exc:
        return _describe(exc, check.where)
    return None if ok else _describe(AssertionError(*[check.message] if check.message else []), check.where)


def _describe(exc: BaseException, where: str) -> str:
    return f"{type(exc).__name__}{f': {exc}' if str(exc) else ''} in `{where}`"[:ERROR_LIMIT]


def result(report: Report, stdout: bytes, timed_out: bool, exit_text: str,
            timeout_s: float) -> dict[str, Any]:
    plan, steps = report.plan, report.steps
    if report.code_seen and report.code_error is None:  # "": no verdict, the sandbox did not get there
        verdicts: list[str | None] = [_judge(c, steps) if all(k in steps for k in c.probes) else ""
                                      for c in plan.checks]
    else:
        verdicts = [""] * len(plan.checks)
    errors: list[str] = [report.code_error] if report.code_error else []
    for kind, i in plan.order:  # in the order of the statements, as they ran
        if kind == "test" and (verdict := verdicts[i]):
            errors.append(verdict)
        elif kind == "setup" and isinstance(steps.get(i), _Failed):
            errors.append(f"{steps[i]} in `{plan.wheres[i]}`"[:ERROR_LIMIT])
    if timed_out:
        errors.insert(0, f"timeout after {timeout_s:g}s")
    elif report.code_error is None and "" in verdicts:
        errors.insert(0, exit_text)
    passed, total = verdicts.count(None), len(plan.checks)
    text = stdout[:STDOUT_LIMIT].decode("utf-8", errors="replace")
    if len(stdout) > STDOUT_LIMIT:
        text += "\n...[output truncated]"
    error = errors[0] if errors else None
    return {"passed": error is None and passed == total, "tests_passed": passed, "tests_total": total,
            "reward": passed / total, "error": error, "stdout": text}
