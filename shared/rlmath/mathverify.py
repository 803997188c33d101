"""Answers judged as math, by value, with Hugging Face's math-verify (what the anchors' MATH recipes use): LaTeX,
fractions, radicals, sets, intervals, ``\\boxed{}``. The extraction follows verl's ``math_verify`` reward: the
ground truth is read as LaTeX inside ``\\boxed{}``, the response as an expression or LaTeX.

math-verify bounds its parsing and comparison with ``signal.alarm``, which works only in a process's main thread
(the actions workers run their actions there); elsewhere it runs without its own timeout.
"""

from __future__ import annotations

import re
import threading
from typing import Any

TIMEOUT_S = 5  # math-verify's own limit on each of parsing and comparing (whole seconds: signal.alarm)
_INTEGER = re.compile(r"[-+]?\d+")


def is_integer(text: str) -> bool:
    """A plain whole number (``"42"``, ``"-7"``): judged exactly, never by math-verify."""
    return _INTEGER.fullmatch(text.strip()) is not None


def _configs() -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return (LatexExtractionConfig(),), (ExprExtractionConfig(), LatexExtractionConfig())


def equivalent(expected: str, response: str, timeout_s: int = TIMEOUT_S) -> tuple[bool | None, str]:
    """(whether ``response``'s final answer equals ``expected`` by value, the answer read from it). None instead of
    a bool when math-verify ran out of its time."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    limit = max(1, int(timeout_s)) if threading.current_thread() is threading.main_thread() else None
    gold_cfg, pred_cfg = _configs()
    try:
        gold = parse("\\boxed{" + expected.strip() + "}", extraction_config=gold_cfg, parsing_timeout=limit,
                     raise_on_error=True)
        pred = parse(response, extraction_config=pred_cfg, parsing_timeout=limit, raise_on_error=True)
        answer = str(pred[-1]) if pred else ""
        if not gold or not pred:
            return False, answer
        return bool(verify(gold, pred, timeout_seconds=limit, raise_on_error=True)), answer
    except TimeoutException:
        return None, ""
    except Exception:  # noqa: BLE001 - whatever sympy makes of a malformed answer, it is not equal
        return False, ""
