"""DeepSpeed ZeRO trainer groups (``models.<m>.trainer.backend: deepspeed``): one model trained by ``ranks``
processes, rank 0 the trainer service, the others following it.

Rank 0 (:class:`TrainerGroup`) has the torch :class:`~services.trainer.learner.Learner`'s surface, so the service
runs unchanged: it alone talks to NATS. It starts ranks 1..N-1 (``python -m services.trainer.zero``), and each
call that needs the group (a step, the weights of a sync, a commit's save and a restore) is broadcast to every rank
as a verb over a gloo process group, then run by all of them in the same order.

A step is computed when its global batch is in: a micro-batch only records its samples (their advantages over its
own groups are computed at the step, exactly as the torch learner computes them on arrival), and at the step the
kept samples are dealt to the ranks, prompt group by prompt group, balanced by tokens. The step's normalisation
(the samples, or the response tokens, of the whole batch) is then known before any backward, so each rank scales
its losses by it and by the number of ranks (DeepSpeed averages gradients over ranks), and the sum over all ranks
is the torch learner's gradient. Sub-batches never mix adapters, and every rank runs as many of each adapter's
sub-batches as the rank with most (padding with zero-loss ones): ZeRO-2 and -3 reduce gradients during the
backward, which must meet the same parameters in the same order on every rank.

A commit saves AdamW's shards with DeepSpeed's own checkpointing (``<run>/checkpoints/<m>/zero/v<N>``, every rank
its files, synced to disk before the commit is written); a restore loads them on every rank. A rank that dies takes
the group with it: a follower whose rank 0 is gone exits, and rank 0 fails its next collective (the service exits
and its supervisor starts the whole group again from the committed version).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import importlib.util
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.trainer import marft_step, optstep
from services.trainer.advantages import micro_batch_advantages
from services.trainer.learner import (
    Collated,
    Learner,
    StepResult,
    restore_latest,
    save_checkpoint,
    token_layout,
)
from services.trainer.logprobs import prompt_groups
from shared.kernel.config import ChorusConfig, ConfigError, deep_merge
from shared.kernel.memcap import MemoryGroup, OutOfMemory, group_from_env, out_of_memory
from shared.kernel.schemas import Sample
from shared.models.loading import resolve_device, shipped_tensors
from shared.rlmath.advantages import batch_advantages, batch_token_advantages

BUCKET = 20_000_000  # elements of a ZeRO gradient or gather bucket
LIVE = 30_000_000  # ZeRO-3: gathered parameters kept alive at most
KEEP_TAGS = 3  # DeepSpeed checkpoints kept (the commit point's, and the ones before it)
PR_SET_PDEATHSIG = 1


def deepspeed_config(cfg: ChorusConfig, model: str, world: int) -> dict[str, Any]:
    """DeepSpeed's config for ``model``: ZeRO from ``trainer.deepspeed``, torch's AdamW with ``optim``'s settings,
    clipping ``optim.grad_clip``, bf16 for a bfloat16 model, and ``trainer.deepspeed.config`` merged over it.

    Chorus owns the accumulation (the micro-batch size and accumulation steps below are placeholders: each
    optimizer step is one global batch, with the accumulation boundary set by the learner)."""
    mcfg = cfg.models[model]
    ds, optim = mcfg.trainer.deepspeed, mcfg.optim
    # Buckets of 2e7 elements (80 MB in float32), not DeepSpeed's 5e8 (a 2 GB gradient bucket per rank, more than
    # the whole of a small model's training state); ZeRO-3 keeps at most 3e7 gathered parameters alive.
    zero: dict[str, Any] = {"stage": ds.zero_stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET}
    if ds.zero_stage == 3:
        # AdamW steps the rank's partition in sub-groups of BUCKET elements: its temporaries stay one bucket's size,
        # not the size of the whole partition (DeepSpeed's default sub-group is 1e9 elements)
        zero.update(stage3_prefetch_bucket_size=BUCKET // 2, stage3_max_live_parameters=LIVE,
                    stage3_max_reuse_distance=LIVE, sub_group_size=BUCKET)
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    base = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world,
        # torch's AdamW (torch_adam), the torch learner's optimizer: no compiled extension on the hot path
        "optimizer": {"type": "AdamW", "params": {"lr": optim.lr, "betas": list(optim.betas), "eps": 1e-8,
                                                   "weight_decay": optim.weight_decay, "torch_adam": True}},
        "gradient_clipping": optim.grad_clip,
        "bf16": {"enabled": mcfg.dtype == "bfloat16"},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # offload keeps torch's AdamW (DeepSpeedCPUAdam compiles at first use)
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    return deep_merge(base, ds.config)


class _Scoring(torch.nn.Module):
    """The network as DeepSpeed's engine holds it: its forward runs one scoring call, so the engine's hooks (ZeRO's
    gathers, the backward prologue) wrap the scorer's body and head calls."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        return call()


class ZeroLearner(Learner):
    """One rank's learner: the torch learner's objectives on a DeepSpeed engine. Its verbs (:meth:`run_step`,
    :meth:`gathered`, :meth:`save_zero`, :meth:`load_zero`) are collective: every rank runs them in the same order."""

    def __init__(self, cfg: ChorusConfig, model: str, rank: int, world: int) -> None:
        import deepspeed

        _return_freed_memory()
        super().__init__(cfg, model)
        self.rank, self.world = rank, world
        self.settings = cfg.models[model].trainer.deepspeed
        self.stage = self.settings.zero_stage
        self.token_mean = self.loss_agg == "token-mean"
        # the most samples one forward of a rank holds activations for: a micro-batch's, as in the torch learner
        self.sub_samples = cfg.train.micro_batch
        config = deepspeed_config(cfg, model, world)
        module = _Scoring(self.net)
        groups = self._param_groups(module)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=module, model_parameters=groups, config=config)
        # A full model's frozen reference: sharded too under ZeRO-3 (an engine without an optimizer).
        self.ref_engine: Any = None
        if self.reference is not None and not self.lora and self.stage == 3:
            ref_config = {k: config[k] for k in ("train_micro_batch_size_per_gpu", "train_batch_size", "bf16")}
            ref_config["zero_optimization"] = {"stage": 3}
            self.ref_engine = deepspeed.initialize(model=_Scoring(self.reference.net), config=ref_config)[0]
        self.pending: list[tuple[list[Sample], list[int], str]] = []
        self.zero_dir = cfg.run_dir / "checkpoints" / model / "zero"

    def _param_groups(self, module: torch.nn.Module) -> list[dict[str, Any]]:
        """AdamW's parameter groups: one per LoRA adapter (the step of a batch without one of them leaves that one
        and its AdamW state exactly as they were, as the torch learner does: :meth:`_untouched`), else one."""
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.adapter_group: dict[str, int] = {}
        if not self.lora or self.adapters is None:
            return [{"params": [p for _, p in named]}]
        groups: list[dict[str, Any]] = []
        taken: set[int] = set()
        for adapter in self._adapter_order():
            mine = [p for n, p in named if f".{adapter}." in n and id(p) not in taken]
            if mine:
                self.adapter_group[str(adapter)] = len(groups)
                groups.append({"params": mine})
                taken |= {id(p) for p in mine}
        rest = [p for _, p in named if id(p) not in taken]
        return groups + ([{"params": rest}] if rest else [])

    @contextlib.contextmanager
    def _untouched(self, adapters: set[str]) -> Iterator[None]:
        """An optimizer step that leaves ``adapters`` (trained by none of the step's samples) as the torch learner
        leaves a parameter without a gradient: their groups at lr 0 (AdamW then moves nothing, weight decay
        included), and their AdamW state (moments, step count; none before a first step) put back after it."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        saved: list[tuple[dict[str, Any], float, list[tuple[Any, dict[str, Any] | None]]]] = []
        for adapter in sorted(adapters):
            g = self.adapter_group.get(adapter)
            if g is None or g >= len(inner.param_groups):
                continue
            group = inner.param_groups[g]
            states = [(p, {k: v.clone() if torch.is_tensor(v) else v for k, v in inner.state[p].items()}
                       if p in inner.state else None) for p in self._state_keys(inner, g)]
            saved.append((group, group["lr"], states))
            group["lr"] = 0.0
        try:
            yield
        finally:
            for group, lr, states in saved:
                group["lr"] = lr
                for p, state in states:
                    if state is None:
                        inner.state.pop(p, None)
                    else:
                        inner.state[p] = state

    def _state_keys(self, inner: Any, g: int) -> list[Any]:
        """The tensors AdamW keys group ``g``'s state by: its parameters (ZeRO-1/2: the group's flat fp32 partition),
        or under ZeRO-3 the flat fp32 partitions of its sub-groups (put into the group only during a step)."""
        flats = getattr(self.optimizer, "fp32_partitioned_groups_flat", None)
        to_group = getattr(self.optimizer, "sub_group_to_group_id", None)
        if flats is not None and isinstance(to_group, dict):
            return [flats[sub] for sub, gid in sorted(to_group.items()) if gid == g]
        return list(inner.param_groups[g]["params"])

    # --- rank 0, local: micro-batches are recorded; the step computes them ------------------
    def micro_batch(self, samples: Sequence[Sample], keep_idx: Sequence[int], estimator: str) -> float:
        self.pending.append((list(samples), list(keep_idx), estimator))
        self.accumulated += len(keep_idx)
        return 0.0

    def take_pending(self) -> list[tuple[list[Sample], list[int], str]]:
        pending, self.pending = self.pending, []
        return pending

    def ready(self) -> bool:
        """As the torch learner's: ``global_batch`` samples in, or for MARFT every sample of the on-policy batch."""
        if self.marft:
            kept = [samples[i] for samples, keep_idx, _ in self.pending for i in keep_idx]
            if kept:
                return self.accumulated >= max(s.batch_samples or self.global_batch for s in kept)
        return self.accumulated >= self.global_batch

    # --- collective ------------------------------------------------------------------------
    def run_step(self, pending: list[tuple[list[Sample], list[int], str]]) -> StepResult:
        """The optimizer step of one global batch (``pending``: its micro-batches as :meth:`micro_batch` got them)."""
        if self.marft:
            return self._marft_step(pending)
        self.pending, self.accumulated = [], 0
        items = self._advantaged(pending)
        n = len(items)
        tokens = sum(int(s.response_ids.shape[0]) for s, _ in items)
        # what the torch learner multiplies the accumulated gradients by, applied to each loss instead
        scale = self.global_batch / max(tokens, 1) if self.token_mean else self.global_batch / max(n, 1)
        mine = self._deal(items)
        plan = self._plan(mine)
        self._clear_partitioned_grads()
        loss_sum, parts = 0.0, []
        total = sum(count for _, _, count in plan)
        done = 0
        for adapter, batches, count in plan:
            for j in range(count):
                done += 1
                self.engine.set_gradient_accumulation_boundary(done == total)
                if j < len(batches):
                    advs, batch = batches[j]
                    loss, stats = self._sub_batch_loss(batch, advs)
                    self._backward(loss * (scale * self.world))
                    loss_sum += float(loss.detach())
                    parts.append(stats)
                else:
                    self._backward(self._idle_loss(adapter))
        gathered: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(gathered, (loss_sum, parts))
        loss_sum = sum(g[0] for g in gathered)
        parts = [p for g in gathered for p in g[1]]
        lr = optstep.scheduled_lr(self.optim, self.version, self.max_versions)
        optstep.set_lr(self.optimizer, lr)
        if total:  # the engine clips (gradient_clipping) and skips a step whose gradients overflow
            with self._untouched(set(self.adapter_group) - {str(s.adapter) for s, _ in items}):
                self.engine.step()
        norm = self.engine.get_global_grad_norm() if total else 0.0
        grad_norm = float(norm) if norm is not None else 0.0
        skipped = not np.isfinite(grad_norm)
        if not skipped:
            self.version += 1
        stats = optstep.step_stats(parts, lr, self._reward_kl)
        self._reward_kl = []
        return StepResult(self.version, n, loss_sum * scale, grad_norm, stats, skipped)

    def _marft_step(self, pending: list[tuple[list[Sample], list[int], str]]) -> StepResult:
        """MARFT's step (services/trainer/marft_step.py) on the group: the same selection of the agent to train,
        the same loss over the selected samples (a mean over all of their actions, or tokens, whichever rank holds
        them: each rank's part scaled by the ranks, as DeepSpeed averages), the trust region's KL summed over the
        ranks; a step it cuts leaves the weights and AdamW's state as they were."""
        self.pending, self.accumulated = [], 0
        mc = self.marft_cfg
        token = mc.variant == "token"
        held = [samples[i] for samples, keep_idx, _ in pending for i in keep_idx]
        adv = marft_step.step_advantages(held, token)
        train_idx, untrained, why, stats = marft_step.selection(self, held)
        chosen = [held[i] for i in train_idx]
        settings, total_tokens, words = marft_step.settings_of(self, chosen, token)
        items = [(s, (adv[i], None if words is None else words[k])) for k, (i, s) in enumerate(
            zip(train_idx, chosen, strict=True))]
        plan = self._plan(self._deal(items))
        self._clear_partitioned_grads()
        loss_sum, kl_sum, parts = 0.0, 0.0, []
        total = sum(count for _, _, count in plan)
        done = 0
        for adapter, batches, count in plan:
            for j in range(count):
                done += 1
                self.engine.set_gradient_accumulation_boundary(done == total)
                if j < len(batches):
                    pairs, batch = batches[j]
                    loss, kl, part = marft_step.sub_batch(self, batch, [a for a, _ in pairs],
                                                          None if words is None else [w for _, w in pairs],
                                                          settings, total_tokens, token)
                    self._backward(loss * self.world)
                    loss_sum += float(loss.detach())
                    kl_sum += kl
                    parts.append(part)
                else:
                    self._backward(self._idle_loss(adapter))
        gathered: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(gathered, (loss_sum, kl_sum, parts))
        loss_sum = sum(g[0] for g in gathered)
        kl = marft_step.step_kl(self, sum(g[1] for g in gathered), len(chosen), total_tokens, token)
        parts = [p for g in gathered for p in g[2]]
        if chosen:
            stats.update(optstep.merge_token_stats(parts))
        stats["approx_kl"] = kl
        cut = bool(chosen) and mc.kl_target is not None and kl > mc.kl_target
        lr = optstep.scheduled_lr(self.optim, self.version, self.max_versions)
        optstep.set_lr(self.optimizer, lr)
        grad_norm, skipped = 0.0, False
        if total and not cut:
            with self._untouched(set(self.adapter_group) - {str(s.adapter) for s in chosen}):
                self.engine.step()
            norm = self.engine.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else 0.0
            skipped = not np.isfinite(grad_norm)
        elif cut:
            self.engine.zero_grad()
            self._clear_partitioned_grads()
            untrained["kl_cut"] = [s.sample_id for s in chosen]
            why["kl_cut"] = (f"trust-region cut: approximate KL {kl:.3g} > marft.kl_target {mc.kl_target:g} at "
                             f"version {self.version}; the policy step is skipped")
        if not skipped:
            self.version += 1
        stats.update(lr=lr, kl_cut=float(cut), trained_samples=float(0 if cut else len(chosen)))
        return StepResult(self.version, len(held), loss_sum, grad_norm, stats, skipped, untrained, why)

    def gathered(self, sink: str | None = None) -> dict[str, torch.Tensor]:
        """The shipped tensors, whole (gathered from their ZeRO-3 shards), as clones on rank 0 (the other ranks
        return nothing: only rank 0's answer is used). Gathered :data:`LIVE` elements at a time, so that no rank
        ever holds the whole model twice. ``sink``: a directory where rank 0 writes each gathered part as it comes
        (``<n>.pt``) instead of keeping it, so that not even rank 0 holds the whole model at once."""
        own = shipped_tensors(self.net, self.lora)
        if self.stage < 3:
            whole = {k: t.detach().clone() for k, t in own.items()}
            if sink is not None and self.rank == 0:
                torch.save(whole, Path(sink) / "0000.pt")
                return {}
            return whole
        import deepspeed

        out: dict[str, torch.Tensor] = {}
        names = list(own)
        i = 0
        while i < len(names):
            chunk: list[str] = []
            size = 0
            while i < len(names) and (not chunk or size + getattr(own[names[i]], "ds_numel", 0) <= LIVE):
                chunk.append(names[i])
                size += getattr(own[names[i]], "ds_numel", own[names[i]].numel())
                i += 1
            with deepspeed.zero.GatheredParameters([own[k] for k in chunk], modifier_rank=None):
                if self.rank == 0 and sink is not None:
                    torch.save({k: own[k].detach().clone() for k in chunk}, Path(sink) / f"{i:06d}.pt")
                elif self.rank == 0:
                    out.update({k: own[k].detach().clone() for k in chunk})
        return out

    def save_zero(self, tag: str) -> dict[str, Any]:
        """DeepSpeed's checkpoint of this version (weights and AdamW's shards) as ``zero/<tag>``, on disk."""
        self.engine.save_checkpoint(str(self.zero_dir), tag=tag, client_state={"version": self.version},
                                    save_latest=False, exclude_frozen_parameters=self.lora)
        _sync_tree(self.zero_dir / tag)
        torch.distributed.barrier()
        if self.rank == 0:
            _prune_tags(self.zero_dir, keep=KEEP_TAGS)
        return {"deepspeed": {"tag": tag, "ranks": self.world, "zero_stage": self.stage}}

    def save_swap(self, directory: str) -> None:
        """The training pool's Set of a gang: every rank writes its shard (weights and AdamW's) to ``directory``
        (host memory), DeepSpeed's checkpoint format; an older state there is replaced."""
        where = Path(directory)
        if self.rank == 0 and where.exists():
            shutil.rmtree(where)
        torch.distributed.barrier()
        self.engine.save_checkpoint(str(where), tag="swap", client_state={"version": self.version},
                                    save_latest=False, exclude_frozen_parameters=self.lora)
        torch.distributed.barrier()

    def load_swap(self, directory: str, version: int) -> None:
        """The pool's Get of a gang: every rank reads its shard back (the gang has as many ranks as it had)."""
        self.engine.load_checkpoint(directory, tag="swap", load_optimizer_states=True,
                                    load_lr_scheduler_states=False, load_module_strict=not self.lora)
        self.version = version
        self.pending, self.accumulated, self._reward_kl = [], 0, []

    def load_zero(self, version: int, tensors: dict[str, torch.Tensor] | None, ref: dict[str, Any] | None) -> str:
        """Restore ``version``: DeepSpeed's checkpoint named by ``ref`` where it is on disk (weights and AdamW), else
        ``tensors`` (rank 0's; the others receive them) with a fresh AdamW. Returns what was loaded."""
        tag = ref.get("tag") if ref else None
        found = bool(tag) and (self.zero_dir / str(tag)).is_dir()
        everywhere = torch.tensor([int(found)])
        torch.distributed.all_reduce(everywhere, op=torch.distributed.ReduceOp.MIN)
        if everywhere.item():
            self.engine.load_checkpoint(str(self.zero_dir), tag=str(tag), load_optimizer_states=True,
                                        load_lr_scheduler_states=False, load_module_strict=not self.lora)
            how = f"deepspeed checkpoint {tag}"
        else:
            self._assign(tensors)
            how = "weights only (no deepspeed checkpoint of this version on disk: AdamW starts afresh)"
        self.version = version
        self.pending, self.accumulated, self._reward_kl = [], 0, []
        return how

    def close(self) -> None:
        self.engine.destroy()

    # --- the step's parts -------------------------------------------------------------------
    def _clear_partitioned_grads(self) -> None:
        """ZeRO-3 copies a parameter's gradient into its partition at a step's first backward and adds it at the
        later ones: a parameter first reached by a later backward (another adapter's sub-batch) would add onto the
        last step's gradient. Every step starts from zeros."""
        flat = getattr(self.optimizer, "grad_partitions_flat_buffer", None)
        if isinstance(flat, torch.Tensor):
            flat.zero_()

    def _advantaged(self, pending: list[tuple[list[Sample], list[int], str]]) -> list[tuple[Sample, Any]]:
        """Every kept sample of the step with its advantage, as :meth:`Learner.micro_batch` and the step compute
        them (each micro-batch's groups; the whole batch for reinforce_pp)."""
        items: list[tuple[Sample, Any]] = []
        held: list[Sample] = []
        for samples, keep_idx, estimator in pending:
            kept = [samples[i] for i in keep_idx]
            if self.batch_level:
                held += kept
            elif self.kl_reward:
                pens = self._penalties(kept)
                adv = micro_batch_advantages([s.reward - float(p.sum()) for s, p in zip(kept, pens, strict=True)],
                                             [s.group_key for s in kept], [None] * len(kept), estimator)
                items += zip(kept, adv.tolist(), strict=True)
            else:
                adv = micro_batch_advantages([s.reward for s in samples], [s.group_key for s in samples],
                                             [s.advantage for s in samples], estimator)
                items += [(samples[i], float(adv[i])) for i in keep_idx]
        if held:
            rewards = [s.reward for s in held]
            if self.kl_reward:
                items += zip(held, batch_token_advantages(rewards, self._penalties(held)), strict=True)
            else:
                items += zip(held, batch_advantages(rewards, [int(s.response_ids.shape[0]) for s in held]).tolist(),
                             strict=True)
        return items

    def _deal(self, items: list[tuple[Sample, Any]]) -> dict[str | None, list[tuple[Sample, Any]]]:
        """This rank's share of ``items``, by adapter: each adapter's prompt groups go whole to the rank with the
        fewest tokens so far, largest first (the same on every rank: it depends on ``items`` alone)."""
        by_adapter: dict[str | None, list[tuple[Sample, Any]]] = {}
        for item in items:
            by_adapter.setdefault(item[0].adapter, []).append(item)
        mine: dict[str | None, list[tuple[Sample, Any]]] = {}
        for adapter in self._adapter_order():
            rows = by_adapter.get(adapter, [])
            groups = prompt_groups([s for s, _ in rows])
            size = [sum(int(rows[i][0].prompt_ids.shape[0] + rows[i][0].response_ids.shape[0]) for i in g)
                    for g in groups]
            load = [0] * self.world
            picked: list[int] = []
            for k in sorted(range(len(groups)), key=lambda k: (-size[k], k)):
                r = min(range(self.world), key=lambda q: (load[q], q))
                load[r] += size[k]
                if r == self.rank:
                    picked += groups[k]
            mine[adapter] = [rows[i] for i in sorted(picked)]
        return mine

    def _adapter_order(self) -> list[str | None]:
        order: list[str | None] = [*sorted(self.adapters)] if self.adapters is not None else [None]
        return order

    def _plan(self, mine: dict[str | None, list[tuple[Sample, Any]]]) -> list[tuple[str | None, list[Any], int]]:
        """Per adapter: this rank's sub-batches (advantages, batch) and how many every rank runs (the most any has)."""
        built = []
        for adapter in self._adapter_order():
            rows = mine[adapter]
            subs: list[Any] = []
            for chunk in self._chunks([s for s, _ in rows]):
                samples = [rows[i][0] for i in chunk]
                subs += [([rows[chunk[i]][1] for i in idx], batch) for idx, batch in self._batches(samples)]
            built.append((adapter, subs))
        counts = torch.tensor([len(b) for _, b in built])
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
        return [(a, b, int(c)) for (a, b), c in zip(built, counts.tolist(), strict=True)]

    def _chunks(self, samples: list[Sample]) -> list[list[int]]:
        """Indices of ``samples`` in runs of whole prompt groups of at most :attr:`sub_samples` samples (a group
        larger than that alone): a rank's forward holds the activations of at most a micro-batch, as the torch
        learner's does, however large the global batch (one sub-batch of more samples costs less time, but its
        activations grow with global_batch / ranks)."""
        out: list[list[int]] = []
        run: list[int] = []
        for group in prompt_groups(samples):
            if run and len(run) + len(group) > self.sub_samples:
                out.append(run)
                run = []
            run += group
        if run:
            out.append(run)
        return out

    def _sub_batch_loss(self, batch: Any, advs: list[Any]) -> tuple[torch.Tensor, dict[str, float]]:
        logp = self._logprobs(self.scorer, batch)
        ref = self._reference_logprobs(batch) if self.kl_loss else None
        adv = token_layout(advs, batch.loss_mask)
        return self._policy_loss(logp, batch.logp_behav, adv, batch.loss_mask, ref)

    def _idle_loss(self, adapter: str | None) -> torch.Tensor:
        """A zero loss through the same parameters as a real sub-batch of ``adapter`` (a rank with fewer), with the
        reference's forward where a real one has it (under ZeRO-3 each forward gathers with the other ranks)."""
        batch = self._idle_batch(adapter)
        logp = self._logprobs(self.scorer, batch)
        if self.kl_loss:
            self._reference_logprobs(batch)
        return logp.sum() * 0.0

    def _idle_batch(self, adapter: str | None) -> Collated:
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long)
        return Collated(ids, torch.ones_like(ids), ids[:, 1:], torch.ones((1, 1)), torch.zeros((1, 1)),
                        [adapter]).to(self.device)

    def _penalties(self, samples: list[Sample]) -> list[np.ndarray]:
        """kl_in reward: each sample's per-token penalty (:meth:`Learner.reward_penalties`), every rank computing its
        share's (padded like the step, for ZeRO-3's gathers) and all of them gathered."""
        idx = list(range(len(samples)))
        share = [i for i in idx if i % self.world == self.rank]
        stats_before = len(self._reward_kl)
        mine = self.reward_penalties([samples[i] for i in share]) if share else []
        ran = sum(1 for _ in self._batches([samples[i] for i in share]))  # the forwards reward_penalties ran
        batches = torch.tensor([ran])
        torch.distributed.all_reduce(batches, op=torch.distributed.ReduceOp.MAX)
        if self.stage == 3:
            with torch.no_grad():
                for _ in range(int(batches.item()) - ran):
                    self._reference_logprobs(self._idle_batch(self._adapter_order()[0]))
        gathered: list[Any] = [None] * self.world
        local_stats = self._reward_kl[stats_before:]
        torch.distributed.all_gather_object(gathered, (dict(zip(share, mine, strict=True)), local_stats))
        del self._reward_kl[stats_before:]
        out: dict[int, np.ndarray] = {}
        for found, stats in gathered:
            out.update(found)
            self._reward_kl.extend(stats)
        return [out[i] for i in idx]

    # --- hooks into the torch learner ------------------------------------------------------
    def _backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def _logprobs(self, scorer: Any, batch: Any) -> torch.Tensor:
        engine = self.engine if scorer.net is self.net else self.ref_engine
        if engine is None:
            return super()._logprobs(scorer, batch)
        return engine(lambda: Learner._logprobs(self, scorer, batch))

    def _assign(self, tensors: dict[str, torch.Tensor] | None) -> None:
        """Rank 0's ``tensors`` into every rank's shipped parameters (ZeRO-3: into their shards)."""
        import deepspeed

        own = shipped_tensors(self.net, self.lora)
        ctx = deepspeed.zero.GatheredParameters(list(own.values()), modifier_rank=0) if self.stage == 3 else \
            contextlib.nullcontext()
        with ctx, torch.no_grad():
            for name, p in own.items():
                if self.rank == 0:
                    assert tensors is not None
                    p.copy_(tensors[name])
                if self.stage < 3:
                    torch.distributed.broadcast(p.data, src=0)
        # ZeRO-1/2 keep their own float32 copy of each rank's partition (the weights AdamW updates, copied into the
        # parameters after each step): it must hold the assigned weights too (ZeRO-3 on float32: the same tensors)
        refresh = getattr(self.optimizer, "refresh_fp32_params", None)
        if refresh is not None:
            refresh()
        # AdamW afresh: its state of other weights would be wrong here
        for state in getattr(self.optimizer, "state", {}).values():
            state.clear()


M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's mallopt parameters


def _return_freed_memory() -> None:
    """glibc's malloc in this process: blocks of 1 MB and more mapped on their own (returned to the system when
    freed), two arenas. Its defaults (a threshold that rises to 32 MB, an arena per thread) keep the freed
    temporaries of every step cached: a 354M-parameter ZeRO-3 rank grew from 3.1 to 6.5 GB over three steps with
    them, and stayed at 4.1 GB with these (tests/deepspeed/test_memory_cap.py). A ZeRO rank exists to fit a memory
    budget, so it pays the extra page faults. No-op where glibc is not the allocator."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
        libc.mallopt(M_ARENA_MAX, 2)


def _sync_tree(path: Path) -> None:
    """fsync every file under ``path`` (this rank's and the others': each syncs what it sees) and the directory."""
    if not path.is_dir():
        return
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with contextlib.suppress(OSError):
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune_tags(directory: Path, keep: int) -> None:
    tags = sorted((int(p.name[1:]), p) for p in directory.iterdir() if p.is_dir() and p.name[1:].isdigit())
    for _, p in tags[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


# --- the group ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join(rank: int, world: int, port: int, timeout_s: float, cuda: bool) -> None:
    """This process as ``rank`` of the group's gloo world (DeepSpeed then uses it). DeepSpeed's shared-memory
    all-reduce for CPUs is left out: it compiles a C++ extension at first use (about a minute)."""
    import deepspeed.ops

    for op in ("deepspeed_shm_comm", "deepspeed_ccl_comm"):
        deepspeed.ops.__compatible_ops__[op] = False
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    if cuda:  # one GPU per rank ("cuda" is then the rank's own device)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=timeout_s))


def _environment(threads: int, cuda: bool) -> dict[str, str]:
    """What DeepSpeed reads from the environment: its accelerator (set before it is first imported)."""
    return {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cuda" if cuda else "cpu"),
            "OMP_NUM_THREADS": str(threads)}


class TrainerGroup:
    """Rank 0 of a DeepSpeed trainer group, with the torch learner's surface (what the trainer service calls).

    Local: :meth:`validate`, :meth:`micro_batch`, :meth:`ready` and the counters. Collective (broadcast as a verb
    to ranks 1..N-1, then run here): :meth:`step`, :meth:`named_tensors` under ZeRO-3, :meth:`optimizer_state`
    (a commit's DeepSpeed checkpoint), :meth:`load_state_dict` and :meth:`close`.
    """

    def __init__(self, cfg: ChorusConfig, model: str, threads: int = 1,
                 cores: Sequence[Sequence[int]] | None = None) -> None:
        """``cores``: rank r's CPU cores at ``cores[r - 1]`` (a training pool's gang: the other slots' cores)."""
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(f"models.{model}.trainer.backend is deepspeed, but deepspeed is not installed in this "
                              f"environment ({sys.executable}): `make venv-deepspeed` adds it")
        settings = cfg.models[model].trainer.deepspeed
        self.world = settings.ranks
        cuda = resolve_device(cfg, model).type == "cuda"
        os.environ.update(_environment(threads, cuda))
        port = _free_port()
        where = cfg.run_dir / "checkpoints" / model
        where.mkdir(parents=True, exist_ok=True)
        spec = where / "group-config.json"
        spec.write_text(json.dumps(cfg.model_dump(mode="json")))
        # Under a memory cap (trainer.memory_mb) every rank has a group of its own, made new beside rank 0's.
        own = group_from_env()
        self.groups: dict[int, MemoryGroup] = {} if own is None else {
            r: MemoryGroup(own[0].path.with_name(f"{own[0].path.name}-rank{r}")).create(own[1], fresh=True)
            for r in range(1, self.world)}
        placed = {r: list(cores[r - 1]) for r in range(1, self.world)} if cores else {}

        def enter(r: int) -> Callable[[], None] | None:
            if r not in self.groups and r not in placed:
                return None

            def run() -> None:
                if r in self.groups:
                    self.groups[r].enter()
                if r in placed:
                    os.sched_setaffinity(0, placed[r])
            return run

        self.children = [subprocess.Popen([sys.executable, "-m", "services.trainer.zero", str(spec), model, str(r),
                                           str(self.world), str(port),
                                           str(len(placed[r]) if r in placed else threads)],
                                          env={**os.environ, **_environment(len(placed[r]) if r in placed else threads,
                                                                            cuda)},
                                          preexec_fn=enter(r))
                         for r in range(1, self.world)]
        self.loaded = "nothing: fresh weights"  # what the last restore loaded (the service logs it)
        try:
            _join(0, self.world, port, settings.timeout_s, cuda)
            self.control = torch.distributed.new_group(backend="gloo")
            self.local = ZeroLearner(cfg, model, 0, self.world)
        except BaseException:
            self._kill()
            raise

    # what the service reads of a learner (services/trainer/backends.py): rank 0's
    @property
    def model_name(self) -> str:
        return self.local.model_name

    @property
    def version(self) -> int:
        return self.local.version

    @property
    def accumulated(self) -> int:
        return self.local.accumulated

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    @property
    def context(self) -> int | None:
        return self.local.context

    @property
    def adapters(self) -> list[str] | None:
        return self.local.adapters

    @property
    def stage(self) -> int:
        return self.local.stage

    def _all(self, verb: str, *args: Any) -> Any:
        """Run ``verb(*args)`` on every rank (broadcast first), returning rank 0's result."""
        self._broadcast(verb, args)
        return getattr(self.local, verb)(*args)

    def _broadcast(self, verb: str, args: tuple[Any, ...]) -> None:
        gone = [r for r, code in self.exit_codes().items() if code is not None]
        if gone:
            raise RuntimeError(f"trainer group of {self.local.model_name}: rank(s) {gone} exited")
        torch.distributed.broadcast_object_list([(verb, args)], src=0, group=self.control)

    def alive(self) -> bool:
        return all(c.poll() is None for c in self.children)

    def exit_codes(self) -> dict[int, int | None]:
        """Each follower rank's exit code (None: running)."""
        return {r: c.poll() for r, c in enumerate(self.children, start=1)}

    def out_of_memory(self) -> list[tuple[int, OutOfMemory]]:
        """The follower ranks the kernel's OOM killer ended (under trainer.memory_mb), with the evidence."""
        found = []
        for r, code in self.exit_codes().items():
            oom = out_of_memory(code, self.groups[r]) if r in self.groups else None
            if oom is not None:
                found.append((r, oom))
        return found

    def micro_batch(self, samples: Sequence[Sample], keep_idx: Sequence[int], estimator: str) -> float:
        return self.local.micro_batch(samples, keep_idx, estimator)

    def ready(self) -> bool:
        return self.local.ready()

    def step(self) -> StepResult | None:
        if not self.local.ready():
            return None
        result: StepResult = self._all("run_step", self.local.take_pending())
        return result

    def named_tensors(self) -> dict[str, torch.Tensor]:
        if self.local.stage < 3:
            return {k: t.detach() for k, t in shipped_tensors(self.local.net, self.local.lora).items()}
        tensors: dict[str, torch.Tensor] = self._all("gathered")
        return tensors

    def optimizer_state(self) -> dict[str, Any]:
        state: dict[str, Any] = self._all("save_zero", f"v{self.local.version}")
        return state

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.local.version, "model": {k: t.cpu() for k, t in self.named_tensors().items()},
                "optimizer": self.optimizer_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every rank to ``state``'s version: from its DeepSpeed checkpoint where the state names one that is on
        disk, else from its weights (rank 0 has them) with AdamW afresh."""
        optimizer = state.get("optimizer")
        ref = optimizer.get("deepspeed") if isinstance(optimizer, dict) else None
        version = int(state["version"])
        self._broadcast("load_zero", (version, None, ref))
        self.loaded = self.local.load_zero(version, state["model"], ref)

    def save_weights(self, directory: Path) -> list[Path]:
        """The whole weights written to ``directory`` part by part as they are gathered (rank 0 never holds them
        all at once); the parts, in order."""
        directory.mkdir(parents=True, exist_ok=True)
        self._all("gathered", str(directory))
        return sorted(directory.glob("*.pt"))

    def export_swap(self, directory: Path) -> tuple[int, bytes]:
        """The training pool's Set: every rank's shard to ``directory``, and rank 0's record of the micro-batches
        since the last step (only rank 0 has them); returns the bytes written and the record."""
        self._all("save_swap", str(directory))
        size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
        local = self.local
        record = {"version": local.version, "accumulated": local.accumulated, "pending": local.pending,
                  "reward_kl": local._reward_kl}
        return size, pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)

    def import_swap(self, directory: Path, record: bytes) -> None:
        """The pool's Get: every rank loads its shard back, rank 0 its record."""
        state = pickle.loads(record)
        self._all("load_swap", str(directory), int(state["version"]))
        self.local.pending, self.local.accumulated = state["pending"], state["accumulated"]
        self.local._reward_kl = state["reward_kl"]

    def save_checkpoint(self, directory: Path) -> Path:
        return save_checkpoint(self, directory)

    def restore_latest(self, directory: Path) -> Path | None:
        return restore_latest(self, directory)

    def close(self) -> None:
        """Every rank leaves (rank 0 last); a rank that does not within 30 s is killed."""
        with contextlib.suppress(Exception):
            if self.alive():
                torch.distributed.broadcast_object_list([("close", ())], src=0, group=self.control)
        for c in self.children:
            try:
                c.wait(timeout=30)
            except subprocess.TimeoutExpired:
                c.kill()
        with contextlib.suppress(Exception):
            self.local.close()
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group()

    def _kill(self) -> None:
        for c in self.children:
            with contextlib.suppress(ProcessLookupError):
                c.kill()


def follow(spec: Path, model: str, rank: int, world: int, port: int, threads: int) -> int:
    """Rank ``rank`` >= 1: run every verb rank 0 broadcasts until it says close, or exit when it is gone."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        return 1  # rank 0 died before this rank could follow it
    torch.set_num_threads(threads)
    cfg = ChorusConfig(**json.loads(spec.read_text()))
    settings = cfg.models[model].trainer.deepspeed
    _join(rank, world, port, settings.timeout_s, resolve_device(cfg, model).type == "cuda")
    control = torch.distributed.new_group(backend="gloo")
    learner = ZeroLearner(cfg, model, rank, world)
    while True:
        box: list[Any] = [None]
        torch.distributed.broadcast_object_list(box, src=0, group=control)
        verb, args = box[0]
        if verb == "close":
            learner.close()
            torch.distributed.destroy_process_group()
            return 0
        getattr(learner, verb)(*args)


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(follow(Path(a[0]), a[1], int(a[2]), int(a[3]), int(a[4]), int(a[5])))

