"""What a Sample must be before it is stored or trained on: what a coordinator of this run could have produced.

Anyone who can publish on ``traj.<model>`` or ``ready.<model>`` can send a Sample that decodes; these checks turn
away what no coordinator of the run could have sent (another run, an agent that does not act with this model, a
group of the wrong size, ids that do not name their group), and every number that could poison a weight (a
non-finite reward, advantage or log-prob, a token id outside the vocabulary). mq runs them where a sample enters;
the trainer again on every sample of a micro-batch (``ready.<model>`` is a subject like any other). Each check
names the sample and what was expected, and rejects one sample, never its neighbours.
"""

from __future__ import annotations

import math

import numpy as np

from shared.kernel.config import ChorusConfig
from shared.kernel.schemas import MAX_NEW_TOKENS, Array, Sample

LOGPROB_SLACK = 1e-4  # a behaviour log-prob is <= 0; float rounding may put a certain token a hair above
MAX_RESPONSE = MAX_NEW_TOKENS  # tokens: GenRequest.max_new_tokens is at most this


def finite(value: float) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def arrays_problem(s: Sample, vocab_size: int | None = None, context: int | None = None) -> str | None:
    """Shapes, dtypes and values of the token ids and behaviour log-probs, or None when they are trainable. A
    rollouter takes prompts up to the model's ``context`` and generates at most ``MAX_RESPONSE`` tokens."""
    arrays: tuple[tuple[str, Array], ...] = (("prompt_ids", s.prompt_ids), ("response_ids", s.response_ids),
                                             ("behavior_logprobs", s.behavior_logprobs))
    for name, arr in arrays:
        if len(arr.shape) != 1:
            return f"{name} must be 1-d, has shape {arr.shape}"
    if s.prompt_ids.shape[0] == 0:
        return "empty prompt_ids (expected at least BOS)"
    if context is not None and s.prompt_ids.shape[0] > context:
        return f"a prompt of {s.prompt_ids.shape[0]} tokens, longer than the model's context of {context}"
    if s.response_ids.shape[0] > MAX_RESPONSE:
        return f"a response of {s.response_ids.shape[0]} tokens, more than the {MAX_RESPONSE} a request can ask for"
    if s.response_ids.shape[0] != s.behavior_logprobs.shape[0]:
        return f"{s.response_ids.shape[0]} response ids but {s.behavior_logprobs.shape[0]} behaviour log-probs"
    for name, arr in arrays[:2]:
        if arr.dtype not in ("int32", "int64"):
            return f"{name} dtype {arr.dtype}, expected int32 or int64"
        ids = arr.numpy()
        if ids.size and ids.min() < 0:
            return f"{name} has negative token ids (min {int(ids.min())})"
        if ids.size and vocab_size is not None and ids.max() >= vocab_size:
            return f"{name} has ids outside [0, {vocab_size}) (max {int(ids.max())})"
    if s.behavior_logprobs.dtype not in ("float32", "float16"):
        return f"behavior_logprobs dtype {s.behavior_logprobs.dtype}, expected float32"
    lp = s.behavior_logprobs.numpy().astype(np.float32)
    if lp.size and not (np.isfinite(lp).all() and (lp <= LOGPROB_SLACK).all()):
        return "behavior_logprobs must be finite and <= 0"
    tv = s.token_versions
    if tv is not None:
        if len(tv.shape) != 1 or tv.shape[0] != s.response_ids.shape[0] or tv.dtype not in ("int32", "int64"):
            return (f"token_versions must be int32 [{s.response_ids.shape[0]}] (one per response id), "
                    f"has {tv.dtype} {tv.shape}")
        v = tv.numpy()
        if v.size and int(v.min()) != s.version:
            return f"version {s.version} is not the oldest of token_versions (min {int(v.min())})"
    return gae_problem(s)


def gae_problem(s: Sample) -> str | None:
    """MARFT's GAE arrays: 1-d float, finite, one entry per action (values and returns: 1 or one per response token;
    token advantages: one per response token)."""
    n = int(s.response_ids.shape[0])
    for name in ("gae_values", "gae_returns", "token_advantages"):
        arr: Array | None = getattr(s, name)
        if arr is None:
            continue
        sizes = (n,) if name == "token_advantages" else (1, n)
        if len(arr.shape) != 1 or arr.shape[0] not in sizes or arr.dtype not in ("float32", "float64"):
            return f"{name} must be float32 with {' or '.join(map(str, sizes))} entries, has {arr.dtype} {arr.shape}"
        if not np.isfinite(arr.numpy()).all():
            return f"{name} must be finite"
    return None


def numbers_problem(s: Sample) -> str | None:
    """Reward, advantage and timings must be finite numbers."""
    if not finite(s.reward):
        return f"reward {s.reward!r} is not a finite number"
    if s.advantage is not None and not finite(s.advantage):
        return f"advantage {s.advantage!r} is not a finite number"
    bad = sorted(k for k, v in s.timings.items() if not finite(v))
    if bad:
        return f"timings {bad} are not finite numbers"
    if s.version < 0 or any(v < 0 for v in s.versions.values()):
        return f"negative weight version ({s.version}, {s.versions})"
    return None


def provenance_problem(s: Sample, cfg: ChorusConfig) -> str | None:
    """Fields a coordinator of this run sets from its config, and ids that name the sample's own group."""
    if s.run != cfg.run.id:
        return f"run {s.run!r}, this run is {cfg.run.id!r}"
    agent = cfg.agents.get(s.agent)
    if agent is None:
        return f"agent {s.agent!r} is not one of the run's agents {sorted(cfg.agents)}"
    if agent.model != s.model:
        return f"agent {s.agent!r} acts with model {agent.model!r}, the sample says {s.model!r}"
    if agent.adapter != s.adapter:
        return f"agent {s.agent!r} uses adapter {agent.adapter!r}, the sample says {s.adapter!r}"
    G = cfg.workflow.group_size
    # MARFT keeps a turn that not every rollout reached (an episode that ended early): its group is smaller
    if s.group_size != G and not (cfg.marft_on and 1 <= s.group_size <= G):
        return f"group_size {s.group_size}, the run's workflow.group_size is {G}"
    if not 0 <= s.rollout_idx < G or s.turn < 0 or s.env_idx < 0:
        return f"rollout_idx {s.rollout_idx} (expected 0..{G - 1}), turn {s.turn}, env_idx {s.env_idx}"
    task, sep, rest = s.group_key.rpartition(f":{s.agent}:")
    if not sep or not task or rest != str(s.turn):
        return f"group_key {s.group_key!r} is not '<task>:{s.agent}:{s.turn}'"
    if s.sample_id != Sample.make_id(task, s.turn, s.rollout_idx):
        return f"sample_id {s.sample_id!r} is not {Sample.make_id(task, s.turn, s.rollout_idx)!r} (its group's)"
    return None


def sample_problem(s: Sample, cfg: ChorusConfig, vocab_size: int | None = None,
                   context: int | None = None) -> str | None:
    """Why ``s`` is not a sample of this run's coordinator that can be trained on, or None when it is."""
    why = numbers_problem(s) or provenance_problem(s, cfg) or arrays_problem(s, vocab_size, context)
    return None if why is None else f"sample {s.sample_id}: {why}"
