"""What the agents say: one JSON record per sampled rollout of an episode, appended to ``<run dir>/samples.jsonl``.

A record holds the task (id, question, reference answer), the weights versions, and per turn the agent, its model,
the tail of the prompt it saw, its response, the reward it was given (the Sample's, i.e. what the trainer gets),
the extracted answer, whether it was right, the advantage the trainer gets (when the samples have theirs by the
time the record is made) and, when the reward function failed on it, ``reward_error``. The coordinator also
publishes each batch of records on ``chorus.<run>.samples`` (JSON lines), where ``chorus dashboard`` reads them.
``chorus samples RUN`` prints them (shared/launcher/samplescmd.py).

The file rotates at a byte bound (``samples.jsonl`` -> ``samples.1.jsonl``, one old file kept), so a long run
uses at most about twice the bound on disk. Nothing here knows NATS; the coordinator calls it off its event loop.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from services.coordinator.workflows.episode import Episode, turn_rewards
from shared.kernel.config import ChorusConfig
from shared.kernel.schemas import Sample

SAMPLES_FILE = "samples.jsonl"
OLD_SAMPLES_FILE = "samples.1.jsonl"
MAX_BYTES = 8 * 1024 * 1024
PROMPT_TAIL_CHARS = 300
TEXT_CHARS = 16_000  # a response longer than this is cut (its head and tail kept): one record stays small

# (model, prompt ids) -> text, with that model's tokenizer
Decode = Callable[[str, list[int]], str]


def prompt_text(tok: Any, ids: Sequence[int]) -> str:
    """A prompt's ids as text, every part of it: a chat template ends each message with the EOS id (SmolLM2's
    ``<|im_end|>``), where a tokenizer's ``decode`` stops, so those ids are left out rather than ended at."""
    return str(tok.decode([int(i) for i in ids if int(i) != tok.eos_id]))


def clip(text: str, limit: int = TEXT_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} [... {len(text) - 2 * half} chars ...] {text[-half:]}"


def prompt_tail(text: str, chars: int = PROMPT_TAIL_CHARS) -> str:
    return text[-chars:] if chars > 0 else ""


def _tree(cfg: ChorusConfig) -> bool:
    return cfg.workflow.sampling == "tree" and cfg.workflow.group_size > 1


def rollout_record(cfg: ChorusConfig, ep: Episode, rollout: int, *, eval: bool = False,
                   decode: Decode | None = None, now: float | None = None) -> dict[str, Any]:
    """The record of rollout ``rollout`` of ``ep``. A turn's reward is its Sample's (what was published to the
    trainer) when it has one, else the trajectory's (shaped like a sample's would be); None when the reward
    function failed on it. The prompt tail is the Sample's prompt ids decoded by ``decode`` (what the model saw,
    chat template included), else the turn's ``agent_input`` text."""
    task = ep.task
    traj = ep.trajectories[rollout]
    # Tree sampling's samples are a step's candidates, not this rollout's turns: only the trajectory speaks for it.
    own: dict[int, Sample] = {} if _tree(cfg) else {
        s.turn: s for s in ep.samples if s.episode == f"{task.task_id}/{rollout}" and s.rollout_idx == rollout}
    shaped = turn_rewards(cfg, traj)
    turns = []
    for t in sorted(traj["trajectory"], key=lambda t: t["turn_id"]):
        tid, meta = t["turn_id"], t.get("metadata") or {}
        agent = t["agent_name"]
        s = own.get(tid)
        a = cfg.agents.get(agent)
        text = str(t.get("agent_input") or "")
        if s is not None and decode is not None and len(s.prompt_ids):
            # the last ids are enough for the tail: every token decodes to at least one character, or nearly
            text = decode(s.model, [int(i) for i in s.prompt_ids.tolist()[-2 * PROMPT_TAIL_CHARS:]])
        error = meta.get("reward_error")
        row: dict[str, Any] = {
            "turn": tid,
            "agent": agent,
            "model": s.model if s is not None else (a.model if a is not None else None),
            "version": s.version if s is not None else None,
            "prompt_tail": prompt_tail(text),
            "response": clip(str(t.get("agent_output", ""))),
            "reward": None if error else (float(s.reward) if s is not None else shaped.get(tid)),
            "answer": meta.get("answer"),
            "correct": meta.get("correct"),
            "trained": s is not None,
            "advantage": float(s.advantage) if s is not None and s.advantage is not None and not eval else None,
        }
        if error:
            row["reward_error"] = str(error)[:1000]
        turns.append(row)
    versions = next((dict(s.versions) for s in ep.samples if s.versions), {})
    return {
        "time": time.time() if now is None else now,
        "run": cfg.run.id,
        "eval": eval,
        "task_id": task.task_id,
        "rollout": rollout,
        "question": clip(task.question),
        "reference": clip(task.answer),
        "versions": versions,
        "final_reward": traj.get("final_reward"),
        "final_answer": traj.get("final_answer"),
        "turns": turns,
    }


def episode_records(cfg: ChorusConfig, ep: Episode, rollouts: Iterable[int] = (0,), **kw: Any) -> list[dict[str, Any]]:
    """The records of the given rollouts of ``ep`` (those it has)."""
    return [rollout_record(cfg, ep, i, **kw) for i in rollouts if 0 <= i < len(ep.trajectories)]


def dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False, default=str)


class SampleWriter:
    """Appends JSON lines to ``<dir>/samples.jsonl``; past ``max_bytes`` the file becomes samples.1.jsonl (the
    one before it is dropped) and a new one is started. Thread-safe; each batch is one O_APPEND write. A single
    line longer than the bound is still written, alone in its file."""

    def __init__(self, run_dir: Path, max_bytes: int = MAX_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.path = Path(run_dir) / SAMPLES_FILE
        self.old = Path(run_dir) / OLD_SAMPLES_FILE
        self.max_bytes = max_bytes
        self._lock = threading.Lock()

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def _append(self, data: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def write(self, lines: Sequence[str]) -> int:
        """Append ``lines`` (rotating as needed); the number of bytes written."""
        if not lines:
            return 0
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            size = self._size()
            chunk: list[bytes] = []
            chunk_bytes = 0
            written = 0
            for line in lines:
                b = (line + "\n").encode()
                if size + chunk_bytes + len(b) > self.max_bytes and size + chunk_bytes > 0:
                    if chunk:
                        self._append(b"".join(chunk))
                        written += chunk_bytes
                    os.replace(self.path, self.old)
                    size, chunk, chunk_bytes = 0, [], 0
                chunk.append(b)
                chunk_bytes += len(b)
            if chunk:
                self._append(b"".join(chunk))
                written += chunk_bytes
            return written

