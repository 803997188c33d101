"""The rollouter's engines by ``models.<m>.rollouter.backend``: Chorus's own, or vLLM in-process.

Each builder takes the network and tokenizer Chorus loaded for the model and returns an engine; the service
wires any of them to a batcher the same way (a static engine to :class:`Batcher`, a stepwise one to
:class:`ContinuousBatcher`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from services.rollouter.continuous import make_engine, support_problem
from services.rollouter.speculate import Speculation
from shared.kernel.config import ChorusConfig
from shared.models.loading import Tokenizer, resolve_device

Builder = Callable[..., Any]


def chorus_engine(cfg: ChorusConfig, model: str, net: torch.nn.Module, tok: Tokenizer, *, seed: int,
                  fallbacks: list[str]) -> Any:
    """Chorus's continuous engine (or its static one, for models the continuous engine does not compute)."""
    rc = cfg.models[model].rollouter
    if rc.engine == "continuous" and (why := support_problem(net)) is not None:
        fallbacks.append(f"continuous batching is not available for this model; batching statically ({why})")
    return make_engine(net, tok, kind=rc.engine, seed=seed, max_batch=rc.max_batch, max_tokens=rc.max_tokens,
                       speculate=Speculation(**rc.speculate.model_dump()))


def vllm_engine(cfg: ChorusConfig, model: str, net: torch.nn.Module, tok: Tokenizer, *, seed: int,
                fallbacks: list[str]) -> Any:
    """vLLM in this process, serving the weights Chorus built (its staging copy stays on the host)."""
    from services.rollouter.vllm_engine import VllmEngine

    mc = cfg.models[model]
    device = resolve_device(cfg, model)
    return VllmEngine(net.to("cpu"), tok, settings=mc.rollouter.vllm, seed=seed, max_batch=mc.rollouter.max_batch,
                      dtype=mc.dtype, device=device.type)


BACKENDS: dict[str, Builder] = {"chorus": chorus_engine, "vllm": vllm_engine}


def build_engine(cfg: ChorusConfig, model: str, net: torch.nn.Module, tok: Tokenizer, *, seed: int,
                 fallbacks: list[str]) -> Any:
    """The engine ``models.<model>.rollouter.backend`` names; ``fallbacks`` gets why the configured engine could
    not be used, where a builder fell back to another."""
    return BACKENDS[cfg.models[model].rollouter.backend](cfg, model, net, tok, seed=seed, fallbacks=fallbacks)


__all__ = ["BACKENDS", "build_engine", "chorus_engine", "vllm_engine"]
