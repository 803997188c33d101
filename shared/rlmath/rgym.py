"""reasoning-gym items by (dataset, config, seed, index): the coordinator asks the questions, the actions worker
regenerates the same entry to score an answer with that dataset's own ``score_answer`` (an entry's metadata is
not always JSON-safe: tuples, sets), so only the four coordinates travel."""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

SPLITS = ("train", "heldout")


def split_seed(seed: int, split: str) -> int:
    """The reasoning-gym seed of a run seed's training stream or held-out set: a hash of both. reasoning-gym builds
    item i of seed s from ``Random(s + i)``, so consecutive run seeds used as they are would be one stream shifted
    by an item; hashed, two seeds' items coincide only when their questions do by chance."""
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    digest = hashlib.blake2b(f"chorus:{split}:{int(seed)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2  # 62 bits: any JSON or msgpack integer


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str, seed: int, size: int) -> Any:
    import reasoning_gym  # imported here: it is large, and only these tasks need it

    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(config_json))
    except (KeyError, ValueError, TypeError, AssertionError) as exc:
        raise ValueError(f"reasoning_gym.create_dataset({name!r}, seed={seed}, size={size}, "
                         f"**{config_json}) failed: {type(exc).__name__}: {exc}") from None


def dataset(name: str, config: dict[str, Any], seed: int, size: int) -> Any:
    """The reasoning-gym dataset (cached per process)."""
    return _dataset(name, json.dumps(config, sort_keys=True), seed, size)


def entry(name: str, config: dict[str, Any], seed: int, size: int, index: int) -> dict[str, Any]:
    """Item ``index`` of the dataset: ``{"question", "answer", "metadata"}``."""
    ds = dataset(name, config, seed, size)
    if not 0 <= index < size:
        raise ValueError(f"reasoning_gym {name}: index {index} outside the dataset's {size} items")
    return ds[index]


def score(name: str, config: dict[str, Any], seed: int, size: int, index: int, response: str, *,
          flexible: bool = False) -> dict[str, Any]:
    """The dataset's own ``score_answer`` of what the response puts in ``<answer>...</answer>`` (reasoning-gym's
    ``extract_answer``; no tags: the answer is None, which scores what the dataset gives None, usually 0). With
    ``flexible``, a response without tags is scored on its final answer as :func:`gsm8k.extract_answer` finds it
    (``####``, ``\\boxed``, "the answer is", else the last number)."""
    from reasoning_gym.utils import extract_answer

    from shared.rlmath import gsm8k

    ds = dataset(name, config, seed, size)
    item = entry(name, config, seed, size, index)
    answer = extract_answer(response)
    if answer is None and flexible:
        answer = gsm8k.extract_answer(response)
    value = float(ds.score_answer(answer, item))
    return {"reward": value, "correct": value >= 1.0, "answer": answer or ""}
