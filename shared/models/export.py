"""`chorus export`: a checkpoint of a run as a Hugging Face directory that transformers, peft and vLLM load.

A full model is written with ``save_pretrained`` (config, safetensors, generation config, and the tokenizer
when the model has a Hugging Face one). A LoRA model is written as its frozen base (``base/``) plus one PEFT
adapter directory per adapter (``adapters/<adapter>/``: adapter_config.json and adapter_model.safetensors), so
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(OUT/base), OUT/adapters/<adapter>)`` gives the
trained agent. torch is imported inside the functions: the CLI stays quick to start.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.kernel.config import ChorusConfig, ConfigError, load_config

if TYPE_CHECKING:
    import torch

_CKPT = re.compile(r"^v(\d+)\.pt$")
INFO_FILE = "chorus_export.json"


class ExportError(ValueError):
    """What cannot be exported, and what there is instead."""


@dataclass
class Exported:
    out: Path
    model: str
    version: int
    checkpoint: Path
    adapters: dict[str, list[str]] = field(default_factory=dict)  # adapter: the agents that use it
    tokenizer: bool = False


def run_config(run_dir: Path, config: Path | None = None) -> ChorusConfig:
    """The config of the run in ``run_dir``: ``config`` if given, else the ``config.yaml`` that `chorus up` wrote."""
    if not run_dir.is_dir():
        runs = sorted(p.name for p in run_dir.parent.iterdir() if p.is_dir()) if run_dir.parent.is_dir() else []
        raise ExportError(f"no run directory {run_dir}" + (f"; {run_dir.parent} has {', '.join(runs)}" if runs else ""))
    path = config or run_dir / "config.yaml"
    if not path.is_file():
        raise ExportError(f"{path} does not exist: `chorus up` writes the run's config there; for a run started "
                          "with `chorus serve`, pass the run's config with --config")
    try:
        return load_config(path)
    except ConfigError as exc:
        raise ExportError(str(exc)) from None


def checkpoints(run_dir: Path, model: str) -> dict[int, Path]:
    """The checkpoint files of ``model`` in the run, by version."""
    directory = run_dir / "checkpoints" / model
    if not directory.is_dir():
        return {}
    return {int(m.group(1)): p for p in directory.iterdir() if (m := _CKPT.match(p.name))}


def pick_checkpoint(run_dir: Path, cfg: ChorusConfig, model: str, version: int | None) -> tuple[int, Path]:
    """The checkpoint of version ``version`` (the newest when None), or an error listing what exists."""
    if model not in cfg.models:
        raise ExportError(f"the run has no model {model!r}: its models are {', '.join(sorted(cfg.models))}")
    found = checkpoints(run_dir, model)
    if not found:
        have = {m: sorted(checkpoints(run_dir, m)) for m in cfg.models}
        listed = "; ".join(f"{m}: {', '.join(f'v{v}' for v in vs) or 'none'}" for m, vs in sorted(have.items()))
        raise ExportError(f"no checkpoint of model {model!r} in {run_dir / 'checkpoints' / model} (the trainer writes "
                          f"one when the run finishes and every train.checkpoint_every versions); checkpoints: {listed}")
    if version is None:
        version = max(found)
    if version not in found:
        raise ExportError(f"no checkpoint v{version} of model {model!r}: there are "
                          f"{', '.join(f'v{v}' for v in sorted(found))}")
    return version, found[version]


def load_checkpoint(cfg: ChorusConfig, model: str, path: Path) -> torch.nn.Module:
    """Chorus's network of ``model`` (base, or peft with every adapter) on the CPU with the checkpoint's tensors."""
    import torch

    from shared.models.loading import load_model, shipped_tensors

    net = load_model(cfg, model, "cpu")
    state = torch.load(path, map_location="cpu", weights_only=True)
    saved: dict[str, torch.Tensor] = state["model"]
    own = shipped_tensors(net, cfg.models[model].lora is not None)
    if saved.keys() != own.keys():
        missing, extra = sorted(own.keys() - saved.keys()), sorted(saved.keys() - own.keys())
        raise ExportError(f"{path} does not match models.{model} of the run's config: missing {missing[:3]}, "
                          f"unexpected {extra[:3]}")
    with torch.no_grad():
        for name, t in own.items():
            if t.shape != saved[name].shape:
                raise ExportError(f"{path}: {name} has shape {tuple(saved[name].shape)}, the model {tuple(t.shape)}")
            t.copy_(saved[name])
    return net.eval()


def _save_tokenizer(cfg: ChorusConfig, model: str, out: Path) -> bool:
    from shared.models.loading import model_dir

    path = model_dir(cfg, model)
    if path is None:
        return False  # the tiny models' byte tokenizer is code, not a Hugging Face tokenizer (see the README)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(path)).save_pretrained(str(out))
    return True


def export(run_dir: Path, model: str, out: Path, version: int | None = None,
           config: Path | None = None) -> Exported:
    """Write checkpoint ``version`` (default: the newest) of ``model`` to ``out`` in Hugging Face format."""
    cfg = run_config(run_dir, config)
    version, path = pick_checkpoint(run_dir, cfg, model, version)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not empty: choose a new --out directory")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecation notes are not the user's business
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        return _export(cfg, run_dir, model, out, version, path)


def _export(cfg: ChorusConfig, run_dir: Path, model: str, out: Path, version: int, path: Path) -> Exported:
    net = load_checkpoint(cfg, model, path)
    result = Exported(out=out, model=model, version=version, checkpoint=path)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.models[model].lora is None:
        net.save_pretrained(str(out))
        result.tokenizer = _save_tokenizer(cfg, model, out)
    else:
        from shared.models.loading import load_base

        base_dir = out / "base"
        load_base(cfg, model).save_pretrained(str(base_dir))  # the frozen base, as every process builds it
        result.tokenizer = _save_tokenizer(cfg, model, base_dir)
        for adapter in cfg.adapters_of(model):
            net.peft_config[adapter].base_model_name_or_path = str(base_dir.resolve())
            # peft writes a named (non-"default") adapter into a subdirectory of that name
            net.save_pretrained(str(out / "adapters"), selected_adapters=[adapter])
            result.adapters[adapter] = sorted(a for a, c in cfg.agents.items()
                                              if c.model == model and c.adapter == adapter)
    _write_notes(cfg, result)
    return result


def _write_notes(cfg: ChorusConfig, r: Exported) -> None:
    info: dict[str, Any] = {"run": cfg.run.id, "model": r.model, "version": r.version, "checkpoint": str(r.checkpoint),
                            "source": cfg.models[r.model].source, "lora": cfg.models[r.model].lora is not None,
                            "adapters": r.adapters, "hf_tokenizer": r.tokenizer,
                            "agents": sorted(a for a, c in cfg.agents.items() if c.model == r.model)}
    (r.out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    model_path = "base" if r.adapters else "."
    lines = [f"# {r.model} of run {cfg.run.id}, version {r.version}", "",
             f"Exported by `chorus export` from {r.checkpoint}. `OUT` below is this directory.", ""]
    if r.adapters:
        lines += ["A LoRA model: the frozen base in `base/`, one PEFT adapter per directory in `adapters/`:", ""]
        lines += [f"- `adapters/{a}/`: agent(s) {', '.join(agents) or '-'}" for a, agents in r.adapters.items()]
        first = next(iter(r.adapters))
        lines += ["", "```python", "from peft import PeftModel", "from transformers import AutoModelForCausalLM", "",
                  "base = AutoModelForCausalLM.from_pretrained('OUT/base')",
                  f"agent = PeftModel.from_pretrained(base, 'OUT/adapters/{first}')", "```", "",
                  "vLLM: serve `OUT/base` with `--enable-lora --lora-modules "
                  + " ".join(f"{a}=OUT/adapters/{a}" for a in r.adapters) + "`."]
    else:
        lines += ["A full model:", "", "```python", "from transformers import AutoModelForCausalLM", "",
                  "model = AutoModelForCausalLM.from_pretrained('OUT')", "```"]
    lines += [""]
    if r.tokenizer:
        lines += [f"The tokenizer is saved beside the model (`{model_path}/`)."]
    else:
        lines += ["No tokenizer files: this tiny model uses Chorus's byte tokenizer (shared/models/tokenizer.py), which is code,",
                  "not a Hugging Face tokenizer. Token ids 0-255 are the UTF-8 bytes of the text, 256 is PAD, 257 BOS",
                  "and 258 EOS: `[257, *text.encode()]` is a prompt; decode up to the first 258."]
    (r.out / "README.md").write_text("\n".join(lines) + "\n")
