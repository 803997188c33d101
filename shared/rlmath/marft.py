"""MARFT's advantage side (Liao et al. 2025, "MARFT: Multi-Agent Reinforcement Fine-Tuning"), plain numpy: the
coordinator, which alone sees whole episodes in (time step, agent) order, computes these.

Symbols (the paper's): an episode is time steps t = 0..T-1; in each step the n agents act in a fixed order
i = 0..n-1 (Flex-MG, §3.1), agent i seeing the state s_t and the actions a_t^{1:i-1} of the agents before it.
V(s_t, a_t^{1:i-1}) is the central critic's value of agent i's observation; r_t^i its reward; gamma the discount
and lambda the GAE parameter, both applied per agent hop (and, in MARFT-T, per token hop).

Action-level GAE (MARFT-A, Appendix A): backwards over time steps, then over agents within a step,

    agent i < n-1:  delta_t^i = r_t^i + gamma * V_t^{i+1} - V_t^i                     A_t^i = delta_t^i + gamma*lambda * A_t^{i+1}
    agent n-1:      delta_t^n = r_t^n + gamma * m_{t+1} * V_{t+1}^0 - V_t^n           A_t^n = delta_t^n + gamma*lambda * m_{t+1} * A_{t+1}^0

with m_{t+1} = 0 where the episode ended with step t (no bootstrap across an episode end), and the return
(the critic's target) R_t^i = V_t^i + A_t^i. Read along the order in which the agents act, this is the GAE of
Schulman et al. (2016) over one flat sequence of n * T actions, each bootstrapping from the next: :func:`gae`.

Token-level GAE (MARFT-T, §4.2): every token is an action; the value of a token state bootstraps from the next
token of the same agent, the last token of agent i from the first token of agent i + 1, and the last token of
the last agent from the first token of the next step (with the step's reward). The same :func:`gae` over the
flat token sequence, with the reward on the last token of the last agent of each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

NORM_EPS = 1e-8  # the public code's epsilon in the advantage normalisation
NO_SPREAD = 1e-9  # relative std under which non-zero advantages have no spread (normalise_advantages leaves them)


def gae(rewards: Sequence[float] | Any, values: Sequence[float] | Any, ends: Sequence[bool] | Any,
        gamma: float, lam: float, last_value: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """GAE over one flat sequence of actions (or tokens) k = 0..K-1, each bootstrapping from the next.

    ``ends[k]``: the episode ended with action k (no bootstrap from k + 1: m_{k+1} = 0). ``last_value``: V of what
    follows the last action when the sequence stops without an episode end (a truncated rollout).

        delta_k = r_k + gamma * m_{k+1} * V_{k+1} - V_k
        A_k     = delta_k + gamma * lambda * m_{k+1} * A_{k+1}
        R_k     = V_k + A_k

    Returns (A, R), float64 arrays of length K.
    """
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    done = np.asarray(ends, dtype=bool).reshape(-1)
    if not r.size == v.size == done.size:
        raise ValueError(f"{r.size} rewards, {v.size} values and {done.size} episode ends: one each per action")
    adv = np.zeros_like(r)
    next_value, next_adv = float(last_value), 0.0
    for k in range(r.size - 1, -1, -1):
        m = 0.0 if done[k] else 1.0  # m_{k+1}
        delta = r[k] + gamma * m * next_value - v[k]
        next_adv = delta + gamma * lam * m * next_adv
        adv[k] = next_adv
        next_value = v[k]
    return adv, v + adv


def action_gae(rewards: Any, values: Any, ends: Sequence[bool] | Any, gamma: float, lam: float,
               next_value: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Action-level GAE of one episode's [T, n] rewards r_t^i and values V_t^i (``ends[t]``: the episode ended with
    step t; ``next_value``: V_T^0 where the last step did not end it). Returns (A, R), each [T, n]."""
    r = np.asarray(rewards, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if r.ndim != 2 or r.shape != v.shape:
        raise ValueError(f"rewards {r.shape} and values {v.shape} must both be [time steps, agents]")
    steps, agents = r.shape
    done = np.asarray(ends, dtype=bool).reshape(-1)
    if done.size != steps:
        raise ValueError(f"{done.size} episode ends for {steps} time steps")
    flat_ends = np.zeros(steps * agents, dtype=bool)
    flat_ends[agents - 1 :: agents] = done  # only the last agent of a step bootstraps across steps
    adv, ret = gae(r.reshape(-1), v.reshape(-1), flat_ends, gamma, lam, next_value)
    return adv.reshape(steps, agents), ret.reshape(steps, agents)


def token_gae(step_tokens: Sequence[Sequence[int]], rewards: Sequence[float], values: Sequence[Any],
              ends: Sequence[bool], gamma: float, lam: float, next_value: float = 0.0
              ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token-level GAE (MARFT-T) of one episode.

    ``step_tokens[t]``: the token count of each agent's action in step t (agents in order); ``rewards[t]``: the
    step's reward R(s_t, a_t), on the last token of the last agent (every other token 0); ``values[t * n + i]``:
    the per-token values of agent i's action in step t; ``ends[t]``: the episode ended with step t. Returns the
    per-token advantages and returns of each action, in the order of ``values``."""
    if len(step_tokens) != len(rewards) or len(rewards) != len(ends):
        raise ValueError(f"{len(step_tokens)} steps of token counts, {len(rewards)} rewards, {len(ends)} ends")
    counts = [int(c) for step in step_tokens for c in step]
    if len(values) != len(counts) or any(np.asarray(v).size != c for v, c in zip(values, counts, strict=True)):
        raise ValueError("values must hold one array per action, with one value per token of it")
    if min(counts, default=1) < 1:
        raise ValueError("every action has at least one token")
    flat_r: list[float] = []
    flat_end: list[bool] = []
    for step, reward, end in zip(step_tokens, rewards, ends, strict=True):
        total = int(sum(step))
        flat_r += [0.0] * (total - 1) + [float(reward)]
        flat_end += [False] * (total - 1) + [bool(end)]
    adv, ret = gae(flat_r, np.concatenate([np.asarray(v, dtype=np.float64).reshape(-1) for v in values]),
                   flat_end, gamma, lam, next_value)
    cuts = np.cumsum(counts)[:-1]
    return list(np.split(adv, cuts)), list(np.split(ret, cuts))


def normalise_advantages(adv: Any, eps: float = NORM_EPS) -> np.ndarray:
    """(A - mean) / (std + eps) over the whole batch, all agents pooled, where the mean and the (population)
    standard deviation leave out the entries that are exactly 0; every entry is normalised, zeros included (the
    listing's ``nanmean`` / ``nanstd`` with zeros as NaN).

    Guard (not in the listing): non-zero entries without spread (a single one, or all equal) give std 0, and
    the listing would turn every zero into -mean / 1e-8 (about -3e7 for a mean of 0.3); such a batch, like one with
    no non-zero entry, comes back unchanged: there is nothing to scale by (docs/marft.md)."""
    a = np.asarray(adv, dtype=np.float64)
    nonzero = a[a != 0.0]
    if nonzero.size == 0:
        return a.copy()
    std = nonzero.std()
    if std <= NO_SPREAD * max(1.0, float(np.abs(nonzero).max())):
        return a.copy()
    return (a - nonzero.mean()) / (std + eps)


def last_agent_rewards(team_rewards: Sequence[float], agents: int) -> np.ndarray:
    """[T, n] rewards r_t^i from each step's team reward: all of it to the last agent of the step, 0 to the
    others (under GAE a reward given to every agent would be counted once per agent hop)."""
    out = np.zeros((len(team_rewards), agents), dtype=np.float64)
    out[:, agents - 1] = np.asarray(team_rewards, dtype=np.float64)
    return out


def agent_to_train(version: int, interval: int, agents: int) -> int | None:
    """Agent-by-agent training (§3.2): the one agent whose policy the step at ``version`` updates,
    ``(version // interval) % n``; None (every agent) when ``interval`` is 0."""
    if interval < 0 or agents < 1:
        raise ValueError(f"interval {interval} must be >= 0 and agents {agents} >= 1")
    return None if interval == 0 else (version // interval) % agents


__all__ = ["NORM_EPS", "action_gae", "agent_to_train", "gae", "last_agent_rewards", "normalise_advantages",
           "token_gae"]
