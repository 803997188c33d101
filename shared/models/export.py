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
    checkpoint: Path | None  # None: the seeded start (version 0), which has no file
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


def pick_best(run_dir: Path, cfg: ChorusConfig, model: str) -> tuple[int, Path | None]:
    """The best held-out version of ``model`` and its weights file (None: version 0, the seeded start)."""
    from shared.models import best

    if model not in cfg.models:
        raise ExportError(f"the run has no model {model!r}: its models are {', '.join(sorted(cfg.models))}")
    rec = best.read_record(run_dir)
    if rec is None:
        raise ExportError(f"no {best.record_path(run_dir)}: the best version is kept by the held-out evaluation "
                          "(eval.every > 0); export a checkpoint by its number instead")
    if model not in rec["versions"]:
        raise ExportError(f"model {model!r} is not in the best evaluation's versions {rec['versions']}")
    version = int(rec["versions"][model])
    path = best.weights_path(run_dir, model)
    if version > 0 and not path.is_file():
        raise ExportError(f"{best.record_path(run_dir)} names v{version} of {model}, but {path} is missing")
    return version, (path if version > 0 else None)


def load_checkpoint(cfg: ChorusConfig, model: str, path: Path | None) -> torch.nn.Module:
    """Chorus's network of ``model`` (base, or peft with every adapter) on the CPU with the tensors of a
    checkpoint file (``v<N>.pt``), of a packed weights file (``best.weights``), or of the seeded start (None)."""
    import torch

    from shared.models.loading import load_model, shipped_tensors

    net = load_model(cfg, model, "cpu")
    own = shipped_tensors(net, cfg.models[model].lora is not None)
    if path is None:
        return net.eval()
    if path.suffix == ".weights":
        from shared.models.weights import load_into, unpack

        header, body = unpack(path.read_bytes())
        if {s.name for s in header.slots} != set(own):
            raise ExportError(f"{path} does not match models.{model} of the run's config")
        with torch.no_grad():
            load_into(own, header, body, verify=True)
        return net.eval()
    state = torch.load(path, map_location="cpu", weights_only=True)
    saved: dict[str, torch.Tensor] = state["model"]
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


def export(run_dir: Path, model: str, out: Path, version: int | str | None = None,
           config: Path | None = None) -> Exported:
    """Write checkpoint ``version`` (default: the newest; ``"best"``: the best held-out version) of ``model`` to
    ``out`` in Hugging Face format."""
    cfg = run_config(run_dir, config)
    path: Path | None
    if version == "best":
        version, path = pick_best(run_dir, cfg, model)
    else:
        version, path = pick_checkpoint(run_dir, cfg, model, None if version is None else int(version))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not empty: choose a new --out directory")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecation notes are not the user's business
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        return _export(cfg, run_dir, model, out, version, path)


def _export(cfg: ChorusConfig, run_dir: Path, model: str, out: Path, version: int, path: Path | None) -> Exported:
    net: Any = load_checkpoint(cfg, model, path)  # a transformers or peft model: save_pretrained, peft_config
    result = Exported(out=out, model=model, version=version, checkpoint=path)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.models[model].lora is None:
        net.save_pretrained(str(out))
        result.tokenizer = _save_tokenizer(cfg, model, out)
    else:
        from shared.models.loading import load_base

        base_dir = out / "base"
        base: Any = load_base(cfg, model)  # the frozen base, as every process builds it
        base.save_pretrained(str(base_dir))
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
    agents = {a: c for a, c in sorted(cfg.agents.items()) if c.model == r.model}
    source = r.checkpoint if r.checkpoint is not None else "the seeded start (version 0)"
    info: dict[str, Any] = {"run": cfg.run.id, "model": r.model, "version": r.version, "checkpoint": str(source),
                            "source": cfg.models[r.model].source, "lora": cfg.models[r.model].lora is not None,
                            "adapters": r.adapters, "hf_tokenizer": r.tokenizer, "agents": list(agents),
                            "system_prompts": {a: c.prompt for a, c in agents.items()},
                            "chat_template": r.tokenizer}
    (r.out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    model_path = "base" if r.adapters else "."
    lines = [f"# {r.model} of run {cfg.run.id}, version {r.version}", "",
             f"Exported by `chorus export` from {source}. `OUT` below is this directory.", ""]
    # The first agent of the first adapter (or of the model) is the one the generation example prompts.
    first = next(iter(r.adapters), None)
    example = next((c for c in agents.values() if first is None or c.adapter == first), None)
    if r.adapters:
        lines += ["A LoRA model: the frozen base in `base/`, one PEFT adapter per directory in `adapters/`:", ""]
        lines += [f"- `adapters/{a}/`: agent(s) {', '.join(agents) or '-'}" for a, agents in r.adapters.items()]
        load = ["from peft import PeftModel", "from transformers import AutoModelForCausalLM", "",
                "base = AutoModelForCausalLM.from_pretrained('OUT/base')",
                f"model = PeftModel.from_pretrained(base, 'OUT/adapters/{first}')"]
        lines += ["", "```python", *load, "```", "",
                  "vLLM: serve `OUT/base` with `--enable-lora --lora-modules "
                  + " ".join(f"{a}=OUT/adapters/{a}" for a in r.adapters) + "`."]
    else:
        load = ["from transformers import AutoModelForCausalLM", "", "model = AutoModelForCausalLM.from_pretrained('OUT')"]
        lines += ["A full model:", "", "```python", *load, "```"]
    lines += ["", "## How the agents were prompted", "",
              "Each agent was trained on prompts built one way; it answers as trained only when prompted the same way.", ""]
    for a, c in agents.items():
        prompt = c.prompt.replace("`", "'")
        lines += [f"- `{a}`" + (f" (adapter `{c.adapter}`)" if c.adapter else "")
                  + (f": system prompt `{prompt}`" if prompt else ": no system prompt")]
    lines += [""]
    if r.tokenizer:
        system = example.prompt if example is not None else ""
        who = f"agent `{next(a for a, c in agents.items() if c is example)}`" if example is not None else "the model"
        messages = ([f"messages = [{{'role': 'system', 'content': {system!r}}},",
                     "            {'role': 'user', 'content': 'What is 13 - 7?'}]"] if system else
                    ["messages = [{'role': 'user', 'content': 'What is 13 - 7?'}]"])
        lines += [f"The tokenizer is saved beside the model (`{model_path}/`). A prompt is its chat template applied to a "
                  "system message holding the agent's system prompt (none when it is empty) and one user message "
                  "holding the workflow's text (the question, and for a later agent what the earlier ones answered), "
                  f"ending where the assistant's answer starts. {who.capitalize()}, answering greedily:", "",
                  "```python", *[x.replace("from transformers import AutoModelForCausalLM",
                                           "from transformers import AutoModelForCausalLM, AutoTokenizer") for x in load],
                  f"tok = AutoTokenizer.from_pretrained('{'OUT/base' if r.adapters else 'OUT'}')", "", *messages,
                  "inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, "
                  "return_tensors='pt')",
                  "out = model.generate(**inputs, max_new_tokens=32, do_sample=False)",
                  "print(tok.decode(out[0, inputs['input_ids'].shape[1]:], skip_special_tokens=True))", "```", "",
                  "A tokenizer without a chat template gets the system prompt, a blank line and the user text."]
    else:
        lines += ["No tokenizer files: this tiny model uses Chorus's byte tokenizer (shared/models/tokenizer.py), which is code,",
                  "not a Hugging Face tokenizer. Token ids 0-255 are the UTF-8 bytes of the text, 256 is PAD, 257 BOS",
                  "and 258 EOS: `[257, *text.encode()]` is a prompt; decode up to the first 258."]
    (r.out / "README.md").write_text("\n".join(lines) + "\n")
