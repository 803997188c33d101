"""MARFT's central critic (Liao et al. 2025, §4.2.1, Fig. 3): a frozen causal LM (by default the agents' base
model) read at the last token of an agent's observation, and a trainable MLP head that maps that hidden state to
V(s_t, a_t^{1:i-1}).

The head is the one of MARFT's public code (after DeepSpeed-Chat's reward model): hidden -> 1024 -> 512 -> 1,
ReLU between, no biases, in float32 over the base's final-norm hidden state. Only the head trains and only the
head is committed (the base is the model it was built from).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

HEAD_SIZES = (1024, 512)


class CentralCritic(nn.Module):
    """V(observation) [B] for right-padded observations ``input_ids`` [B, T] with ``attention_mask`` [B, T]."""

    def __init__(self, base: nn.Module, head_sizes: Sequence[int] = HEAD_SIZES) -> None:
        super().__init__()
        self.base = base.eval().requires_grad_(False)
        hidden = int(cast(Any, base).config.hidden_size)  # a transformers model's config
        layers: list[nn.Module] = []
        width = hidden
        for size in head_sizes:
            layers += [nn.Linear(width, int(size), bias=False), nn.ReLU()]
            width = int(size)
        layers.append(nn.Linear(width, 1, bias=False))
        self.head = nn.Sequential(*layers).float()

    def train(self, mode: bool = True) -> CentralCritic:
        """Only the head changes mode: the frozen base stays in eval (no dropout in the features)."""
        self.training = mode
        self.head.train(mode)
        return self

    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The base's final hidden state at each row's last real token [B, H], float32, without gradients."""
        if not bool((attention_mask.sum(-1) > 0).all()):
            raise ValueError("every observation needs at least one token")
        with torch.no_grad():
            body = getattr(self.base, "model", self.base)  # the decoder under a causal-LM head
            hidden = body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            last = attention_mask.long().sum(-1) - 1
            return hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()

    def features_at(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
        """The base's final hidden state at (row, position) pairs [N, H], float32, without gradients: MARFT-T
        values the state before every response token, not only an observation's last one."""
        if bool((positions >= attention_mask.long().sum(-1)[rows]).any()) or bool((positions < 0).any()):
            raise ValueError("a position outside its row's real tokens")
        with torch.no_grad():
            body = getattr(self.base, "model", self.base)
            hidden = body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return hidden[rows, positions].float()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(input_ids, attention_mask)).squeeze(-1)

    def head_state(self) -> dict[str, torch.Tensor]:
        """The trainable tensors (what a commit keeps), detached clones."""
        return {k: t.detach().clone() for k, t in self.head.state_dict().items()}

    def load_head_state(self, state: dict[str, torch.Tensor]) -> None:
        self.head.load_state_dict(state)


__all__ = ["HEAD_SIZES", "CentralCritic"]
