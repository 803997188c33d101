"""The trainer's backends by ``models.<m>.trainer.backend`` and ``train.pool``: what the trainer service asks of a
learner (:class:`TrainerBackend`), and the factory that builds one.

Three implement it: the torch :class:`~services.trainer.learner.Learner` (in this process), rank 0 of a DeepSpeed
group (:class:`~services.trainer.zero.TrainerGroup`, its other ranks in processes of their own), and a tenant of
FlexMARL's training pool (:class:`~services.trainer.pool.PooledLearner`, its learner in a slot's worker). Every
method runs torch work or waits on it: the service calls them from its one worker thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from shared.kernel.config import ChorusConfig
from shared.kernel.schemas import Sample

if TYPE_CHECKING:
    from services.trainer.learner import StepResult


@runtime_checkable
class TrainerBackend(Protocol):
    """A model's learner as the trainer service drives it: micro-batches in, one optimizer step per global
    batch, its state out (weight sync, commits, checkpoints) and back in (restore)."""

    @property
    def model_name(self) -> str: ...

    @property
    def version(self) -> int:
        """Optimizer steps applied: the weights' version."""

    @property
    def accumulated(self) -> int:
        """Samples in since the last step."""

    @property
    def vocab_size(self) -> int:
        """What the service checks a sample's token ids against."""

    @property
    def context(self) -> int | None:
        """The model's context length (None: unbounded)."""

    @property
    def adapters(self) -> list[str] | None:
        """The LoRA adapters a sample may name (None: a full model)."""

    def micro_batch(self, samples: Sequence[Sample], keep_idx: Sequence[int], estimator: str) -> float: ...

    def ready(self) -> bool: ...

    def step(self) -> StepResult | None: ...

    def named_tensors(self) -> dict[str, torch.Tensor]: ...

    def optimizer_state(self) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def save_checkpoint(self, directory: Path) -> Path: ...

    def restore_latest(self, directory: Path) -> Path | None: ...

    def close(self) -> None: ...


def make_learner(cfg: ChorusConfig, model: str, threads: int = 1) -> TrainerBackend:
    """The learner of ``model``'s trainer backend in this process: the torch learner, or rank 0 of a DeepSpeed group
    (a training pool's tenant is built by the service, which holds the pool)."""
    if cfg.models[model].trainer.backend == "deepspeed":
        from services.trainer.zero import TrainerGroup

        return TrainerGroup(cfg, model, threads)
    from services.trainer.learner import Learner

    return Learner(cfg, model)


__all__ = ["TrainerBackend", "make_learner"]
