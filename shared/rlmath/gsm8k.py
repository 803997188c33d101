"""GSM8K answers: the reference after ``####`` and a response's final number, as GSM8K graders extract them.

The response's answer is an explicit one when present, the last of ``#### N``, ``\\boxed{N}`` or "the answer is
N" (in that order of preference, like verl's gsm8k reward and lm-eval-harness's strict match), else the last
number in the text (lm-eval's flexible extract). Numbers lose ``$``, thousands commas, a trailing period and
trailing zeros of a decimal; units and ``%`` after them are ignored. A match is exact numeric equality.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number: optional sign and $, digits with thousands commas only in groups of three ("1,000"; "1,2,3" is a list of
# three numbers), optional decimals (or a bare ".5").
_NUMBER = r"-?\$?\s?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d,]*\d)|\.\d+)"
MINUSES = str.maketrans({"\u2212": "-", "\u2013": "-", "\ufe63": "-", "\uff0d": "-"})  # minus sign, en dash, ...
NUMBER = re.compile(_NUMBER)
_HASHES = re.compile(r"####\s*(" + _NUMBER + ")")
_BOXED = re.compile(r"\\boxed\s*\{\s*(?:\\text\{)?\s*(" + _NUMBER + ")")
_SAYS = re.compile(r"answer\s+is\s*:?\s*(?:\*\*)?\s*(" + _NUMBER + ")", re.IGNORECASE)


def normalize(number: str) -> str | None:
    """``"$1,234.50"`` -> ``"1234.5"``, ``"18.0"`` -> ``"18"``, ``"-.5"`` -> ``"-0.5"``; None if not a number."""
    text = number.translate(MINUSES).strip().replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def reference_answer(solution: str) -> str:
    """The reference number of a GSM8K solution: what follows its last ``####`` (``"#### 1,000"`` -> ``"1000"``);
    the text itself when it has no ``####``; ValueError if that is not a number."""
    text = solution.rsplit("####", 1)[1] if "####" in solution else solution
    value = normalize(text)
    if value is None:
        raise ValueError(f"a GSM8K answer must end in '#### <number>', got {text.strip()!r:.80}")
    return value


def extract_answer(response: str) -> str | None:
    """The final answer of a response, normalised (see the module docstring); None when it holds no number."""
    response = response.translate(MINUSES)
    for pattern in (_HASHES, _BOXED, _SAYS):
        found = pattern.findall(response)
        if found:
            return normalize(found[-1])
    numbers = NUMBER.findall(response)
    return normalize(numbers[-1]) if numbers else None


def score(response: str, reference: str) -> tuple[float, str]:
    """(1.0 if the response's final answer equals ``reference`` as a number else 0.0, the answer extracted)."""
    answer = extract_answer(response)
    expected = normalize(reference)
    if answer is None or expected is None:
        return 0.0, answer or ""
    return (1.0 if Decimal(answer) == Decimal(expected) else 0.0), answer
