"""log pi_theta of the response tokens only, and micro-batches cut so that rows pad little.

The decoder body runs once over a right-padded batch; the LM head and the log-softmax then run only on the
hidden states of the loss positions, gathered first ([N_resp, H] instead of [B, L, H]): the prompt's logits
are never computed. A LoRA model keeps per-row adapter routing: the body runs inside peft's forward hooks
with one adapter per row, and a LoRA-wrapped head gets one adapter per gathered position.

Knows nothing of NATS; plain functions over tensors and the network.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

# A sub-batch pads to at most this many times its real tokens (see pack_rows).
PAD_BOUND = 1.1

# Config attributes of Hugging Face causal LMs whose forward changes the head's logits (soft-capping,
# scaling): such a model is scored through its own forward, not through body + head.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def pack_rows(lengths: Sequence[int], bound: float = PAD_BOUND) -> list[list[int]]:
    """Row indices cut into sub-batches whose padded tokens stay within ``bound`` x their real tokens.

    Greedy over the rows sorted longest first: a sub-batch opens at its longest row (width W) and takes the
    next row, of length l, while (rows + 1) * W <= bound * (tokens + l); otherwise that row opens the next
    sub-batch (a shorter row could not fit either). A row alone never pads, so every sub-batch keeps the
    bound, and rows of one length stay one sub-batch. ``bound`` = inf: one sub-batch.
    """
    if bound < 1.0:
        raise ValueError(f"pad bound {bound} < 1: padded tokens can never be fewer than real ones")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    tokens = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= bound * (tokens + lengths[i]):
            groups[-1].append(i)
            tokens += lengths[i]
        else:
            groups.append([i])
            tokens = lengths[i]
    return groups


class ResponseScorer:
    """log pi_theta(a_t | s_t) / temperature of the loss positions of a right-padded batch, for one network.

    ``net`` is a Hugging Face causal LM or a peft model over one. Its logits must be ``head(body(ids))``;
    a model whose forward transforms them further (``_LOGIT_TRANSFORMS``) is scored through that forward.
    """

    def __init__(self, net: torch.nn.Module, temperature: float) -> None:
        self.net = net
        self.temperature = temperature
        from peft import PeftModel

        self.peft = isinstance(net, PeftModel)
        lm = net.get_base_model() if self.peft else net  # type: ignore[operator]
        config = getattr(lm, "config", None)
        self.split = not any(getattr(config, a, None) not in (None, 1, 1.0) for a in _LOGIT_TRANSFORMS)
        self.body: torch.nn.Module = lm.get_decoder()  # type: ignore[operator]
        self.head: torch.nn.Module = lm.get_output_embeddings()  # type: ignore[operator]
        # lm_head among the LoRA target modules: the head routes rows itself, one adapter per position.
        self.head_routed = self.peft and hasattr(self.head, "lora_A")

    def __call__(self, input_ids: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor,
                 adapters: Sequence[str] | None = None) -> torch.Tensor:
        """[B, L-1] log-probs (float32) at the positions where ``loss_mask`` is set, 0 elsewhere.

        ``input_ids`` [B, L] right-padded; ``targets`` and ``loss_mask`` [B, L-1] on the shifted view;
        ``adapters`` one per row for a LoRA model.
        """
        rows, cols = loss_mask.nonzero(as_tuple=True)
        if rows.numel() == 0:
            return torch.zeros(loss_mask.shape, dtype=torch.float32, device=loss_mask.device)
        logits = self._body_and_head(input_ids, rows, cols, adapters) if self.split else \
            self._full_forward(input_ids, adapters)[rows, cols]
        logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        picked = logp.gather(-1, targets[rows, cols].unsqueeze(-1)).squeeze(-1)
        return picked.new_zeros(loss_mask.shape).index_put((rows, cols), picked)

    def _routing(self, adapters: Sequence[str] | None) -> contextlib.AbstractContextManager[Any]:
        """peft's hooks that hand each LoRA layer the adapter of every row (what PeftModel.forward does)."""
        if adapters is None:
            return contextlib.nullcontext()
        return self.net._enable_peft_forward_hooks(adapter_names=list(adapters))  # type: ignore[operator]

    def _body_and_head(self, input_ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                       adapters: Sequence[str] | None) -> torch.Tensor:
        # The last token is only ever a target. No padding mask: right padding comes after every real token
        # and causal attention never looks forward, so real positions cannot see it (and sdpa runs causal).
        with self._routing(adapters):
            hidden = self.body(input_ids=input_ids[:, :-1], use_cache=False).last_hidden_state
        h = hidden[rows, cols]  # [N_resp, H]
        if self.head_routed:
            assert adapters is not None
            return self.head(h, adapter_names=[adapters[r] for r in rows.tolist()])
        return self.head(h)

    def _full_forward(self, input_ids: torch.Tensor, adapters: Sequence[str] | None) -> torch.Tensor:
        routing = {} if adapters is None else {"adapter_names": list(adapters)}
        return self.net(input_ids=input_ids, use_cache=False, **routing).logits[:, :-1]
