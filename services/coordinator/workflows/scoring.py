"""Per-turn rewards of the built-in workflows: the task's check (an action), or an LLM judge; the vote.

The check depends on the task: compact arithmetic (``3+4=``) goes to ``check_answer``, other answers to
``check_math``, code (a task with ``tests``) to ``run_code``; a dataset task names its own action (``Task.check``,
with ``Task.meta`` in its payload). With ``reward.function`` set, the user's function (action ``compute_score``)
scores every turn; with ``reward.judge`` set, that agent does. A reward function's failed row is a reward error:
its turn is marked ``reward_error`` and its sample dropped (episode.py), never scored 0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from services.coordinator.rewards import extract_answer, judge_prompt, math_equal, parse_judge
from services.coordinator.workflows.api import Context, Turn
from shared.kernel.config import ChorusConfig, TaskConfig

if TYPE_CHECKING:
    from services.coordinator.tasks import Task

T = TypeVar("T")
RUN_ONLY = "assert True\n"  # an answer task's program runs for what it prints; run_code needs one assert
_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL | re.IGNORECASE)


def answer_check(task: TaskConfig) -> str:
    """The action that scores an answer: the leading number of a compact arithmetic completion
    (``check_answer``), else the response's final answer (``check_math``)."""
    return "check_answer" if task.name == "arithmetic" and task.phrasing == "compact" else "check_math"


REWARD_FUNCTION = "compute_score"
DROP_ON_ERROR = frozenset({REWARD_FUNCTION})  # actions whose failed row drops the sample instead of scoring 0


def check_request(cfg: ChorusConfig, task: Task, text: str, finished: bool) -> tuple[str, dict[str, Any]]:
    """The action and payload that score ``text`` as an answer to ``task`` (code tasks with ``tests``: see
    :func:`run_code`)."""
    meta = getattr(task, "meta", None) or {}
    if cfg.reward.function is not None:  # the ground truth as the row has it (a list stays a list)
        return REWARD_FUNCTION, {"function": cfg.reward.function,
                                 "data_source": meta.get("data_source", cfg.task.name), "solution_str": text,
                                 "ground_truth": meta.get("ground_truth", task.answer),
                                 "extra_info": meta.get("extra_info")}
    payload: dict[str, Any] = {"expected": task.answer, "response": text, "finished": bool(finished)}
    if cfg.reward.partial_credit:
        payload["partial_credit"] = True
    own = getattr(task, "check", None)
    if own == "":  # datasets.UNGRADED: `chorus check` refuses such a dataset without reward.function
        raise ValueError(f"task {task.task_id}: data_source {meta.get('data_source')!r} has no built-in grader; set "
                         "reward.function")
    if own is not None:
        return own, {**{k: v for k, v in meta.items() if k != "ground_truth"}, **payload}
    return answer_check(cfg.task), payload


@dataclass
class Score:
    reward: float  # in [0, 1]
    correct: bool
    answer: str
    error: str | None = None  # the reward could not be computed (the sample is dropped)


def tests_of(task: Task) -> str | None:
    """The task's assert tests; None for a task checked by its answer."""
    tests = getattr(task, "tests", None)
    return tests if isinstance(tests, str) and tests.strip() else None


def is_code_task(task: Task) -> bool:
    return tests_of(task) is not None


def extract_code(text: str) -> str:
    """The last fenced Python block of ``text`` (an unclosed one counts), else the whole text."""
    blocks = _FENCE.findall(text)
    return (blocks[-1] if blocks else text).strip("\n")


def reward_value(result: dict[str, Any]) -> float:
    """A check result's reward in [0, 1]: ``reward``, else ``passed / total`` of a test run; 0 when neither."""
    value = result.get("reward")
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return min(1.0, max(0.0, float(value)))
    passed, total = result.get("passed"), result.get("total")
    if isinstance(passed, int) and isinstance(total, int) and total > 0:
        return min(1.0, max(0.0, passed / total))
    return 0.0


def unclamped(kind: str, result: dict[str, Any]) -> float | None:
    """A reward function's reward as it returned it (the worker checked it is finite; verl does not clamp
    either); None for the built-in checks, whose rewards are kept in [0, 1]."""
    value = result.get("reward")
    if kind == REWARD_FUNCTION and isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def reward_error(kind: str, result: dict[str, Any]) -> str | None:
    """Why a reward function's row has no reward (the actions worker's error); None for a scored row."""
    error = result.get("action_error")
    return str(error) if kind in DROP_ON_ERROR and error else None


def score_of(result: dict[str, Any], text: str, kind: str = "") -> Score:
    error = reward_error(kind, result)
    if error is not None:
        return Score(0.0, False, extract_answer(text) or "", error)
    reward = unclamped(kind, result)
    reward = reward_value(result) if reward is None else reward
    answer = result.get("answer")
    if not isinstance(answer, str) or not answer:
        answer = extract_answer(text) or ""
    return Score(reward, bool(result.get("correct", reward >= 1.0)), answer)


def printed(result: dict[str, Any]) -> str:
    """What a code run printed."""
    out = result.get("stdout")
    return out if isinstance(out, str) else ""


def tool_text(result: dict[str, Any]) -> str:
    """What a code run shows the next agent: its output and its error, if any."""
    parts = [printed(result).strip()]
    error = result.get("error")
    if isinstance(error, str) and error:
        parts.append(f"error: {error}")
    return "\n".join(p for p in parts if p)


async def run_code(ctx: Context, task: Task, texts: Sequence[str]) -> list[dict[str, Any]]:
    """Run the code in each text against the task's tests (an answer task's program only runs: its output is
    the answer)."""
    tests = tests_of(task) or RUN_ONLY
    return await ctx.act("run_code", [{"code": extract_code(t), "tests": tests} for t in texts])


async def check(ctx: Context, task: Task, texts: Sequence[str], finished: Sequence[bool]) -> list[Score]:
    """The task's check of each text (for a code task the text holds the code)."""
    if not texts:
        return []
    judge = ctx.cfg.reward.judge
    if judge is not None:
        return await judge_scores(ctx, judge, task.question, texts)
    if is_code_task(task) and ctx.cfg.reward.function is None:
        kind = "run_code"
        results = await run_code(ctx, task, texts)
    else:
        requests = [check_request(ctx.cfg, task, t, f) for t, f in zip(texts, finished, strict=True)]
        kind = requests[0][0]
        results = await ctx.act(kind, [p for _, p in requests])
    return [score_of(r, t, kind) for r, t in zip(results, texts, strict=True)]


async def judge_scores(ctx: Context, judge: str, question: str, texts: Sequence[str]) -> list[Score]:
    """The judge agent's score of each text; an unreadable verdict scores 0. Judge turns are not trained."""
    rows = await ctx.generate(judge, [judge_prompt(question, t) for t in texts])
    out = []
    for row, text in zip(rows, texts, strict=True):
        value = parse_judge(row.text)
        reward = 0.0 if value is None else min(1.0, max(0.0, value))
        out.append(Score(reward, reward >= 1.0, extract_answer(text) or ""))
    return out


async def score_turns(ctx: Context, task: Task, turns: Sequence[Turn]) -> None:
    """Set every turn's ``reward`` (and ``answer`` / ``correct`` in its metadata) from one batched check.

    A code turn of an answer task is scored by what its program printed; of a code task by its test run.
    """
    todo: list[tuple[Turn, str, bool]] = []
    for t in turns:
        meta = t["metadata"]
        tool = meta.get("tool_result")
        if tool is not None and is_code_task(task) and ctx.cfg.reward.judge is None and ctx.cfg.reward.function is None:
            s = score_of(tool, t["agent_output"])
            t["reward"], meta["answer"], meta["correct"] = s.reward, s.answer, s.correct
            continue
        text = printed(tool) if tool is not None else t["agent_output"]
        todo.append((t, text, bool(meta.get("finished", True))))
    scores = await check(ctx, task, [x[1] for x in todo], [x[2] for x in todo])
    for (t, _, _), s in zip(todo, scores, strict=True):
        t["reward"] = s.reward
        t["metadata"]["answer"], t["metadata"]["correct"] = s.answer, s.correct
        if s.error is not None:
            t["metadata"]["reward_error"] = s.error


def plurality(votes: Sequence[tuple[str, T]]) -> T | None:
    """The first item holding the most common answer among ``(answer, item)`` votes (answers equal by value:
    ``math_equal``); ties go to the answer seen first; empty answers do not vote; None when nobody voted."""
    clusters: list[tuple[str, list[T]]] = []
    for answer, item in votes:
        if not answer:
            continue
        for ref, members in clusters:
            if answer == ref or math_equal(answer, ref):
                members.append(item)
                break
        else:
            clusters.append((answer, [item]))
    if not clusters:
        return None
    best = max(len(m) for _, m in clusters)
    return next(m[0] for _, m in clusters if len(m) == best)


def majority(turns: Sequence[Turn]) -> Turn:
    """The turn holding the most common answer (equal answers by value); ties go to the earliest turn.
    Turns without an answer do not vote; if none has one, the first turn stands."""
    if not turns:
        raise ValueError("majority vote over no turns")
    winner = plurality([(t["metadata"].get("answer") or extract_answer(t["agent_output"]) or "", t) for t in turns])
    return turns[0] if winner is None else winner

