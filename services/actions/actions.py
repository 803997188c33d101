"""Registered action kinds: plain functions of a payload dict, run inside a worker subprocess."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

Action = Callable[[dict[str, Any]], dict[str, Any]]

REGISTRY: dict[str, Action] = {}


def register(kind: str) -> Callable[[Action], Action]:
    """Register ``fn`` as the action ``kind``."""

    def wrap(fn: Action) -> Action:
        REGISTRY[kind] = fn
        return fn

    return wrap


def leading_number(text: str) -> str:
    """The signed integer at the start of ``text`` (``"-12ab"`` -> ``"-12"``), or ``""``."""
    end = 1 if text[:1] == "-" else 0
    while end < len(text) and text[end].isdigit():
        end += 1
    number = text[:end]
    return number if number not in ("", "-") else ""


def score_answer(expected: str, response: str, finished: bool) -> dict[str, Any]:
    """Shaped reward: 1.0 exact and EOS-finished, 0.5 right prefix, 0.1 a wrong number, else 0.0."""
    text = response.strip()
    expected = expected.strip()
    if finished and text == expected:
        reward = 1.0
    elif expected and text.startswith(expected):
        reward = 0.5
    elif text[:1].isdigit() or text[:1] == "-":
        reward = 0.1
    else:
        reward = 0.0
    return {"reward": reward, "correct": reward == 1.0, "answer": leading_number(text)}


@register("check_answer")
def check_answer(payload: dict[str, Any]) -> dict[str, Any]:
    """Payload ``{"expected", "response", "finished"}`` -> ``{"reward", "correct", "answer"}``."""
    expected, response = payload.get("expected"), payload.get("response")
    if not isinstance(expected, str) or not isinstance(response, str):
        raise ValueError(
            f"check_answer needs string 'expected' and 'response', got {type(expected).__name__} "
            f"and {type(response).__name__}"
        )
    return score_answer(expected, response, bool(payload.get("finished", False)))


@register("echo")
def echo(payload: dict[str, Any]) -> dict[str, Any]:
    """Return the payload. Test hooks: ``sleep_s`` waits, ``raise`` fails, ``exit_code`` kills the worker,
    ``alloc_mb`` allocates memory (to meet the worker's address-space limit)."""
    if "sleep_s" in payload:
        time.sleep(float(payload["sleep_s"]))
    if "raise" in payload:
        raise RuntimeError(str(payload["raise"]))
    if "exit_code" in payload:
        os._exit(int(payload["exit_code"]))
    if "alloc_mb" in payload:
        blob = bytearray(int(payload["alloc_mb"]) * 1024 * 1024)
        return {"allocated": len(blob)}
    return dict(payload)
