"""Tasks with checkable answers: procedural arithmetic, word problems and coding problems, or a JSONL dataset.

Procedural tasks come from a seeded stream; a held-out list (a separate seed space, de-duplicated by question)
is kept out of the training stream. A JSONL dataset holds out its last lines instead.
"""

from __future__ import annotations

import ast
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from services.coordinator import datasets
from shared.kernel.config import TaskConfig
from shared.rlmath import rgym

MAX_DRAWS = 10_000  # draws without a new question before a task space counts as exhausted


@dataclass(frozen=True)
class Task:
    task_id: str
    question: str  # e.g. "3+4=" or "What is 3 + 4?"
    answer: str  # e.g. "7"; for code tasks a reference solution
    tests: str | None = None  # code tasks: top-level assert statements, each one test
    kind: Literal["math", "code"] = "math"
    # The action that scores a response (None: the task's default, scoring.check) and what it needs besides
    # {"response", "expected", "finished"}: a dataset task's own check (check_gsm8k, score_reasoning_gym, ...).
    check: str | None = None
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


def solve(a: int, op: str, b: int, modulo: int | None) -> str:
    """The answer text of ``a op b``, reduced mod ``modulo`` (always non-negative) when it is set."""
    if op == "+":
        result = a + b
    elif op == "-":
        result = a - b
    elif op == "*":
        result = a * b
    else:
        raise ValueError(f"unknown operator {op!r}: expected one of + - *")
    return str(result % modulo) if modulo else str(result)


# --- word problems ------------------------------------------------------------------------
NAMES = ["Tom", "Ana", "Ravi", "Mei", "Lena", "Omar", "Sara", "Ken", "Zoe", "Ivan"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "cards", "shells", "coins", "stamps"]


def _word_problem(rng: random.Random, m: int) -> tuple[str, int]:
    """One word problem with numbers up to about ``m`` and its whole-number answer."""
    n, n2 = rng.sample(NAMES, 2)
    it = rng.choice(ITEMS)
    small = max(2, min(m, 12))
    kind = rng.randrange(7)
    if kind == 0:
        a, b = rng.randint(1, m), rng.randint(1, m)
        return f"{n} has {a} {it} and buys {b} more. How many {it} does {n} have now?", a + b
    if kind == 1:
        a = rng.randint(2, m)
        b = rng.randint(1, a - 1)
        return f"{n} has {a} {it} and gives {b} of them to {n2}. How many {it} does {n} have left?", a - b
    if kind == 2:
        a, b = rng.randint(2, small), rng.randint(2, small)
        return f"{n} has {a} bags with {b} {it} in each bag. How many {it} does {n} have in all?", a * b
    if kind == 3:
        each, k = rng.randint(1, m), rng.randint(2, small)
        return (f"{n} shares {each * k} {it} equally among {k} friends. How many {it} does each friend get?",
                each)
    if kind == 4:
        a, b = rng.randint(1, m), rng.randint(1, m)
        return (f"{n} has {a} {it}. {n2} has {b} more {it} than {n}. How many {it} do they have together?",
                2 * a + b)
    if kind == 5:
        price, count = rng.randint(1, small), rng.randint(2, 5)
        paid = price * count + rng.randint(0, m)
        return (f"{n} buys {count} notebooks at {price} dollars each and pays with {paid} dollars. "
                f"How many dollars of change does {n} get?", paid - price * count)
    a, b = rng.randint(1, m), rng.randint(1, m)
    c = rng.randint(1, a + b)
    return (f"{n} had {a} {it}, found {b} more, then lost {c}. How many {it} does {n} have now?",
            a + b - c)


# --- coding problems ----------------------------------------------------------------------
@dataclass(frozen=True)
class CodeSpec:
    """A function to write: its signature, what it does, a reference body, the same in Python, test inputs."""

    signature: str
    description: str
    body: str
    fn: Callable[..., Any]
    args: Callable[[random.Random], tuple[Any, ...]]


def _ints(rng: random.Random, m: int) -> list[int]:
    return [rng.randint(-m, m) for _ in range(rng.randint(1, 6))]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcde") for _ in range(rng.randint(0, 6)))


def _code_spec(rng: random.Random, m: int) -> CodeSpec:
    """One coding problem; the constants in it are drawn from ``rng``."""
    k = rng.randint(2, max(2, min(m, 9)))
    lo = rng.randint(-m, 0)
    hi = rng.randint(1, m)
    ch = rng.choice("abcde")
    specs = [
        CodeSpec("add(a, b)", "returns the sum of a and b", "return a + b", lambda a, b: a + b,
                 lambda r: (r.randint(-m, m), r.randint(-m, m))),
        CodeSpec("add_k(x)", f"returns x plus {k}", f"return x + {k}", lambda x: x + k,
                 lambda r: (r.randint(-m, m),)),
        CodeSpec("scale(x)", f"returns x multiplied by {k}", f"return x * {k}", lambda x: x * k,
                 lambda r: (r.randint(-m, m),)),
        CodeSpec("count_greater(xs)", f"returns how many numbers in the list xs are greater than {k}",
                 f"return sum(1 for x in xs if x > {k})", lambda xs: sum(1 for x in xs if x > k),
                 lambda r: (_ints(r, m),)),
        CodeSpec("sum_evens(xs)", "returns the sum of the even numbers in the list xs",
                 "return sum(x for x in xs if x % 2 == 0)", lambda xs: sum(x for x in xs if x % 2 == 0),
                 lambda r: (_ints(r, m),)),
        CodeSpec("repeat(s)", f"returns the string s repeated {k} times", f"return s * {k}", lambda s: s * k,
                 lambda r: (_word(r),)),
        CodeSpec("clamp(x)", f"returns x limited to the range {lo} to {hi}, both included",
                 f"return max({lo}, min({hi}, x))", lambda x: max(lo, min(hi, x)),
                 lambda r: (r.randint(-2 * m, 2 * m),)),
        CodeSpec("largest(xs)", "returns the largest number in the non-empty list xs", "return max(xs)", max,
                 lambda r: (_ints(r, m),)),
        CodeSpec("count_char(s)", f"returns how many times the letter {ch!r} occurs in the string s",
                 f"return s.count({ch!r})", lambda s: s.count(ch), lambda r: (_word(r),)),
        CodeSpec("reverse(s)", "returns the string s reversed", "return s[::-1]", lambda s: s[::-1],
                 lambda r: (_word(r),)),
        CodeSpec("squares(n)", "returns the list of the squares of 0, 1, ..., n - 1",
                 "return [i * i for i in range(n)]", lambda n: [i * i for i in range(n)],
                 lambda r: (r.randint(0, 6),)),
        CodeSpec("is_multiple(x)", f"returns True when x is a multiple of {k} and False otherwise",
                 f"return x % {k} == 0", lambda x: x % k == 0,
                 lambda r: (r.randint(-m, m) * (k if r.random() < 0.5 else 1),)),  # half are multiples
    ]
    return rng.choice(specs)


def code_problem(rng: random.Random, m: int) -> tuple[str, str, str]:
    """(question, reference solution, tests) of one coding problem with 3-5 distinct assert tests."""
    spec = _code_spec(rng, m)
    name = spec.signature.split("(", 1)[0]
    calls: list[tuple[Any, ...]] = []
    for _ in range(50):  # small input spaces may not have 5 distinct inputs
        args = spec.args(rng)
        if args not in calls:
            calls.append(args)
        if len(calls) == 5:
            break
    calls = calls[: rng.randint(3, 5)]
    tests = "".join(f"assert {name}({', '.join(map(repr, a))}) == {spec.fn(*a)!r}\n" for a in calls)
    question = f"Write a Python function {spec.signature} that {spec.description}."
    return question, f"def {spec.signature}:\n    {spec.body}\n", tests


def make_task(rng: random.Random, cfg: TaskConfig, task_id: str | None = None) -> Task:
    """Draw one task; deterministic given the state of ``rng`` (the id too, unless ``task_id`` is given)."""
    if cfg.name == "word":
        question, value = _word_problem(rng, cfg.max_value)
        tid = f"{rng.getrandbits(48):012x}"
        return Task(task_id=task_id or tid, question=question, answer=str(value))
    if cfg.name == "code":
        question, solution, tests = code_problem(rng, cfg.max_value)
        tid = f"{rng.getrandbits(48):012x}"
        return Task(task_id=task_id or tid, question=question, answer=solution, tests=tests, kind="code")
    if cfg.name == "jsonl" or cfg.name in datasets.DATASETS:
        raise ValueError(f"{cfg.name} tasks come from a dataset: use TaskSource or heldout_tasks, not make_task")
    a = rng.randint(0, cfg.max_operand)
    b = rng.randint(0, cfg.max_operand)
    op = rng.choice(cfg.ops)
    tid = f"{rng.getrandbits(48):012x}"
    question = f"{a}{op}{b}=" if cfg.phrasing == "compact" else f"What is {a} {op} {b}?"
    return Task(task_id=task_id or tid, question=question, answer=solve(a, op, b, cfg.modulo))


# --- JSONL datasets -----------------------------------------------------------------------
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def final_answer(answer: str) -> str:
    """A GSM8K-style answer reduced to its final answer: the text after the last ``####`` (``"1,000"`` -> ``"1000"``)."""
    text = answer.rsplit("####", 1)[1] if "####" in answer else answer
    text = text.strip()
    return text.replace(",", "") if _THOUSANDS.match(text) else text


def count_asserts(tests: str) -> int:
    """Top-level assert statements of ``tests`` (each one test); raises SyntaxError when it does not parse."""
    return sum(isinstance(s, ast.Assert) for s in ast.parse(tests).body)


def _line_task(obj: Any, where: str, task_id: str) -> Task:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with 'question' and 'answer', got {type(obj).__name__}")
    question, answer, tests = obj.get("question"), obj.get("answer"), obj.get("tests")
    if "question" not in obj or "answer" not in obj:
        missing = [k for k in ("question", "answer") if k not in obj]
        raise ValueError(f"{where}: missing key {' and '.join(map(repr, missing))} (keys present: {sorted(obj)})")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: 'question' must be a non-empty string, got {question!r:.80}")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ValueError(f"{where}: 'answer' must be a string or a number, got {type(answer).__name__}")
    answer = final_answer(answer) if isinstance(answer, str) else str(answer)
    if not answer:
        raise ValueError(f"{where}: 'answer' is empty (after reducing '#### X' to X)")
    if tests is None:
        return Task(task_id=task_id, question=question, answer=answer)
    if not isinstance(tests, str):
        raise ValueError(f"{where}: 'tests' must be a string of assert statements, got {type(tests).__name__}")
    try:
        n = count_asserts(tests)
    except SyntaxError as exc:
        raise ValueError(f"{where}: 'tests' do not parse as Python: {exc.msg} (line {exc.lineno})") from None
    if n == 0:
        raise ValueError(f"{where}: 'tests' have no top-level assert statement")
    return Task(task_id=task_id, question=question, answer=answer, tests=tests, kind="code")


def load_jsonl(path: str | Path) -> list[Task]:
    """Every task of a JSONL file (blank lines skipped); a bad line raises ValueError naming file and line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"task.path: cannot read the dataset {p}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{p}: not UTF-8 text (byte {exc.start})") from None
    tasks = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON: {exc.msg} at column {exc.colno}") from None
        tasks.append(_line_task(obj, where, f"{p.stem}-{lineno}"))
    if not tasks:
        raise ValueError(f"{p}: no tasks (the file has no JSON lines)")
    return tasks


def _split_jsonl(cfg: TaskConfig, n: int) -> tuple[list[Task], list[Task]]:
    """(training tasks, the last ``n`` held-out tasks) of the dataset."""
    assert cfg.path is not None  # checked by TaskConfig
    tasks = load_jsonl(cfg.path)
    if n >= len(tasks):
        raise ValueError(f"{cfg.path}: {len(tasks)} tasks leave none for training after holding out {n}")
    return (tasks[: len(tasks) - n], tasks[len(tasks) - n:]) if n else (tasks, [])


# --- held-out split and the training stream -----------------------------------------------
def heldout_tasks(cfg: TaskConfig, n: int, seed: int) -> list[Task]:
    """A fixed list of ``n`` held-out tasks (n <= task.heldout), never in the training stream of ``seed``."""
    if n < 0 or n > cfg.heldout:
        raise ValueError(
            f"asked for {n} held-out tasks but task.heldout is {cfg.heldout}: set task.heldout >= {n} so "
            "that the training stream leaves them out"
        )
    if cfg.name == "jsonl":
        return _split_jsonl(cfg, n)[1]
    if cfg.name == "reasoning_gym":
        return datasets.rg_heldout(cfg, n, seed)
    if cfg.name in datasets.DATASETS:
        return datasets.split_pool(cfg, cfg.heldout, seed)[1][:n]
    # A string seed: a separate seed space from the training stream's integer seed.
    rng = random.Random(f"heldout-{seed}")
    seen: set[str] = set()
    out: list[Task] = []
    misses = 0
    while len(out) < n:
        task = make_task(rng, cfg, f"heldout-{len(out)}")
        if task.question in seen:
            misses += 1
            if misses > MAX_DRAWS:
                raise ValueError(f"task {cfg.name!r} has only {len(out)} distinct questions: cannot hold out {n}")
            continue
        misses = 0
        seen.add(task.question)
        out.append(task)
    return out


class TaskSource:
    """Numbered tasks from one seeded stream: ids ``<prefix>-<n>`` are unique across restarts via the prefix.

    The first ``task.heldout`` held-out tasks of the same seed never appear (procedural tasks skip their
    questions; a JSONL dataset leaves out its last lines and is shuffled anew every epoch).
    """

    def __init__(self, seed: int, cfg: TaskConfig, prefix: str) -> None:
        self.rng = random.Random(seed)
        self.cfg = cfg
        self.prefix = prefix
        self.count = 0
        self._pool: list[Task] = []
        self._order: list[int] = []
        self._held: set[str] = set()
        self.seed = seed
        self._rg_index = -1  # reasoning_gym: the last dataset index drawn
        self._rg_seed = rgym.split_seed(seed, "train") if cfg.name == "reasoning_gym" else 0
        if cfg.name == "jsonl":
            self._pool = _split_jsonl(cfg, cfg.heldout)[0]
        elif cfg.name in datasets.DATASETS and cfg.name != "reasoning_gym":
            self._pool = datasets.split_pool(cfg, cfg.heldout, seed)[0]
        elif cfg.heldout:
            self._held = {t.question for t in heldout_tasks(cfg, cfg.heldout, seed)}
            probe = random.Random()
            probe.setstate(self.rng.getstate())
            self._draw(probe, "probe")  # fail now, not in a task loop, if nothing is left to train on
            self._rg_index = -1

    def _draw(self, rng: random.Random, task_id: str) -> Task:
        if self.cfg.name == "reasoning_gym":  # item n of the run seed's dataset, skipping held-out questions
            for _ in range(MAX_DRAWS):
                self._rg_index += 1
                task = datasets.rg_task(self.cfg, self._rg_seed, self._rg_index % self.cfg.size, task_id)
                if task.question not in self._held:
                    return task
            raise ValueError(f"reasoning_gym {self.cfg.dataset}: {MAX_DRAWS} items in a row are held-out questions")
        for _ in range(MAX_DRAWS):
            task = make_task(rng, self.cfg, task_id)
            if task.question not in self._held:
                return task
        raise ValueError(
            f"task {self.cfg.name!r}: {MAX_DRAWS} draws in a row hit the {len(self._held)} held-out questions; "
            "lower task.heldout or widen the task space"
        )

    def next(self) -> tuple[int, Task]:
        """The next (index, task)."""
        index = self.count
        self.count += 1
        task_id = f"{self.prefix}-{index}"
        if not self._pool:
            return index, self._draw(self.rng, task_id)
        if not self._order:
            self._order = self.rng.sample(range(len(self._pool)), len(self._pool))
        t = self._pool[self._order.pop()]
        return index, replace(t, task_id=task_id)
