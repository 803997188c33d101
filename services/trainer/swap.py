"""A learner's training state as one contiguous buffer (FlexMARL's state swap, §6.2): export it, import it into
another learner of the same model, and that learner continues exactly as if it had never left.

The state is every trainable tensor (a LoRA model's adapters; a full model's parameters), AdamW's per-parameter
tensors (moments and step counters), the gradients accumulated since the last optimizer step, the torch RNG
state; and, beside the buffer, a small record of the rest (version, samples accumulated, the loss statistics of the
step so far, samples held for a batch-level estimator, AdamW's hyper-parameters). The buffer uses the weight
flattening (:func:`shared.models.weights.flatten`: 64-byte aligned slots, bucket checksums), so a swap is one copy
out and one copy in, never one message per tensor. A LoRA model's frozen base is not in it: every learner of the
model builds the same base from the model's files, and it never changes.

Knows nothing of processes or NATS: :mod:`services.trainer.pool` moves the buffers.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch

from services.trainer.learner import Learner
from shared.models.weights import Buffer, WeightsHeader, flatten, load_into

W, OPT, GRAD, RNG = "w/", "o/", "g/", "rng/"


@dataclass
class SwapMeta:
    """What travels beside the buffer (small, pickled)."""

    version: int
    accumulated: int
    loss_sum: float
    parts: list[dict[str, float]]
    reward_kl: list[dict[str, float]]
    held: bytes  # the samples held for the step (reinforce_pp, MARFT), pickled
    param_groups: list[dict[str, Any]]  # AdamW's settings per group, without the parameters

    def pack(self) -> bytes:
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def unpack(data: bytes) -> SwapMeta:
        meta = pickle.loads(data)
        if not isinstance(meta, SwapMeta):
            raise ValueError(f"not a learner state record: {type(meta).__name__}")
        return meta


def _trainable(learner: Learner) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in learner.net.named_parameters() if p.requires_grad}


def state_tensors(learner: Learner) -> dict[str, torch.Tensor]:
    """The learner's state tensors by slot name, in buffer order (views, not copies)."""
    params = _trainable(learner)
    named: dict[str, torch.Tensor] = {W + n: p.detach() for n, p in params.items()}
    for n, p in params.items():
        for k, v in sorted(learner.optimizer.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor):
                named[f"{OPT}{k}/{n}"] = v
    for n, p in params.items():
        if p.grad is not None:
            named[GRAD + n] = p.grad.detach()
    named[RNG + "cpu"] = torch.get_rng_state()
    if learner.device.type == "cuda":
        named[RNG + "cuda"] = torch.cuda.get_rng_state(learner.device)
    return named


def export_state(learner: Learner, out: Buffer | None = None, bucket_bytes: int = 64 * 1024 * 1024,
                 checksums: bool = False) -> tuple[WeightsHeader, Buffer, SwapMeta]:
    """Set: the learner's training state into one buffer (``out`` reused when large enough) and its record.
    Without ``checksums`` (the default: the buffer stays on this host) it cannot be imported with ``verify``."""
    named = state_tensors(learner)
    header, buf = flatten(learner.model_name, learner.version, named, bucket_bytes=bucket_bytes, out=out,
                          checksums=checksums)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in learner.optimizer.param_groups]
    meta = SwapMeta(learner.version, learner.accumulated, learner._loss_sum, list(learner._parts),
                    list(learner._reward_kl), pickle.dumps(learner._held, protocol=pickle.HIGHEST_PROTOCOL), groups)
    return header, buf, meta


def state_bytes(learner: Learner) -> int:
    """Bytes :func:`export_state` writes for this learner now (the buffer's size, alignment included)."""
    from shared.models.weights import layout

    return layout(state_tensors(learner))[1]


def import_state(learner: Learner, header: WeightsHeader, body: Buffer | memoryview, meta: SwapMeta,
                 verify: bool = False) -> None:
    """Get: ``learner`` (of the same model and config) takes the exported state, in place: its trainable tensors,
    AdamW's state (created where this learner has none yet, dropped where the export had none), its gradients
    (None where the export had none), RNG and counters. Checked before the first copy: a buffer of another model
    leaves the learner as it was."""
    params = _trainable(learner)
    targets: dict[str, torch.Tensor] = {}
    opt_state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    grads: dict[str, torch.Tensor] = {}
    for slot in header.slots:
        name = slot.name
        dtype = getattr(torch, slot.dtype)
        if name.startswith(W):
            p = params.get(name[len(W):])
            if p is None:
                raise ValueError(f"state of {header.model} names {name[len(W):]!r}, which {learner.model_name} does "
                                 "not train")
            targets[name] = p.data
        elif name.startswith(OPT):
            key, _, pname = name[len(OPT):].partition("/")
            p = params.get(pname)
            if p is None:
                raise ValueError(f"optimizer state for {pname!r}, which {learner.model_name} does not train")
            have = learner.optimizer.state.get(p, {}).get(key)
            if not (isinstance(have, torch.Tensor) and tuple(have.shape) == slot.shape and have.dtype == dtype):
                # AdamW keeps its step counters on the CPU (not fused, not capturable), the moments beside the weight
                device = torch.device("cpu") if key == "step" else p.device
                have = torch.empty(slot.shape, dtype=dtype, device=device)
            opt_state.setdefault(p, {})[key] = have
            targets[name] = have
        elif name.startswith(GRAD):
            pname = name[len(GRAD):]
            p = params.get(pname)
            if p is None:
                raise ValueError(f"gradient for {pname!r}, which {learner.model_name} does not train")
            g = p.grad if p.grad is not None and p.grad.shape == p.shape else torch.empty_like(p)
            grads[pname] = g
            targets[name] = g
        elif name == RNG + "cpu":
            targets[name] = torch.empty(slot.shape, dtype=dtype)
        elif name == RNG + "cuda":
            targets[name] = torch.empty(slot.shape, dtype=dtype)
        else:
            raise ValueError(f"unknown slot {name!r} in the state of {header.model}")
    missing = [n for n in params if W + n not in targets]
    if missing:
        raise ValueError(f"the state of {header.model} lacks trainable tensors {missing[:3]}")
    load_into(targets, header, body, verify=verify)
    learner.optimizer.state.clear()
    for p, st in opt_state.items():
        learner.optimizer.state[p] = st
    for n, p in params.items():
        p.grad = grads.get(n)
    torch.set_rng_state(targets[RNG + "cpu"])
    if RNG + "cuda" in targets and learner.device.type == "cuda":
        torch.cuda.set_rng_state(targets[RNG + "cuda"], learner.device)
    for group, saved in zip(learner.optimizer.param_groups, meta.param_groups, strict=True):
        group.update(saved)
    learner.version = meta.version
    learner.accumulated = meta.accumulated
    learner._loss_sum = meta.loss_sum
    learner._parts = list(meta.parts)
    learner._reward_kl = list(meta.reward_kl)
    learner._held = pickle.loads(meta.held)
