"""Model construction shared by the rollouter and the trainer (torch is imported lazily)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from shared.kernel.config import ChorusConfig
from shared.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

if TYPE_CHECKING:
    import torch


def model_seed(cfg: ChorusConfig, model: str) -> int:
    """Deterministic per-model init seed: the same v0 weights in every process of a run."""
    digest = hashlib.sha256(f"{cfg.run.seed}:{model}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def build_model(cfg: ChorusConfig, model: str) -> torch.nn.Module:
    """A tiny random-initialised Llama-style causal LM over the byte vocabulary, in ``models.<m>.dtype``, on the CPU.

    Initialised in float32 and then cast, so a bfloat16 model holds the rounded float32 version-0 weights.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    arch = cfg.models[model].arch
    hf_cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_heads,
        max_position_embeddings=arch.max_position,
        initializer_range=arch.init_std,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )
    devnull = torch.random.fork_rng()
    with devnull:
        torch.manual_seed(model_seed(cfg, model))
        net = LlamaForCausalLM(hf_cfg)
    return net.to(getattr(torch, cfg.models[model].dtype))
