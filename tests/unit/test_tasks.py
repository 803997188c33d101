"""Tasks: deterministic from a seed, answers checkable; word and code problems, JSONL data, held-out split."""

from __future__ import annotations

import ast
import json
import random
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.coordinator.tasks import TaskSource, heldout_tasks, load_jsonl, make_task, solve
from shared.kernel.config import TaskConfig


def test_same_seed_gives_the_same_tasks_and_ids():
    cfg = TaskConfig(max_operand=9, ops=["+", "-", "*"])
    a = [make_task(random.Random(7), cfg) for _ in range(3)]
    b = [make_task(random.Random(7), cfg) for _ in range(3)]
    assert a == b
    r1, r2 = random.Random(1), random.Random(1)
    assert [make_task(r1, cfg) for _ in range(20)] == [make_task(r2, cfg) for _ in range(20)]


def test_different_seeds_give_different_streams():
    cfg = TaskConfig(max_operand=50, ops=["+", "*"])
    r1, r2 = random.Random(1), random.Random(2)
    assert [make_task(r1, cfg).question for _ in range(10)] != [make_task(r2, cfg).question for _ in range(10)]


@given(st.integers(0, 2**32), st.integers(1, 30), st.sampled_from(["+", "-", "*"]), st.sampled_from([None, 2, 10, 97]))
def test_question_parses_back_to_the_answer(seed: int, max_operand: int, op: str, modulo: int | None):
    cfg = TaskConfig(max_operand=max_operand, ops=[op], modulo=modulo)
    task = make_task(random.Random(seed), cfg)
    assert task.question.endswith("=")
    a_text, b_text = task.question[:-1].split(op)
    a, b = int(a_text), int(b_text)
    assert 0 <= a <= max_operand and 0 <= b <= max_operand
    exact = {"+": a + b, "-": a - b, "*": a * b}[op]
    if modulo:
        assert task.answer == str(exact % modulo) and 0 <= int(task.answer) < modulo
    else:
        assert task.answer == str(exact)


def test_question_phrasing_asks_the_same_sum_in_words():
    compact = make_task(random.Random(5), TaskConfig(max_operand=20, ops=["-"], modulo=None))
    asked = make_task(random.Random(5), TaskConfig(max_operand=20, ops=["-"], modulo=None, phrasing="question"))
    a, b = compact.question[:-1].split("-")
    assert asked.question == f"What is {a} - {b}?"
    assert (asked.answer, asked.task_id) == (compact.answer, compact.task_id)


@pytest.mark.parametrize(
    ("a", "op", "b", "modulo", "answer"),
    [(3, "+", 4, 10, "7"), (9, "+", 8, 10, "7"), (2, "-", 5, 10, "7"), (2, "-", 5, None, "-3"), (4, "*", 4, None, "16")],
)
def test_answers_are_reduced_and_signed_as_configured(a: int, op: str, b: int, modulo: int | None, answer: str):
    assert solve(a, op, b, modulo) == answer


def test_task_source_numbers_tasks_with_its_prefix():
    src = TaskSource(3, TaskConfig(), "abc")
    (i0, t0), (i1, t1) = src.next(), src.next()
    assert (i0, i1) == (0, 1)
    assert (t0.task_id, t1.task_id) == ("abc-0", "abc-1")
    again = TaskSource(3, TaskConfig(), "xyz")
    assert [again.next()[1].question for _ in range(2)] == [t0.question, t1.question]


# --- word and code problems, JSONL datasets, held-out split -------------------------------
def _word_cfg(**kw) -> TaskConfig:
    return TaskConfig(name="word", **kw)


@given(st.integers(0, 2**32), st.integers(2, 60))
def test_word_problems_have_whole_non_negative_answers_from_their_numbers(seed: int, max_value: int):
    task = make_task(random.Random(seed), _word_cfg(max_value=max_value))
    assert task.kind == "math" and task.tests is None and task.question.endswith("?")
    assert int(task.answer) >= 0
    numbers = [int(n) for n in re.findall(r"\d+", task.question)]
    assert len(numbers) >= 2


def test_word_problem_answers_match_their_story():
    rng = random.Random(5)
    checked = set()
    for _ in range(400):
        t = make_task(rng, _word_cfg())
        n = [int(x) for x in re.findall(r"\d+", t.question)]
        if "buys" in t.question and "more." in t.question:
            assert int(t.answer) == n[0] + n[1]
            checked.add("buy")
        elif "gives" in t.question:
            assert int(t.answer) == n[0] - n[1]
            checked.add("give")
        elif "in each bag" in t.question:
            assert int(t.answer) == n[0] * n[1]
            checked.add("bags")
        elif "equally" in t.question:
            assert int(t.answer) * n[1] == n[0]
            checked.add("share")
        elif "more" in t.question and "together" in t.question:
            assert int(t.answer) == 2 * n[0] + n[1]
            checked.add("compare")
        elif "change" in t.question:
            assert int(t.answer) == n[2] - n[0] * n[1]
            checked.add("change")
        elif "lost" in t.question:
            assert int(t.answer) == n[0] + n[1] - n[2]
            checked.add("lost")
    assert len(checked) == 7


@given(st.integers(0, 2**32), st.integers(2, 40))
def test_code_problems_have_3_to_5_tests_that_their_reference_solution_passes(seed: int, max_value: int):
    task = make_task(random.Random(seed), TaskConfig(name="code", max_value=max_value))
    assert task.kind == "code" and task.tests is not None
    assert task.question.startswith("Write a Python function ")
    tree = ast.parse(task.tests)
    assert 3 <= len(tree.body) <= 5 and all(isinstance(s, ast.Assert) for s in tree.body)
    assert len({ast.unparse(s) for s in tree.body}) == len(tree.body)  # distinct tests
    ns: dict = {}
    exec(task.answer, ns)  # the reference solution (trusted: generated here)
    exec(task.tests, ns)


def test_a_wrong_solution_fails_some_code_tests():
    rng = random.Random(11)
    for _ in range(30):
        task = make_task(rng, TaskConfig(name="code"))
        name = task.question.split("function ", 1)[1].split("(", 1)[0]
        ns: dict = {}
        exec(f"def {name}(*args):\n    return None\n", ns)
        with pytest.raises(AssertionError):
            exec(task.tests, ns)


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_jsonl_tasks_reduce_gsm8k_answers_and_read_code_tests(tmp_path: Path):
    p = _write(tmp_path, [
        json.dumps({"question": "Natalia sold 48 clips... how many?", "answer": "She sold 24.\n#### 72"}),
        "",
        json.dumps({"question": "Big?", "answer": "#### 1,000", "source": "extra keys are fine"}),
        json.dumps({"question": "Number?", "answer": 3.5}),
        json.dumps({"question": "Write inc(x).", "answer": "def inc(x): return x + 1",
                    "tests": "assert inc(1) == 2\nassert inc(-1) == 0"}),
    ])
    tasks = load_jsonl(p)
    assert [t.answer for t in tasks[:3]] == ["72", "1000", "3.5"]
    assert [t.task_id for t in tasks] == ["data-1", "data-3", "data-4", "data-5"]
    assert tasks[3].kind == "code" and tasks[3].tests is not None and tasks[0].kind == "math"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"data.jsonl:2: not valid JSON"),
        ("[1, 2]", r"data.jsonl:2: expected a JSON object with 'question' and 'answer', got list"),
        ('{"question": "q"}', r"data.jsonl:2: missing key 'answer'"),
        ('{"answer": "1"}', r"data.jsonl:2: missing key 'question'"),
        ('{"question": "  ", "answer": "1"}', r"data.jsonl:2: 'question' must be a non-empty string"),
        ('{"question": "q", "answer": null}', r"data.jsonl:2: 'answer' must be a string or a number, got NoneType"),
        ('{"question": "q", "answer": true}', r"data.jsonl:2: 'answer' must be a string or a number, got bool"),
        ('{"question": "q", "answer": "#### "}', r"data.jsonl:2: 'answer' is empty"),
        ('{"question": "q", "answer": "1", "tests": "assert ("}', r"data.jsonl:2: 'tests' do not parse"),
        ('{"question": "q", "answer": "1", "tests": "x = 1"}', r"data.jsonl:2: 'tests' have no top-level assert"),
    ],
)
def test_a_bad_jsonl_line_names_the_file_the_line_and_the_problem(tmp_path: Path, line: str, message: str):
    p = _write(tmp_path, [json.dumps({"question": "ok?", "answer": "1"}), line])
    with pytest.raises(ValueError, match=message) as err:
        load_jsonl(p)
    assert str(p) in str(err.value)


def test_missing_or_empty_dataset_is_a_clear_error(tmp_path: Path):
    with pytest.raises(ValueError, match="cannot read the dataset .*nope.jsonl"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="no tasks"):
        load_jsonl(_write(tmp_path, ["", "  "]))
    with pytest.raises(ValueError, match="needs the path of a JSONL file"):
        TaskConfig(name="jsonl")


def test_jsonl_holds_out_the_last_lines_and_trains_on_the_rest_in_shuffled_epochs(tmp_path: Path):
    p = _write(tmp_path, [json.dumps({"question": f"q{i}?", "answer": str(i)}) for i in range(10)])
    cfg = TaskConfig(name="jsonl", path=p, heldout=3)
    held = heldout_tasks(cfg, 3, seed=0)
    assert [t.question for t in held] == ["q7?", "q8?", "q9?"]
    assert [t.question for t in heldout_tasks(cfg, 2, seed=0)] == ["q8?", "q9?"]
    src = TaskSource(0, cfg, "p")
    first = [src.next()[1] for _ in range(7)]
    second = [src.next()[1] for _ in range(7)]
    assert sorted(t.question for t in first) == sorted(t.question for t in second) == [f"q{i}?" for i in range(7)]
    assert [t.task_id for t in first[:2]] == ["p-0", "p-1"]
    assert [t.question for t in first] != [f"q{i}?" for i in range(7)]  # shuffled
    again = TaskSource(0, cfg, "x")
    assert [again.next()[1].question for _ in range(7)] == [t.question for t in first]
    with pytest.raises(ValueError, match="leave none for training"):
        TaskSource(0, TaskConfig(name="jsonl", path=p, heldout=10), "p")


@pytest.mark.parametrize("cfg", [
    TaskConfig(name="arithmetic", max_operand=9, ops=["+", "*"], heldout=20),
    TaskConfig(name="word", max_value=3, heldout=30),  # small spaces, so the skipping is exercised
    TaskConfig(name="code", max_value=3, heldout=15),
])
def test_procedural_heldout_is_fixed_distinct_and_never_in_the_training_stream(cfg: TaskConfig):
    held = heldout_tasks(cfg, cfg.heldout, seed=3)
    assert held == heldout_tasks(cfg, cfg.heldout, seed=3)
    assert heldout_tasks(cfg, 5, seed=3) == held[:5]
    questions = {t.question for t in held}
    assert len(questions) == len(held) == cfg.heldout
    src = TaskSource(3, cfg, "p")
    stream = [src.next()[1].question for _ in range(500)]
    assert not questions & set(stream)
    # Without the held-out set the same seed would have produced some of those questions.
    plain = TaskSource(3, cfg.model_copy(update={"heldout": 0}), "p")
    assert questions & {plain.next()[1].question for _ in range(2000)}


def test_heldout_needs_room_in_the_config_and_in_the_task_space():
    with pytest.raises(ValueError, match="task.heldout is 0: set task.heldout >= 5"):
        heldout_tasks(TaskConfig(), 5, seed=0)
    tiny = TaskConfig(max_operand=1, heldout=4)  # 4 questions in all: 0+0, 0+1, 1+0, 1+1
    assert len(heldout_tasks(tiny, 4, seed=0)) == 4
    with pytest.raises(ValueError, match="draws in a row hit the 4 held-out questions"):
        TaskSource(0, tiny, "p")
    with pytest.raises(ValueError, match="only 4 distinct questions"):
        heldout_tasks(TaskConfig(max_operand=1, heldout=5), 5, seed=0)


def test_arithmetic_stream_is_unchanged_without_heldout():
    cfg = TaskConfig(max_operand=9, ops=["+", "-"])
    src, rng = TaskSource(4, cfg, "p"), random.Random(4)
    assert [src.next()[1].question for _ in range(20)] == [make_task(rng, cfg).question for _ in range(20)]
