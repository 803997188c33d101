"""The final answer of a math response and numeric equivalence of answers (pure functions, no I/O).

Shared by the coordinator (rewards) and the actions service (the ``check_math`` action).
"""

from __future__ import annotations

import re
from fractions import Fraction

from shared.rlmath.gsm8k import MINUSES

# A number as people write it: "-1,234.5", "+3", ".5", "3/4" (thousands commas only in groups of three).
NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:/\d+)?"
_NUMBER_RE = re.compile(rf"(?<![\w.])(?:{NUMBER})")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*(?:[:=]\s*)?", re.IGNORECASE)
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
REL_TOL = Fraction(1, 10**6)


def _boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces matched."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: the response was cut off inside the box


def _numbers(text: str) -> list[str]:
    return [m.group(0) for m in _NUMBER_RE.finditer(text) if any(c.isdigit() for c in m.group(0))]


def clean(answer: str) -> str:
    """Strip LaTeX wrapping and punctuation around an answer: ``$\\frac{1}{2}$.`` -> ``1/2``."""
    s = answer.strip().translate(MINUSES)
    for _ in range(3):  # \frac inside \text and the like
        s = _FRAC.sub(r"(\1)/(\2)", s)
        s = _TEXT.sub(r"\1", s)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\%", "%", "$", "^\\circ", "^{\\circ}", "\\$"):
        s = s.replace(token, "")
    s = re.sub(r"\((-?\d+(?:\.\d+)?)\)/\((\d+(?:\.\d+)?)\)", r"\1/\2", s)  # (1)/(2) -> 1/2
    return s.strip().rstrip(".").strip()


def extract_answer(text: str) -> str | None:
    """The final answer of a response: ``\\boxed{}``, then "answer is X", then ``#### X``, else the last number."""
    text = text.translate(MINUSES)
    boxed = _boxed(text)
    if boxed is not None:
        return clean(boxed) or None
    said = list(_ANSWER_IS.finditer(text))
    if said:
        rest = text[said[-1].end():]
        line = clean(rest.split("\n", 1)[0])
        nums = _numbers(line)
        if nums:
            return nums[0]
        if line:
            return line
    if "####" in text:
        tail = clean(text.rsplit("####", 1)[1].split("\n", 1)[0])
        if tail:
            return tail
    nums = _numbers(clean(text))
    return nums[-1] if nums else None


def to_number(answer: str) -> Fraction | None:
    """The exact value of a numeric answer (``"1,000"``, ``"-2.5"``, ``"3/4"``, ``"\\frac{3}{4}"``), else None."""
    s = clean(answer).replace(" ", "")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if s.startswith("+"):
        s = s[1:]
    if not s or "," in s:
        return None
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            value = Fraction(num) / Fraction(den)
        else:
            value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def _places(answer: str) -> int | None:
    """Digits after the decimal point of a decimal answer, None for an integer or a fraction."""
    text = clean(answer)
    match = re.search(r"\.(\d+)", text)
    return len(match.group(1)) if match and "/" not in text else None


def _normalise(answer: str) -> str:
    return re.sub(r"\s+", "", clean(answer)).lower()


def math_equal(pred: str | None, ref: str) -> bool:
    """Numeric equality (a decimal matches the value it rounds), else equality of the normalised strings."""
    if pred is None:
        return False
    a, b = to_number(pred), to_number(ref)
    if a is not None and b is not None:
        places = [p for p in (_places(pred), _places(ref)) if p is not None]
        if not places or a == b:
            return a == b  # integers and fractions are exact
        # A decimal stands for its value rounded to its places ("0.333333" is 1/3); the relative bound keeps
        # a short decimal from passing for a fraction ("0.33" is not 1/3).
        half_unit = Fraction(1, 2 * 10 ** min(places))
        return abs(a - b) <= min(half_unit, REL_TOL * max(Fraction(1), abs(b)))
    return _normalise(pred) == _normalise(ref) != ""
