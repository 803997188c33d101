"""The central critic's learner: MARFT's value step (Appendix A: Adam with eps 1e-5 over the head alone, the
clipped value loss against the GAE returns, gradients clipped to a norm), one step per batch of observations."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.models.critic import CentralCritic
from shared.rlmath.losses import explained_variance, value_loss

ADAM_EPS = 1e-5  # MARFT's critic optimizer


@dataclass(frozen=True)
class CriticStep:
    value_loss: float
    grad_norm: float
    explained_variance: float  # of the values before the step, against the returns


class CriticLearner:
    """Trains ``critic``'s head: ``lr``, ``grad_clip`` (None: no clipping), ``value_clip`` (the clipped value
    loss's range around the values the samples were scored with; None: plain loss), ``huber_delta`` (None: the
    squared error)."""

    def __init__(self, critic: CentralCritic, *, lr: float, grad_clip: float | None = 1.0,
                 value_clip: float | None = 0.2, huber_delta: float | None = None) -> None:
        self.critic = critic
        self.params = [p for p in critic.head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=lr, eps=ADAM_EPS)
        self.grad_clip, self.value_clip, self.huber_delta = grad_clip, value_clip, huber_delta

    @torch.no_grad()
    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """V of each observation [B] (float32), as the coordinator asks for them."""
        return self.critic(input_ids, attention_mask)

    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, old_values: torch.Tensor,
             returns: torch.Tensor) -> CriticStep:
        """One optimizer step of the value loss over these observations."""
        self.critic.train()
        return self._step(self.critic(input_ids, attention_mask), old_values, returns)

    def row_features(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int,
                     chunk: int = 16) -> torch.Tensor:
        """The frozen base's features at each row's positions, rows of ``(token ids, positions)`` run ``chunk``
        at a time (right-padded with ``pad_id``); [N, H] with N the positions of all rows in order."""
        out: list[torch.Tensor] = []
        device = next(self.critic.head.parameters()).device
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            width = max(len(ids) for ids, _ in part)
            ids = torch.full((len(part), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(part), width), dtype=torch.long)
            r_idx: list[int] = []
            p_idx: list[int] = []
            for i, (row, positions) in enumerate(part):
                ids[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
                mask[i, : len(row)] = 1
                r_idx += [i] * len(positions)
                p_idx += [int(p) for p in positions]
            out.append(self.critic.features_at(ids.to(device), mask.to(device), torch.as_tensor(r_idx, device=device),
                                               torch.as_tensor(p_idx, device=device)))
        return torch.cat(out) if out else torch.zeros(0)

    @torch.no_grad()
    def values_of(self, features: torch.Tensor) -> torch.Tensor:
        """V at precomputed features [N, H] -> [N]."""
        return self.critic.head(features).squeeze(-1)

    def step_features(self, features: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor) -> CriticStep:
        """One optimizer step of the value loss over precomputed features (:meth:`row_features`)."""
        self.critic.train()
        values = self.critic.head(features).squeeze(-1)
        return self._step(values, old_values, returns)

    def _step(self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor) -> CriticStep:
        loss = value_loss(values, old_values.float(), returns.float(), self.value_clip, self.huber_delta)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip if self.grad_clip is not None
                                                    else float("inf")))
        self.optimizer.step()
        self.critic.eval()
        return CriticStep(float(loss.detach()), norm, explained_variance(values.detach(), returns.float()))

    def state_dict(self) -> dict:
        """The head and Adam's state, copies (the live optimizer state would change under a later step)."""
        return {"head": self.critic.head_state(), "optimizer": copy.deepcopy(self.optimizer.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        self.critic.load_head_state(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])


__all__ = ["ADAM_EPS", "CriticLearner", "CriticStep"]
