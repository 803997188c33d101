"""Arithmetic tasks: deterministic from a seed, answers checkable and reduced as configured."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.coordinator.tasks import TaskSource, make_task, solve
from shared.config import TaskConfig


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
