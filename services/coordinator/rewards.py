"""Rule-based rewards, MARTI reward shaping and an LLM-judge prompt (pure functions, no NATS).

Shaping follows MARTI section 2.2.1: each turn's verifier reward R_t is adjusted by the agent's historical
performance Q_t over earlier turns, R~_t = R_t + alpha * Delta_t.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from shared.rlmath.mathanswer import extract_answer, math_equal

__all__ = ["extract_answer", "judge_prompt", "math_equal", "math_reward", "parse_judge", "shape"]

ShapingMode = Literal["none", "quality", "margin"]
Scope = Literal["last", "all"]
JUDGE_SCALE = 10


def math_reward(response: str, ref: str) -> float:
    """1.0 when the final answer of ``response`` equals ``ref`` (numerically or as normalised text), else 0.0."""
    return 1.0 if math_equal(extract_answer(response), ref) else 0.0


def history(rewards: Sequence[float], t: int, scope: Scope) -> float:
    """Q_t: the mean of R_k over the scope of earlier turns, H_t = {t-1} ("last") or {0..t-1} ("all")."""
    if t < 1:
        raise ValueError(f"turn {t} has no earlier turns: Q_t needs t >= 1")
    if scope == "last":
        return float(rewards[t - 1])
    if scope == "all":
        return sum(rewards[:t]) / t
    raise ValueError(f"unknown shaping scope {scope!r}: expected 'last' or 'all'")


def shape(rewards: Sequence[float], mode: ShapingMode, scope: Scope = "all", alpha: float = 0.5) -> list[float]:
    """MARTI shaping of one agent's turn rewards R_0..R_T; the first turn has no history, so R~_0 = R_0.

    margin: Delta_t = R_t - Q_t (reward for beating one's own record);
    quality: Delta_t = Q_t * R_t - (1 - Q_t)(1 - R_t) (reward for being consistently right).
    """
    if alpha < 0:
        raise ValueError(f"shaping alpha must be >= 0, got {alpha}")
    if mode not in ("none", "quality", "margin"):
        raise ValueError(f"unknown shaping mode {mode!r}: expected 'none', 'quality' or 'margin'")
    r = [float(x) for x in rewards]
    if mode == "none" or not r:
        return r
    shaped = [r[0]]
    for t in range(1, len(r)):
        q = history(r, t, scope)  # Q_t, eq. (1)
        delta = r[t] - q if mode == "margin" else q * r[t] - (1 - q) * (1 - r[t])  # eq. (2) / (3)
        shaped.append(r[t] + alpha * delta)
    return shaped


def judge_prompt(question: str, response: str) -> str:
    """What a judge agent reads: the question, the response, and how to answer with a score."""
    return (
        "You are grading an answer to a question.\n"
        f"Question: {question.strip()}\n"
        f"Answer: {response.strip()}\n"
        f"Rate how correct and helpful the answer is on a scale from 0 to {JUDGE_SCALE}. "
        f"Reply with one line of the form 'Score: N/{JUDGE_SCALE}'."
    )


_NUM = r"(\d+(?:\.\d+)?)"
_OUT_OF = re.compile(rf"{_NUM}\s*(?:/|out\s+of)\s*{_NUM}", re.IGNORECASE)
_SCORE = re.compile(rf"(?:score|rating|grade)\s*(?:is|:|=)?\s*\**\s*{_NUM}(?:\s*(?:/|out\s+of)\s*{_NUM})?",
                    re.IGNORECASE)


def _ratio(num: str, den: str | None) -> float | None:
    value, scale = float(num), float(den) if den is not None else float(JUDGE_SCALE)
    if scale <= 0 or not 0 <= value <= scale:
        return None
    return value / scale


def parse_judge(text: str) -> float | None:
    """The judge's score in [0, 1]: the last "Score: 7/10" / "Score: 7" (out of 10) / "7 out of 10", else None."""
    scored = list(_SCORE.finditer(text))
    if scored:
        return _ratio(scored[-1].group(1), scored[-1].group(2))
    ratios = list(_OUT_OF.finditer(text))
    if ratios:
        return _ratio(ratios[-1].group(1), ratios[-1].group(2))
    return None
