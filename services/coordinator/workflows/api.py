"""What a workflow sees: ``ctx.generate`` / ``ctx.act`` over the run's agents, and the trajectory it returns.

A workflow is ``async def workflow(ctx: Context, task: Task) -> Trajectory`` and plays ONE rollout of a task;
the coordinator runs ``group_size`` of them at once. Calls that the concurrent rollouts make while all of
them are waiting are merged into one request per (model, adapter, sampling) or action kind, so a turn of G
rollouts costs one generation request, as a hand-batched workflow would.

With ``workflow.sampling: tree`` the coordinator plays the workflow once per task instead, and every
``ctx.generate`` samples G candidates per prompt, scores them with the task's check and continues from the best
(AT-GRPO's tree-structured sampling); the candidates of each step are kept as that step's group.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NotRequired, Protocol, TypedDict

from shared.kernel.config import AgentConfig, ChorusConfig
from shared.models.loading import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from services.coordinator.tasks import Task

BATCH_WINDOW_S = 0.02  # longest wait for rollouts busy elsewhere before a partial batch goes out
# Prompts and answers up to this size are (de)tokenized on the event loop: that takes microseconds, and the hop
# to a worker thread and back (two GIL hand-offs) costs more; longer ones go to a thread.
INLINE_CHARS = 4096
INLINE_TOKENS = 1024


async def _maybe_in_thread(fn: Callable[[], Any], small: bool) -> Any:
    return fn() if small else await asyncio.to_thread(fn)


class Abandon(Exception):
    """A request failed for good (attempts exhausted or the service is stopping): drop the task."""


class Stopping(Abandon):
    """A request left unanswered because this service is stopping (the run's end, a shutdown): the task is left,
    not counted as a failure of the services it asked."""


class WorkflowError(ValueError):
    """A workflow failed or returned something that is not a trajectory; the task is dropped and counted."""


class WorkflowTimeout(WorkflowError):
    """One call of a workflow ran past ``workflow.step_timeout_s`` and was cancelled."""


@dataclass
class GenResult:
    """One generated row: response ids (EOS included when it stopped), behaviour log-probs, the version."""

    ids: list[int]
    logprobs: list[float]
    finished: bool  # stopped on EOS (not by the length limit)
    version: int  # of the oldest token
    seconds: float = 0.0
    text: str = ""  # the decoded response (set by the context)
    prompt_ids: list[int] = field(default_factory=list)
    agent: str = ""
    gen_id: int = -1  # index among this rollout's generations; a turn names it in metadata["gen_id"]
    token_versions: list[int] | None = None  # per id, when a sync interrupted the row (else all ``version``)


class Generate(Protocol):
    """The rollouters of ``model`` (``stop`` strings are passed only when a workflow asks for them)."""

    async def __call__(
        self, model: str, adapter: str | None, prompts: list[list[int]], *,
        max_new_tokens: int, temperature: float, top_p: float,
    ) -> list[GenResult]: ...


Act = Callable[[str, list[dict[str, Any]]], Awaitable[list[dict[str, Any]]]]
# Scores candidate answers of a tree step (texts, finished flags) with the task's check; one reward each.
StepScorer = Callable[["Context", "Task", list[str], list[bool]], Awaitable[list[float]]]


@dataclass
class TreeStep:
    """One agent step of tree sampling: the G candidates of one prompt, their step rewards, the one kept."""

    candidates: list[GenResult]
    rewards: list[float]
    best: int


def best_of(rewards: Sequence[float]) -> int:
    """The index of the highest reward; ties go to the lowest index."""
    if not rewards:
        raise ValueError("best_of over no candidates")
    return max(range(len(rewards)), key=lambda i: (rewards[i], -i))


class Turn(TypedDict):
    """One agent turn, as in MARTI's abstract workflow, plus the turn's reward."""

    turn_id: int
    agent_index: int
    agent_name: str
    agent_role: str
    agent_input: str
    agent_output: str
    metadata: dict[str, Any]
    reward: NotRequired[float]


class Trajectory(TypedDict):
    prompt: str
    label: str
    trajectory: list[Turn]
    final_reward: float
    final_answer: NotRequired[str]


class Workflow(Protocol):
    async def __call__(self, ctx: Context, task: Task) -> Trajectory: ...


class Tokenizers:
    """One tokenizer per model, loaded once in a worker thread (an HF tokenizer load reads files)."""

    def __init__(self, cfg: ChorusConfig, preset: Mapping[str, Tokenizer] | None = None) -> None:
        self.cfg = cfg
        self._loaded: dict[str, Tokenizer] = dict(preset or {})
        self._loading: dict[str, asyncio.Future[Tokenizer]] = {}

    async def get(self, model: str) -> Tokenizer:
        if model in self._loaded:
            return self._loaded[model]
        fut = self._loading.get(model)
        if fut is None:
            fut = self._loading[model] = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, self.cfg, model))
        try:
            tok = await asyncio.shield(fut)
        except BaseException:
            if fut.done():
                self._loading.pop(model, None)  # a failed load is tried again by the next caller
            raise
        self._loaded[model] = tok
        return tok


@dataclass
class _Call:
    rollout: int
    items: list[Any]
    future: asyncio.Future[list[Any]]
    settled: bool = False


class Batcher:
    """Merges the calls of one task's concurrent rollouts: a batch goes out once every rollout is waiting
    (on a batched call or finished), or after ``window_s`` when some rollout is busy elsewhere."""

    def __init__(self, rollouts: int, window_s: float = BATCH_WINDOW_S) -> None:
        self.rollouts = rollouts
        self.window_s = window_s
        self.waiting = [0] * rollouts
        self.done = [False] * rollouts
        self.pending: dict[Hashable, tuple[Callable[[list[Any]], Awaitable[list[Any]]], list[_Call]]] = {}
        self.batches = 0
        self._flush_soon: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._running: set[asyncio.Task[None]] = set()

    async def call(self, rollout: int, key: Hashable, items: list[Any],
                   run: Callable[[list[Any]], Awaitable[list[Any]]]) -> list[Any]:
        """``run`` over the merged items of every call with ``key``; returns this call's share, in order."""
        call = _Call(rollout, list(items), asyncio.get_running_loop().create_future())
        self.pending.setdefault(key, (run, []))[1].append(call)
        self.waiting[rollout] += 1
        self._schedule()
        try:
            return await call.future
        finally:
            if not call.settled:  # cancelled before its batch answered
                self._settle(call)
                calls = self.pending.get(key, (run, []))[1]
                if call in calls:
                    calls.remove(call)

    def finish(self, rollout: int) -> None:
        """Rollout ``rollout`` returned: the others no longer wait for it."""
        self.done[rollout] = True
        self._schedule()

    async def close(self) -> None:
        """Cancel batches still running (the episode failed)."""
        for t in list(self._running):
            t.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        for handle in (self._flush_soon, self._timer):
            if handle is not None:
                handle.cancel()

    # --- internals ------------------------------------------------------------------------
    def _settle(self, call: _Call) -> None:
        call.settled = True
        self.waiting[call.rollout] -= 1

    def _schedule(self) -> None:
        if not self.pending:
            return
        loop = asyncio.get_running_loop()
        if all(w > 0 or d for w, d in zip(self.waiting, self.done, strict=True)):
            # Flush at the end of this loop iteration: rollouts woken together get to add their calls first.
            if self._flush_soon is None:
                self._flush_soon = loop.call_soon(self._flush)
        elif self._timer is None:
            self._timer = loop.call_later(self.window_s, self._flush)

    def _flush(self) -> None:
        for handle in (self._flush_soon, self._timer):
            if handle is not None:
                handle.cancel()
        self._flush_soon = self._timer = None
        pending, self.pending = self.pending, {}
        for run, calls in pending.values():
            if calls:
                task = asyncio.get_running_loop().create_task(self._run(run, calls))
                self._running.add(task)
                task.add_done_callback(self._running.discard)

    async def _run(self, run: Callable[[list[Any]], Awaitable[list[Any]]], calls: list[_Call]) -> None:
        self.batches += 1
        items = [item for c in calls for item in c.items]
        try:
            results = await run(items)
            if len(results) != len(items):
                raise ValueError(f"expected {len(items)} rows, got {len(results)}")
        except Exception as exc:
            for c in self._open(calls):
                c.future.set_exception(exc)
            return
        except BaseException:
            for c in self._open(calls):
                c.future.cancel()
            raise
        shares, start = {}, 0
        for c in calls:
            shares[id(c)], start = results[start:start + len(c.items)], start + len(c.items)
        for c in self._open(calls):
            c.future.set_result(shares[id(c)])
        self._schedule()

    def _open(self, calls: list[_Call]) -> list[_Call]:
        """Settle the calls whose caller still waits and return them (the caller runs again from here on)."""
        out = []
        for c in calls:
            if not c.settled:
                self._settle(c)
            if not c.future.done():
                out.append(c)
        return out


class Runtime:
    """What the G rollouts of one task share: the agents, the bus callables, tokenizers and the batcher.

    With ``tree`` set the task is played as one tree-sampled rollout whose steps ``tree`` scores."""

    def __init__(self, cfg: ChorusConfig, task: Task, generate: Generate, act: Act, tokenizers: Tokenizers,
                 window_s: float = BATCH_WINDOW_S, tree: StepScorer | None = None) -> None:
        self.cfg = cfg
        self.task = task
        self._generate = generate
        self._act = act
        self.tokenizers = tokenizers
        self.tree = tree
        self.batcher = Batcher(1 if tree is not None else cfg.workflow.group_size, window_s)
        self.tokens_generated = 0  # response tokens of every row generated for this task (tree candidates, judge)

    def agent(self, name: str) -> AgentConfig:
        a = self.cfg.agents.get(name)
        if a is None:
            raise WorkflowError(f"unknown agent {name!r}: expected one of agents {sorted(self.cfg.agents)}")
        return a

    def gen_runner(self, model: str, adapter: str | None,
                   sampling: dict[str, Any]) -> Callable[[list[Any]], Awaitable[list[GenResult]]]:
        async def run(items: list[tuple[str, str | list[int]]]) -> list[GenResult]:
            tok = await self.tokenizers.get(model)
            chars = sum(len(system or "") + len(p) for system, p in items)
            prompts = await _maybe_in_thread(
                lambda: [tok.chat(system, p) if isinstance(p, str) else [int(i) for i in p] for system, p in items],
                chars <= INLINE_CHARS)
            t0 = time.monotonic()
            rows = await self._generate(model, adapter, prompts, **sampling)
            if len(rows) != len(prompts):
                raise ValueError(f"{model}: expected {len(prompts)} rows, got {len(rows)}")
            seconds = time.monotonic() - t0
            self.tokens_generated += sum(len(r.ids) for r in rows)
            texts = await _maybe_in_thread(lambda: [tok.decode(r.ids) for r in rows],
                                           sum(len(r.ids) for r in rows) <= INLINE_TOKENS)
            for row, ids, text in zip(rows, prompts, texts, strict=True):
                row.prompt_ids, row.text = ids, text
                row.seconds = row.seconds or seconds
            return rows

        return run

    def act_runner(self, kind: str) -> Callable[[list[Any]], Awaitable[list[dict[str, Any]]]]:
        async def run(payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
            results = await self._act(kind, payloads)
            if len(results) != len(payloads):
                raise ValueError(f"{kind}: expected {len(payloads)} rows, got {len(results)}")
            return results

        return run


class Context:
    """One rollout's handle on the run: generate with an agent, run an action, read the config.

    ``tree=False`` makes a plain context even when the runtime tree-samples (the one tree scoring runs on)."""

    def __init__(self, runtime: Runtime, rollout: int, tree: bool = True) -> None:
        self._rt = runtime
        self.rollout = rollout
        self.generations: list[GenResult] = []  # in call order; turns point at them by gen_id
        self.tree_steps: dict[int, TreeStep] = {}  # tree sampling: gen_id of a kept row -> its step
        self._tree = tree and runtime.tree is not None

    @property
    def cfg(self) -> ChorusConfig:
        return self._rt.cfg

    @property
    def task(self) -> Task:
        return self._rt.task

    @property
    def group_size(self) -> int:
        return self._rt.cfg.workflow.group_size

    @property
    def agents(self) -> list[str]:
        """The workflow's participants, in order (``workflow.agents``)."""
        return list(self._rt.cfg.workflow.agents)

    async def generate(self, agent: str, prompts: Sequence[str] | Sequence[Sequence[int]], *,
                       max_new_tokens: int | None = None, temperature: float | None = None,
                       top_p: float | None = None, stop: Sequence[str] = ()) -> list[GenResult]:
        """One answer of ``agent`` per prompt: a string goes through the model's chat template with the agent's
        system prompt; a list of ints is sent as token ids unchanged. ``stop`` strings end a row early."""
        a = self._rt.agent(agent)
        if isinstance(prompts, str) or not prompts:
            raise WorkflowError(f"generate({agent!r}): expected a non-empty list of prompts, got {prompts!r}")
        wf = self.cfg.workflow
        sampling: dict[str, Any] = {
            "max_new_tokens": wf.max_new_tokens if max_new_tokens is None else max_new_tokens,
            "temperature": wf.temperature if temperature is None else temperature,
            "top_p": wf.top_p if top_p is None else top_p,
        }
        if stop:
            sampling["stop"] = list(stop)
        key = ("generate", a.model, a.adapter, *(tuple(v) if isinstance(v, list) else v for v in sampling.values()))
        # The judge scores and is not trained: its calls are never tree-sampled.
        n = self.group_size if self._tree and agent != self.cfg.reward.judge else 1
        items = [(a.prompt, p) for p in prompts for _ in range(n)]
        rows = await self._rt.batcher.call(self.rollout, key, items, self._rt.gen_runner(a.model, a.adapter, sampling))
        rows = [_copy(row, agent) for row in rows]  # a workflow may keep and edit its own
        if n == 1:
            return [self._keep(row) for row in rows]
        return await self._best_of_each(rows, n)

    async def act(self, kind: str, payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run the action ``kind`` (``check_answer``, ``run_code``, ...) on each payload; one result each."""
        if not payloads:
            return []
        return await self._rt.batcher.call(self.rollout, ("act", kind), payloads, self._rt.act_runner(kind))

    def _keep(self, row: GenResult) -> GenResult:
        row.gen_id = len(self.generations)
        self.generations.append(row)
        return row

    async def _best_of_each(self, rows: list[GenResult], n: int) -> list[GenResult]:
        """Tree step: score the ``n`` candidates of each prompt (``rows`` prompt-major), keep each prompt's best
        as the row the workflow goes on from, and remember all of them as the step's group."""
        assert self._rt.tree is not None
        # Scoring runs on a plain context of the same rollout: a judge it asks is not tree-sampled, and its
        # rows are not this rollout's generations.
        scorer = Context(self._rt, self.rollout, tree=False)
        rewards = await self._rt.tree(scorer, self.task, [r.text for r in rows], [r.finished for r in rows])
        if len(rewards) != len(rows):
            raise WorkflowError(f"tree step scoring returned {len(rewards)} rewards for {len(rows)} candidates")
        out = []
        for start in range(0, len(rows), n):
            candidates, scores = rows[start:start + n], [float(x) for x in rewards[start:start + n]]
            best = best_of(scores)
            kept = self._keep(_copy(candidates[best], candidates[best].agent))
            self.tree_steps[kept.gen_id] = TreeStep(candidates, scores, best)
            out.append(kept)
        return out


def _copy(row: GenResult, agent: str) -> GenResult:
    return GenResult(ids=list(row.ids), logprobs=list(row.logprobs), finished=row.finished, version=row.version,
                     seconds=row.seconds, text=row.text, prompt_ids=list(row.prompt_ids), agent=agent)
