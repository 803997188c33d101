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
from dataclasses import dataclass
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
        # The entropy H_t = -sum_v p log p of each scored position (same layout as the log-probs) is kept in
        # ``last_entropy`` after each call: "metric" without gradient, "bonus" with it, None not computed.
        self.entropy: str | None = None
        self.last_entropy: torch.Tensor | None = None

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
        self._keep_entropy(logp, loss_mask.shape, (rows, cols))
        return picked.new_zeros(loss_mask.shape).index_put((rows, cols), picked)

    def shared(self, batch: SharedBatch, adapters: Sequence[str] | None = None) -> torch.Tensor:
        """[S, R] log-probs (float32) of a :class:`SharedBatch`'s response tokens, 0 outside its loss mask."""
        with self._routing(adapters):
            hidden = self.body(input_ids=batch.input_ids, position_ids=batch.position_ids,
                               attention_mask=batch.attention, use_cache=False).last_hidden_state
        h = hidden[batch.src_row, batch.src_col]  # [N, H]
        if self.head_routed:
            assert adapters is not None
            logits = self.head(h, adapter_names=[adapters[r] for r in batch.src_row.tolist()])
        else:
            logits = self.head(h)
        logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        picked = logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
        self._keep_entropy(logp, batch.loss_mask.shape, (batch.dst_sample, batch.dst_pos))
        return picked.new_zeros(batch.loss_mask.shape).index_put((batch.dst_sample, batch.dst_pos), picked)

    def _keep_entropy(self, logp: torch.Tensor, shape: Any, index: tuple[torch.Tensor, torch.Tensor]) -> None:
        """H_t = -sum_v p_v log p_v of the policy scored (after temperature), at the scored positions."""
        if self.entropy is None:
            self.last_entropy = None
            return
        with torch.set_grad_enabled(self.entropy == "bonus" and torch.is_grad_enabled()):
            ent = -(logp.exp() * logp).sum(-1)
        self.last_entropy = ent.new_zeros(shape).index_put(index, ent)

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


# --- shared prompts: a GRPO group's prompt runs once ---------------------------------------------------
@dataclass
class SharedBatch:
    """Samples packed so that samples with the same adapter and prompt share one copy of the prompt.

    Packed row ``b`` is ``prompt + response_1 + ... + response_k`` (right-padded to ``T``): the prompt's
    tokens attend causally to the prompt, each response's tokens to the whole prompt and causally to their own
    response, never to another response; positions restart after the prompt for each response, so every
    response sees exactly the context it was generated from. Response token ``j`` of sample ``s`` is scored
    from the hidden state at ``(src_row, src_col)`` (the prompt's last token for ``j = 0``) and lands at
    ``[s, j]`` of the per-sample layout ``[S, R]`` of ``loss_mask`` and ``logp_behav``.
    """

    input_ids: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T]
    attention: torch.Tensor  # [B, 1, T, T] bool, True: may attend
    src_row: torch.Tensor  # [N]
    src_col: torch.Tensor  # [N]
    targets: torch.Tensor  # [N]
    dst_sample: torch.Tensor  # [N]
    dst_pos: torch.Tensor  # [N]
    loss_mask: torch.Tensor  # [S, R]
    logp_behav: torch.Tensor  # [S, R]
    adapters: list[str | None]  # per packed row

    def to(self, device: torch.device) -> SharedBatch:
        moved: dict[str, Any] = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return SharedBatch(**moved)


def prompt_groups(samples: Sequence[Any]) -> list[list[int]]:
    """Indices of ``samples`` grouped by (adapter, prompt ids), in order of first appearance."""
    groups: dict[tuple[Any, bytes], list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault((s.adapter, s.prompt_ids.numpy().astype("int64").tobytes()), []).append(i)
    return list(groups.values())


def pack_shared(samples: Sequence[Any], pad_id: int) -> SharedBatch:
    """:class:`SharedBatch` of ``samples`` (Sample-like: prompt_ids, response_ids, behavior_logprobs, adapter),
    one packed row per (adapter, prompt) group; rows of S samples keep the samples' order in ``[S, R]``."""
    groups = prompt_groups(samples)
    prompts = [samples[g[0]].prompt_ids.numpy().astype("int64") for g in groups]
    responses = [s.response_ids.numpy().astype("int64") for s in samples]
    widths = [len(p) + sum(len(responses[i]) for i in g) for p, g in zip(prompts, groups, strict=True)]
    b, t = len(groups), max(widths)
    r_max = max(1, max(len(r) for r in responses))
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    position_ids = torch.zeros((b, t), dtype=torch.long)
    attention = torch.zeros((b, 1, t, t), dtype=torch.bool)
    attention[:, 0] = torch.eye(t, dtype=torch.bool)  # padding attends to itself only (no empty softmax rows)
    loss_mask = torch.zeros((len(samples), r_max), dtype=torch.float32)
    logp_behav = torch.zeros((len(samples), r_max), dtype=torch.float32)
    src_row: list[int] = []
    src_col: list[int] = []
    targets: list[int] = []
    dst_sample: list[int] = []
    dst_pos: list[int] = []
    for row, (prompt, group) in enumerate(zip(prompts, groups, strict=True)):
        p = len(prompt)
        input_ids[row, :p] = torch.from_numpy(prompt)
        position_ids[row, :p] = torch.arange(p)
        attention[row, 0, :p, :p] = torch.ones((p, p), dtype=torch.bool).tril()
        at = p
        for s in group:
            resp = responses[s]
            n = len(resp)
            if n == 0:
                continue
            input_ids[row, at : at + n] = torch.from_numpy(resp)
            position_ids[row, at : at + n] = torch.arange(p, p + n)
            attention[row, 0, at : at + n, :p] = True
            attention[row, 0, at : at + n, at : at + n] = torch.ones((n, n), dtype=torch.bool).tril()
            # token j is predicted at the previous position: the prompt's last for j = 0
            src_row += [row] * n
            src_col += [p - 1] + list(range(at, at + n - 1))
            targets += resp.tolist()
            dst_sample += [s] * n
            dst_pos += list(range(n))
            loss_mask[s, :n] = 1.0
            logp_behav[s, :n] = torch.from_numpy(samples[s].behavior_logprobs.numpy().astype("float32"))
            at += n
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return SharedBatch(input_ids, position_ids, attention, as_long(src_row), as_long(src_col), as_long(targets),
                       as_long(dst_sample), as_long(dst_pos), loss_mask, logp_behav,
                       [samples[g[0]].adapter for g in groups])


def shared_width(samples: Sequence[Any], group: Sequence[int]) -> int:
    """Tokens of the packed row of ``group`` (one prompt, every response)."""
    return int(samples[group[0]].prompt_ids.shape[0]) + sum(int(samples[i].response_ids.shape[0]) for i in group)
