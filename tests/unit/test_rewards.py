"""Math answers, MARTI reward shaping and the judge's score (pure functions)."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.coordinator.rewards import (
    extract_answer,
    judge_prompt,
    math_equal,
    math_reward,
    parse_judge,
    shape,
)
from shared.kernel.config import ChorusConfig, ConfigError, load_config

unit = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("So the total is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{3}{4}} and later 7", "3/4"),
        ("nested \\boxed{\\text{x}^{2}} box", "x^{2}"),
        ("The answer is 17.", "17"),
        ("Therefore, the final answer is: $-2.5$", "-2.5"),
        ("The answer is 1,234 dollars", "1,234"),
        ("Natalia sold 48 clips.\n#### 72", "72"),
        ("#### 1,000", "1,000"),
        ("First 3 then 4, so 12", "12"),
        ("x = 3 and y = -4", "-4"),
        ("about 3/4 of them", "3/4"),
        ("2023-2020", "2020"),
        ("It costs $18.", "18"),
        ("The answer is yes", "yes"),
        ("no digits here", None),
        ("", None),
        ("cut off \\boxed{12", "12"),
    ],
)
def test_extract_answer_finds_the_final_answer(text: str, answer: str | None):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("pred", "ref", "equal"),
    [
        ("72", "72", True),
        ("1,000", "1000", True),
        ("1000.0", "1,000", True),
        ("0.5", "1/2", True),
        ("\\frac{1}{2}", "0.5", True),
        ("0.333333", "1/3", True),
        ("0.33", "1/3", False),
        ("0.3333333333", "1/3", True),
        ("0.667", "2/3", False),
        ("1000001", "1000000", False),
        ("1000000.5", "1000001", False),
        ("2.50", "5/2", True),
        ("-3", "3", False),
        ("+3", "3", True),
        ("50%", "50", True),
        ("$7$", "7", True),
        ("Yes", "yes", True),
        ("x + 1", "x+1", True),
        ("1,2", "12", False),
        ("1/0", "0", False),
        ("", "", False),
        (None, "3", False),
        ("1e400", "1e400", True),
        ("1e400", "2e400", False),
    ],
)
def test_math_equal_table(pred: str | None, ref: str, equal: bool):
    assert math_equal(pred, ref) is equal


@given(st.integers(-10**9, 10**9))
def test_thousands_commas_and_plain_integers_are_equal(n: int):
    assert math_equal(f"{n:,}", str(n))
    assert extract_answer(f"Step 1: 3 + 4.\nThe answer is {n:,}.") == f"{n:,}"
    assert math_reward(f"so we get \\boxed{{{n}}}", f"{n:,}") == 1.0
    assert math_reward(f"so we get \\boxed{{{n + 1}}}", str(n)) == 0.0


@given(st.integers(-1000, 1000), st.integers(1, 1000))
def test_fractions_equal_their_decimals(num: int, den: int):
    q = round(Fraction(num, den) * 10**12)  # the fraction rounded to 12 decimal places, exactly
    decimal = f"{'-' if q < 0 else ''}{abs(q) // 10**12}.{abs(q) % 10**12:012d}"
    assert math_equal(f"{num}/{den}", decimal)
    assert math_equal(decimal, f"{num}/{den}")
    assert math_equal(f"\\frac{{{num}}}{{{den}}}", f"{num}/{den}")


def test_math_reward_reads_the_last_number_when_nothing_else_marks_the_answer():
    assert math_reward("3 + 4 = 7", "7") == 1.0
    assert math_reward("7 is not it, it is 8", "7") == 0.0
    assert math_reward("I do not know", "7") == 0.0


# --- shaping -------------------------------------------------------------------------------
@given(st.lists(unit, max_size=12), st.sampled_from(["quality", "margin", "none"]), st.sampled_from(["last", "all"]))
def test_alpha_zero_is_the_identity(rewards: list[float], mode: str, scope: str):
    assert shape(rewards, mode, scope, alpha=0.0) == pytest.approx(rewards)


@given(unit, st.integers(1, 10), st.sampled_from(["last", "all"]), st.floats(0, 5))
def test_margin_with_constant_rewards_gives_the_reward(r: float, n: int, scope: str, alpha: float):
    assert shape([r] * n, "margin", scope, alpha) == pytest.approx([r] * n)


@given(st.lists(unit, min_size=1, max_size=12), st.sampled_from(["quality", "margin"]),
       st.sampled_from(["last", "all"]), st.floats(0, 5))
def test_first_turn_has_no_history_and_none_mode_changes_nothing(rewards, mode, scope, alpha):
    assert shape(rewards, mode, scope, alpha)[0] == pytest.approx(rewards[0])
    assert shape(rewards, "none", scope, alpha) == pytest.approx(rewards)


def test_margin_and_quality_follow_marti_equations_with_both_scopes():
    r = [1.0, 0.0, 1.0]
    # all: Q_1 = 1, Q_2 = 0.5; last: Q_1 = 1, Q_2 = 0.
    assert shape(r, "margin", "all", 0.5) == pytest.approx([1.0, 0.0 + 0.5 * (0 - 1), 1.0 + 0.5 * (1 - 0.5)])
    assert shape(r, "margin", "last", 0.5) == pytest.approx([1.0, -0.5, 1.0 + 0.5 * (1 - 0)])
    # quality: Delta = Q R - (1 - Q)(1 - R)
    assert shape(r, "quality", "all", 1.0) == pytest.approx([1.0, 0.0 + (0 - 0 * 1), 1.0 + (0.5 - 0.5 * 0)])
    assert shape(r, "quality", "last", 1.0) == pytest.approx([1.0, 0.0, 1.0 + (0 - 1 * 0)])


@given(st.lists(unit, min_size=2, max_size=10), st.floats(0.01, 2))
def test_quality_rewards_consistency(history: list[float], alpha: float):
    # After a perfect history, a right answer earns more than R and a wrong one is not punished (Q=1).
    perfect = [1.0] * len(history)
    assert shape(perfect + [1.0], "quality", "all", alpha)[-1] == pytest.approx(1.0 + alpha)
    assert shape(perfect + [0.0], "quality", "all", alpha)[-1] == pytest.approx(0.0)
    # After a failed history, a wrong answer is punished below 0.
    failed = [0.0] * len(history)
    assert shape(failed + [0.0], "quality", "all", alpha)[-1] == pytest.approx(-alpha)


def test_shape_rejects_bad_arguments():
    with pytest.raises(ValueError, match="alpha must be >= 0"):
        shape([1.0, 0.0], "margin", "all", -0.1)
    with pytest.raises(ValueError, match="unknown shaping mode 'bonus'"):
        shape([1.0, 0.0], "bonus", "all", 0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown shaping scope 'recent'"):
        shape([1.0, 0.0], "margin", "recent", 0.5)  # type: ignore[arg-type]
    assert shape([], "margin", "all", 0.5) == []


# --- judge ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("Score: 7/10", 0.7),
        ("The answer is fine. Score: 10/10", 1.0),
        ("score = 3", 0.3),
        ("**Score:** 8", 0.8),
        ("Rating: 4 out of 5", 0.8),
        ("I would give it 6/10.", 0.6),
        ("Score: 2/10 at first, but on reflection Score: 9/10", 0.9),
        ("Score: 0", 0.0),
        ("Score: 12/10", None),
        ("Score: 15", None),
        ("no score here", None),
        ("", None),
    ],
)
def test_parse_judge_reads_the_score(text: str, score: float | None):
    got = parse_judge(text)
    assert got == (pytest.approx(score) if score is not None else None)


def test_judge_prompt_shows_question_and_answer_and_asks_for_a_parsable_score():
    prompt = judge_prompt("What is 3+4?", " 7 ")
    assert "What is 3+4?" in prompt and "Answer: 7" in prompt
    assert parse_judge("Score: 5/10") == pytest.approx(0.5) and "Score: N/10" in prompt


# --- config ----------------------------------------------------------------------------------
def test_reward_section_defaults_and_judge_must_be_an_agent(tmp_path):
    base = {"models": {"m": {}}, "agents": {"solver": {"model": "m"}, "verifier": {"model": "m"}}}
    cfg = ChorusConfig(**base)
    assert (cfg.reward.shaping, cfg.reward.scope, cfg.reward.alpha, cfg.reward.judge) == ("none", "all", 0.5, None)
    assert load_config(None, **base, reward={"judge": "verifier", "shaping": "quality"}).reward.judge == "verifier"
    with pytest.raises(ConfigError, match="reward.judge: agent 'critic' is not one of agents"):
        load_config(None, **base, reward={"judge": "critic"})
    with pytest.raises(ConfigError, match="reward.alpha"):
        load_config(None, **base, reward={"alpha": -1})
