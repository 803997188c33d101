"""The rollouter's engines by ``models.<m>.rollouter.backend``: Chorus's own, or vLLM in-process; what the service
asks of one (:class:`RolloutEngine`, and :class:`StaticEngine` or :class:`StepwiseEngine` by how it generates).

Each builder takes the network and tokenizer Chorus loaded for the model and returns an engine; the service
wires any of them to a batcher the same way (a static engine to :class:`Batcher`, a stepwise one to
:class:`ContinuousBatcher`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeAlias

import torch

from services.rollouter.continuous import ContinuousEngine, Row, support_problem
from services.rollouter.engine import GenResult, SamplingParams, TorchEngine
from services.rollouter.speculate import Speculation
from shared.kernel.config import ChorusConfig
from shared.models.loading import Tokenizer, resolve_device


class RolloutEngine(Protocol):
    """What every engine gives the service: the weights it serves (by name, loaded in place), their version, the
    adapters it serves and the limits a request is checked against."""

    @property
    def version(self) -> int: ...

    @property
    def adapters(self) -> tuple[str, ...]: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def context(self) -> int | None: ...

    def check_adapter(self, adapter: str | None) -> None: ...

    def named_tensors(self) -> dict[str, torch.Tensor]: ...

    def loaded(self, version: int) -> None: ...

    def close(self) -> None: ...


class StaticEngine(RolloutEngine, Protocol):
    """An engine that generates a whole batch in one call (:class:`~services.rollouter.batcher.Batcher`)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                 adapters: Sequence[str | None] | None = None) -> list[GenResult]: ...


class StepwiseEngine(RolloutEngine, Protocol):
    """An engine stepped row by row (:class:`~services.rollouter.batcher.ContinuousBatcher`): rows join between
    steps, finished rows leave."""

    @property
    def busy(self) -> bool: ...

    @property
    def rows_in_flight(self) -> int: ...

    @property
    def running(self) -> list[Row]: ...

    def check_fits(self, prompt_len: int, params: SamplingParams) -> None: ...

    def row(self, prompt: Sequence[int], params: SamplingParams, adapter: str | None = None,
            handle: Any = None) -> Row: ...

    def step(self, new_rows: Iterable[Row] = ()) -> list[Row]: ...

    def reset(self) -> list[Row]: ...


Engine: TypeAlias = TorchEngine | ContinuousEngine | StepwiseEngine
Builder = Callable[..., Engine]


def make_engine(model: torch.nn.Module, tokenizer: Tokenizer | None, *, kind: str, **kw: Any) -> TorchEngine | ContinuousEngine:
    """A :class:`ContinuousEngine` when ``kind`` is continuous and the model is supported, else the static one."""
    if kind == "continuous" and support_problem(model) is None:
        return ContinuousEngine(model, tokenizer, **kw)
    kw.pop("max_tokens", None)
    kw.pop("speculate", None)
    return TorchEngine(model, tokenizer, **kw)


def chorus_engine(cfg: ChorusConfig, model: str, net: torch.nn.Module, tok: Tokenizer, *, seed: int,
                  fallbacks: list[str]) -> TorchEngine | ContinuousEngine:
    """Chorus's continuous engine (or its static one, for models the continuous engine does not compute)."""
    rc = cfg.models[model].rollouter
    if rc.engine == "continuous" and (why := support_problem(net)) is not None:
        fallbacks.append(f"continuous batching is not available for this model; batching statically ({why})")
    return make_engine(net, tok, kind=rc.engine, seed=seed, max_batch=rc.max_batch, max_tokens=rc.max_tokens,
                       speculate=Speculation(**rc.speculate.model_dump()))


def vllm_engine(cfg: ChorusConfig, model: str, net: torch.nn.Module, tok: Tokenizer, *, seed: int,
                fallbacks: list[str]) -> StepwiseEngine:
    """vLLM in this process, serving the weights Chorus built (its staging copy stays on the host)."""
    from services.rollouter.vllm_engine import VllmEngine

    mc = cfg.models[model]
    device = resolve_device(cfg, model)
    return VllmEngine(net.to("cpu"), tok, settings=mc.rollouter.vllm, seed=seed, max_batch=mc.rollouter.max_batch,
                      dtype=mc.dtype, device=device.type)


BACKENDS: dict[str, Builder] = {"chorus": chorus_engine, "vllm": vllm_engine}


def build_engine(cfg: ChorusConfig, model: str, net: torch.nn.Module, tok: Tokenizer, *, seed: int,
                 fallbacks: list[str]) -> Engine:
    """The engine ``models.<model>.rollouter.backend`` names; ``fallbacks`` gets why the configured engine could
    not be used, where a builder fell back to another."""
    return BACKENDS[cfg.models[model].rollouter.backend](cfg, model, net, tok, seed=seed, fallbacks=fallbacks)


__all__ = ["BACKENDS", "Engine", "RolloutEngine", "StaticEngine", "StepwiseEngine", "build_engine", "chorus_engine",
           "make_engine", "vllm_engine"]
