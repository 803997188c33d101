"""MARFT in the coordinator (``train.loss: marft``): it alone sees whole episodes in (time step, agent) order.

For each finished rollout the samples are laid out as Flex-MG steps: round -> time step t, position within the
round -> agent i (a turn's round is its ``metadata.round``, 0 when the workflow sets none). The team reward of a
round (the reward of its last turn) goes to the last agent of the round, the others get 0. The critic's values of
every observation come back in one request per episode; action-level GAE (MARFT-A) or token-level GAE (MARFT-T)
over the rollout, with the bootstrap cut only at the rollout's end, gives each sample its advantage, values and
returns, and one critic sample (observation, V_old, return) per policy sample.

The coordinator holds an on-policy batch's valued episodes until its last task is in (:class:`HeldBatch`), then
normalises their advantages over the whole batch, every agent of every model pooled (the listing's ``[B, n]``
buffer; MARFT-T: every token of it), and publishes them together, each sample carrying the count of its model's
samples in the batch: the trainer steps on exactly those (services/trainer/marft_step.py), the batch's last task
included, so nothing overshoots into the next version as stale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from services.coordinator.workflows.episode import Episode, turn_rewards
from shared.kernel.config import ChorusConfig
from shared.kernel.schemas import Array, CriticBatch, CriticRow, CriticSample, Sample
from shared.rlmath.marft import normalise_advantages, token_gae


@dataclass
class Rollout:
    """One rollout's samples as Flex-MG steps: ``steps[t]`` in the order the agents acted, ``team[t]`` the step's
    team reward."""

    steps: list[list[Sample]]
    team: list[float]

    @property
    def samples(self) -> list[Sample]:
        return [s for step in self.steps for s in step]


def rollouts(cfg: ChorusConfig, ep: Episode) -> list[Rollout]:
    """The episode's rollouts (those with at least one sample), each laid out in (t, i) order."""
    by_rollout: dict[int, list[Sample]] = {}
    for s in ep.samples:
        by_rollout.setdefault(s.rollout_idx, []).append(s)
    out = []
    for i, traj in enumerate(ep.trajectories):
        samples = sorted(by_rollout.get(i, []), key=lambda s: s.turn)
        if not samples:
            continue
        rewards = turn_rewards(cfg, traj)
        round_of = {t["turn_id"]: _round(t["metadata"].get("round", 0)) for t in traj["trajectory"]}
        last_turn: dict[int, int] = {}
        for tid, r in round_of.items():
            last_turn[r] = max(tid, last_turn.get(r, -1))
        steps: dict[int, list[Sample]] = {}
        for s in samples:
            steps.setdefault(round_of[s.turn], []).append(s)
        order = sorted(steps)
        out.append(Rollout([steps[r] for r in order], [float(rewards[last_turn[r]]) for r in order]))
    return out


def _round(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def critic_rows(samples: Sequence[Sample], variant: str) -> list[CriticRow]:
    """What the critic values for each sample: MARFT-A the observation (the sample's prompt: the agent's profile,
    the state and the earlier agents' actions) at its last token; MARFT-T the state before each response token."""
    rows = []
    for s in samples:
        prompt = s.prompt_ids.numpy().astype("int32")
        if variant == "action":
            rows.append(CriticRow(ids=Array.of(prompt, "int32"), positions=[len(prompt) - 1]))
        else:
            response = s.response_ids.numpy().astype("int32")
            ids = np.concatenate([prompt, response])
            rows.append(CriticRow(ids=Array.of(ids, "int32"),
                                  positions=[len(prompt) - 1 + j for j in range(len(response))]))
    return rows


def apply_gae(cfg: ChorusConfig, layout: Sequence[Rollout], values: Sequence[Sequence[float]],
              rows: Sequence[CriticRow], batch_id: str) -> CriticBatch:
    """Write each sample's reward (the team reward on the last agent of its step, 0 for the others), advantage(s),
    values and returns; return the critic samples. ``values``/``rows``: per sample in the order of the layout's
    rollouts, then steps, then agents."""
    mc = cfg.marft
    token = mc.variant == "token"
    at = 0
    critic: list[CriticSample] = []
    for ro in layout:
        n = len(ro.samples)
        vals = [np.asarray(v, dtype=np.float64) for v in values[at : at + n]]
        step_tokens: list[list[int]] = []
        k = 0
        for step in ro.steps:
            step_tokens.append([int(vals[k + j].size) for j in range(len(step))])
            k += len(step)
        ends = [False] * (len(ro.steps) - 1) + [True]
        adv, ret = token_gae(step_tokens, ro.team, vals, ends, mc.gamma, mc.gae_lambda)
        for t, step in enumerate(ro.steps):
            for i, s in enumerate(step):
                s.reward = ro.team[t] if i == len(step) - 1 else 0.0
        for k, s in enumerate(ro.samples):
            a, r, v = adv[k], ret[k], vals[k]
            s.gae_values = Array.of(v.astype("float32"), "float32")
            s.gae_returns = Array.of(r.astype("float32"), "float32")
            if token:
                s.token_advantages = Array.of(a.astype("float32"), "float32")
                s.advantage = float(a.mean())
            else:
                s.advantage = float(a[0])
            critic.append(CriticSample(sample_id=s.sample_id, row=rows[at + k], old_values=v.tolist(),
                                       returns=r.tolist()))
        at += n
    return CriticBatch(batch_id=batch_id, samples=critic)


def normalise_batch(samples: Sequence[Sample], variant: str) -> None:
    """Normalise the GAE advantages of a whole on-policy batch in place, every agent and model pooled
    (:func:`shared.rlmath.marft.normalise_advantages`: exact zeros out of the statistics, a batch without spread
    left as it is), and set each sample's ``batch_samples``: its model's samples in the batch."""
    if variant == "token":
        arrays = [np.asarray(s.token_advantages.numpy() if s.token_advantages is not None else
                             np.full(int(s.response_ids.shape[0]), s.advantage or 0.0), dtype=np.float64)
                  for s in samples]
        flat = normalise_advantages(np.concatenate(arrays)) if arrays else np.zeros(0)
        for s, a in zip(samples, np.split(flat, np.cumsum([a.size for a in arrays])[:-1]) if arrays else [],
                        strict=True):
            s.token_advantages = Array.of(a.astype("float32"), "float32")
            s.advantage = float(a.mean()) if a.size else 0.0
    else:
        for s, a in zip(samples, normalise_advantages([s.advantage or 0.0 for s in samples]), strict=True):
            s.advantage = float(a)
    per_model: dict[str, int] = {}
    for s in samples:
        per_model[s.model] = per_model.get(s.model, 0) + 1
    for s in samples:
        s.batch_samples = per_model[s.model]


@dataclass
class HeldBatch:
    """The valued episodes of the open on-policy batch (number ``batch``), with their critic samples."""

    batch: int | None = None
    items: list[tuple[Episode, CriticBatch]] = field(default_factory=list)

    def add(self, batch: int, ep: Episode, critic: CriticBatch) -> None:
        if self.batch is not None and batch != self.batch and self.items:
            raise ValueError(f"an episode of batch {batch} while batch {self.batch} is held: the on-policy gate "
                             "opens a batch only when the last one is done")
        self.batch = batch
        self.items.append((ep, critic))

    def take(self, variant: str) -> list[tuple[Episode, CriticBatch]]:
        """The held episodes, normalised together (:func:`normalise_batch`); the hold is empty after."""
        items, self.items, self.batch = self.items, [], None
        normalise_batch([s for ep, _ in items for s in ep.samples], variant)
        return items


__all__ = ["HeldBatch", "Rollout", "apply_gae", "critic_rows", "normalise_batch", "rollouts"]
