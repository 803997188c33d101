"""The user's reward function (``reward.function: path.py:compute_score``, verl's signature), imported once per
worker and cached by path and mtime, and its return value checked: a finite number, or a dict whose ``score`` is
one (its other numeric keys are reported). Anything else is an error the coordinator drops the sample for."""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

_CACHE: dict[str, tuple[float, Callable[..., Any]]] = {}


def load(spec: str) -> Callable[..., Any]:
    """The function ``name`` of ``path.py:name``, imported again only when the file changed."""
    path_text, _, name = spec.rpartition(":")
    path = Path(path_text).expanduser()
    try:
        mtime = os.stat(path).st_mtime
    except OSError as exc:
        raise ValueError(f"reward.function: cannot read {path}: {exc.strerror or exc} (a relative path is "
                         "resolved against the config file's directory, then the working directory)") from None
    cached = _CACHE.get(spec)
    if cached is not None and cached[0] == mtime:
        return cached[1]
    module_spec = importlib.util.spec_from_file_location(f"chorus_reward_{abs(hash(spec)):x}", path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"reward.function: {path} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        import inspect

        defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__)
        raise ValueError(f"reward.function: {path} defines no function {name!r} (its functions: "
                         f"{', '.join(defined) or 'none'})")
    _CACHE[spec] = (mtime, fn)
    return fn


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def checked(value: Any, spec: str) -> dict[str, Any]:
    """``{"reward", "correct", "scores"}`` of a return value; ValueError saying what came instead."""
    extra: dict[str, float] = {}
    if isinstance(value, dict):
        score = _finite(value.get("score"))
        extra = {k: float(v) for k, v in value.items() if k != "score" and _finite(v) is not None}
        what = f"a dict whose 'score' is {value.get('score')!r}"
    else:
        score = _finite(value)
        what = f"{type(value).__name__} {value!r:.80}"
    if score is None:
        raise ValueError(f"reward.function {spec} returned {what}: expected a finite number, or a dict with a "
                         "finite number under 'score'")
    return {"reward": score, "correct": score >= 1.0, "scores": extra}


def compute(payload: dict[str, Any]) -> dict[str, Any]:
    """Call the reward function on one payload ``{"function", "data_source", "solution_str", "ground_truth",
    "extra_info"}``; what it raises is raised (the row is an error with the reason)."""
    spec = payload.get("function")
    if not isinstance(spec, str):
        raise ValueError(f"compute_score needs the string 'function', got {type(spec).__name__}")
    fn = load(spec)
    try:
        value = fn(payload.get("data_source"), payload.get("solution_str"), payload.get("ground_truth"),
                   extra_info=payload.get("extra_info"))
    except Exception as exc:  # the user's code: any failure is this row's error, with its reason
        raise ValueError(f"reward.function {spec} raised {type(exc).__name__}: {exc}") from None
    return checked(value, spec)
