"""The parts of the GPU check (loadtests/gpu_check.py runs each as ``python loadtests/gpu_parts.py PART ...`` in a
process of its own, with its own time limit): each prints what it does and writes its figures as JSON.

- ``model``: the model every other part uses, a Hugging Face directory: SmolLM2-135M-Instruct's config and
  tokenizer (carried in deploy/gpu-check/carry/smollm2/ by `make gpu-wheels`) with random weights (seed 0): the
  real weights are a 98 MB GGUF, more than what travels. ``--tiny`` (the dry run): the same architecture cut to
  2 layers of 64 with a byte-level tokenizer.
- ``rollout``: Chorus's static and continuous engines and transformers' ``generate`` (the arms of
  loadtests/bench_rollout.py) on the device, float32 and bfloat16: new tokens per second of wall time.
- ``zero``: a DeepSpeed ZeRO-2 group (NCCL on CUDA, gloo on CPU) trains the model for a few steps beside the torch
  learner on the same batches (tests/deepspeed/cases.py): the same losses and weights (allclose).
- ``swap``: the training pool's swap of a learner's state (services/trainer/swap.py) device -> host -> a fresh
  learner on the device, bit for bit, and the raw device <-> host copies of loadtests/bench_swap_device.py.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

CARRIED = ROOT / "deploy" / "gpu-check" / "carry" / "smollm2"
TOKENIZER_FILES = ("tokenizer.json.gz", "tokenizer_config.json", "chat_template.jinja")  # as make gpu-wheels packs them
# SmolLM2-135M-Instruct's config.json (as its GGUF gives it), for when the carried copy is missing
SMOLLM2_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "initializer_range": 0.02,
}
TINY_CHANGES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512}
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def figure(x: float, digits: int = 3) -> float:
    """A measured figure kept to its significant digits (a slow CPU's 0.004 GB/s is not 0.0)."""
    return float(f"{x:.{digits}g}")


def sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# --- model ---------------------------------------------------------------------------------------------------
def byte_tokenizer(directory: Path, size: int) -> None:
    """A byte-level tokenizer with ChatML's special tokens, its vocabulary padded to ``size`` ids."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(ByteLevel.alphabet()))}
    vocab.update({f"<|unused{i}|>": i for i in range(len(vocab), size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(directory)


def part_model(a: argparse.Namespace) -> dict[str, Any]:
    """Write the model directory ``a.model``: config, tokenizer, random float32 weights (seed 0)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(a.model)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    carried = (CARRIED / "config.json").is_file()
    config = json.loads((CARRIED / "config.json").read_text()) if carried else dict(SMOLLM2_CONFIG)
    for key in ("_model_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        config.pop(key, None)
    if a.tiny:
        config.update(TINY_CHANGES, vocab_size=320)
    if not a.tiny and all((CARRIED / f).is_file() for f in TOKENIZER_FILES):
        for f in TOKENIZER_FILES[1:]:
            shutil.copy(CARRIED / f, out / f)
        (out / "tokenizer.json").write_bytes(gzip.decompress((CARRIED / TOKENIZER_FILES[0]).read_bytes()))
        tokenizer = "SmolLM2-135M-Instruct's (carried)"
    else:
        byte_tokenizer(out, config["vocab_size"])
        tokenizer = "byte-level" + ("" if a.tiny else " (SmolLM2's tokenizer was not carried: make gpu-wheels)")
    (out / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}, indent=1))
    t0 = time.perf_counter()
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.float32)
    net.save_pretrained(out)
    params = sum(p.numel() for p in net.parameters())
    print(f"{out}: {params:,} parameters, random init, tokenizer {tokenizer}, config "
          f"{'carried' if carried else 'built in'}", flush=True)
    return {"model": "tiny SmolLM2-like" if a.tiny else "SmolLM2-135M-Instruct config, random weights",
            "parameters": params, "tokenizer": tokenizer, "config": "carried" if carried else "built in",
            "seconds": round(time.perf_counter() - t0, 2)}


# --- rollout -------------------------------------------------------------------------------------------------
def part_rollout(a: argparse.Namespace) -> dict[str, Any]:
    """tokens per second of each arm, per dtype and cell (batch, shape), medians over repeats."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from loadtests import bench_rollout as br
    from shared.models.loading import HFTokenizer

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tok = HFTokenizer(AutoTokenizer.from_pretrained(a.model))
    cfg = br.demo_config()
    arms = {"static": br.ChorusStatic, "continuous": br.ChorusContinuous, "hf_generate": br.HFGenerate}
    batches = [int(b) for b in a.batches.split(",")]
    cells = []
    for b in batches:
        prompts = br.prompts_for(cfg, tok, a.depth * max(b, 2), seed=b)
        for shape in a.shapes.split(","):
            long = min(a.long, max(16, br.TAIL_PER_ROW * b))
            q = prompts if shape == "longtail" else prompts[: 2 * max(b, 2)]
            cells.append((b, shape, q, br.lengths_for(b, shape, len(q), a.equal, long, a.short_max, seed=0)))
    out: dict[str, Any] = {"device": a.device, "cells": {}, "ratios": {}, "repeats": {}, "errors": []}
    dtypes = a.dtypes.split(",")
    start = time.monotonic()
    for i, dtype in enumerate(dtypes):
        deadline = start + a.budget * (i + 1) / len(dtypes)  # each dtype its share: both always measured
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, dtype)).to(a.device).eval()
        live = {}
        for name, cls in arms.items():
            try:
                arm = cls(model, tok)
                # first-call costs (allocator, kernels, lazy imports) outside the clock
                arm.run(arm.prepare(2, cells[0][2][:2], [4, 2]), 2, cells[0][2][:2], [4, 2])
                live[name] = arm
            except Exception as exc:  # noqa: BLE001 - an arm that cannot start is reported; the others run
                out["errors"].append(f"{dtype} {name}: {type(exc).__name__}: {exc}")
        last = 0.0
        for rep in range(a.repeats):
            if rep and time.monotonic() + last > deadline:
                print(f"{dtype}: stopped after {rep} repeats (another would pass its share of the part's time)",
                      flush=True)
                break
            began = time.monotonic()
            out["repeats"][dtype] = rep + 1
            for b, shape, prompts, lengths in cells:
                for name, arm in live.items():
                    ps, ls = br.workload(name, b, prompts, lengths)
                    try:
                        state = arm.prepare(b, ps, ls)
                        sync(a.device)
                        t0 = time.perf_counter()
                        rows = arm.run(state, b, ps, ls)
                        sync(a.device)
                        wall = time.perf_counter() - t0
                        arm.finish(state)
                    except Exception as exc:  # noqa: BLE001 - recorded per cell; the other cells and arms run
                        out["errors"].append(f"{dtype} B={b} {shape} {name}: {type(exc).__name__}: {exc}")
                        continue
                    cell = out["cells"].setdefault(f"{dtype} B={b} {shape}", {}).setdefault(name, {"runs": []})
                    cell["tokens"] = sum(ls)
                    cell["short_rows"] = sum(len(r) < n for r, n in zip(rows, ls, strict=True))
                    cell["runs"].append(round(sum(ls) / wall, 1))
                    cell["heads"] = [r[: br.HEADS] for r in rows]
            Path(a.result).write_text(json.dumps(rollout_figures(out)))  # what was measured, if time runs out
            last = time.monotonic() - began
        del live, model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    figures = rollout_figures(out)
    for key, cell in figures["cells"].items():
        print(f"{key}: " + ", ".join(f"{n} {v['tok_s']:.0f} tok/s" for n, v in cell.items()), flush=True)
    return figures


def rollout_figures(raw: dict[str, Any]) -> dict[str, Any]:
    """Medians, greedy agreement with the static arm, and the ratios to ``generate``, from the runs so far."""
    out = {**raw, "cells": {}, "ratios": {}}
    for key, cell in raw["cells"].items():
        static_heads = cell.get("static", {}).get("heads", [])
        out["cells"][key] = {}
        for name, arm in cell.items():
            heads = arm["heads"]
            same = sum(x == y for x, y in zip(heads, static_heads, strict=False))
            out["cells"][key][name] = {"tokens": arm["tokens"], "short_rows": arm["short_rows"], "runs": arm["runs"],
                                       "tok_s": statistics.median(arm["runs"]),
                                       "same_start_as_static": f"{same}/{min(len(heads), len(static_heads))}"}
        for name in ("continuous", "static"):
            if name in cell and "hf_generate" in cell:
                out["ratios"][f"{key} {name}/hf_generate"] = round(
                    statistics.median(cell[name]["runs"]) / statistics.median(cell["hf_generate"]["runs"]), 2)
    return out


# --- ZeRO-2 against the torch learner -------------------------------------------------------------------------
def write_config(a: argparse.Namespace, backend: str) -> Path:
    """A config of one full model from ``a.model`` on ``a.device``; ``backend`` deepspeed: a ZeRO-2 group."""
    import torch

    # NCCL refuses two ranks on one GPU: a machine of one GPU runs a group of one rank (ZeRO-2's code all the same)
    ranks = a.ranks or (min(2, torch.cuda.device_count()) if a.device == "cuda" else 2)
    trainer = f"trainer: {{backend: deepspeed, deepspeed: {{ranks: {ranks}, zero_stage: 2}}}}, " \
        if backend == "deepspeed" else ""
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{backend}.yaml"
    path.write_text(
        f"run: {{id: gpucheck, dir: {work / 'runs'}}}\n"
        f"models: {{m: {{source: hf, path: {Path(a.model).resolve()}, device: {a.device}, dtype: float32, "
        f"{trainer}optim: {{lr: 0.01, grad_clip: 1.0, weight_decay: 0.01}}}}}}\n"
        "agents: {solver: {model: m}, verifier: {model: m}}\n"
        "workflow: {group_size: 2, temperature: 1.0}\n"
        "train: {global_batch: 8, micro_batch: 4, kl_coef: 0.1, kl_in: loss}\n")
    return path


def part_zero(a: argparse.Namespace) -> dict[str, Any]:
    """A ZeRO-2 group's losses and weights after STEPS steps against the torch learner's on the same batches."""
    import importlib.util

    import torch

    from services.trainer.learner import Learner
    from shared.kernel.config import load_config
    from tests.deepspeed.cases import STEPS, train

    if importlib.util.find_spec("deepspeed") is None:
        return {"skipped": f"deepspeed is not installed in {sys.executable} (make venv-deepspeed; on the GPU "
                           "machine its wheel is carried: make gpu-wheels)"}
    config = write_config(a, "deepspeed")
    cfg = load_config(config)
    ranks = cfg.models["m"].trainer.deepspeed.ranks
    out = Path(a.work) / "group.pt"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tests.deepspeed.cases", str(config), str(out)], cwd=ROOT,
                          timeout=max(30.0, a.budget - 30))
    if proc.returncode != 0:
        raise RuntimeError(f"the ZeRO-2 group exited {proc.returncode} (its output is above)")
    group_s = time.perf_counter() - t0
    group = torch.load(out, map_location="cpu")
    t0 = time.perf_counter()
    learner = Learner(cfg, "m")
    start = {k: t.detach().cpu().clone() for k, t in learner.named_tensors().items()}
    losses = train(learner, cfg)
    sync(a.device)
    torch_s = time.perf_counter() - t0
    own = {k: t.detach().cpu() for k, t in learner.named_tensors().items()}
    if group["tensors"].keys() != own.keys():
        odd = sorted(group["tensors"].keys() ^ own.keys())[:4]
        raise RuntimeError(f"the group's tensors are not the learner's: {odd}")
    diff = max(float((group["tensors"][k].float() - t.float()).abs().max()) for k, t in own.items())
    moved = max(float((t - start[k]).abs().max()) for k, t in own.items())
    # the update's relative error, ||w_zero - w_torch|| / ||w_torch - w_0|| over every weight: what allclose's
    # per-element view misses or exaggerates (AdamW turns a gradient of rounding noise into a full-size step)
    err = sum(float((group["tensors"][k].float() - t.float()).pow(2).sum()) for k, t in own.items()) ** 0.5
    step = sum(float((t - start[k]).pow(2).sum()) for k, t in own.items()) ** 0.5
    # Every element close, but for at most 1 in 10,000 of a tensor within AdamW's own bound (2 lr a step): Adam's
    # update is about lr * sign(g) for any |g| well above eps, and an element whose clipped gradient is within float
    # rounding of eps moves by another fraction of lr when the ranks sum in another order (as in
    # tests/deepspeed/test_memory_cap.py).
    bound = 2 * cfg.models["m"].optim.lr * STEPS
    off = {k: int((~torch.isclose(group["tensors"][k], t, atol=a.atol, rtol=a.rtol)).sum()) for k, t in own.items()}
    close = all(n <= max(1, own[k].numel() // 10_000) for k, n in off.items()) and diff <= bound
    loss_diff = max(abs(x - y) for x, y in zip(group["losses"], losses, strict=True))
    ok = close and group["version"] == STEPS and loss_diff <= 1e-4 * max(1.0, max(abs(x) for x in losses))
    errors = [] if ok else [f"the ZeRO-2 group differs from the torch learner: max |dw| {diff:.3e} (close {close}: "
                            f"{sum(off.values())} elements off, AdamW's bound {bound:.1e}), max |dloss| "
                            f"{loss_diff:.3e}, version {group['version']} of {STEPS}"]
    print(f"ZeRO-2 on {ranks} rank(s) ({'nccl' if a.device == 'cuda' else 'gloo'}) against the torch learner, "
          f"{STEPS} steps: losses {group['losses']} vs {losses}; max |dw| {diff:.2e} (weights moved up to "
          f"{moved:.2e}); {sum(off.values())} of {sum(t.numel() for t in own.values())} elements outside "
          f"allclose(atol={a.atol}, rtol={a.rtol}), within AdamW's bound {bound:.1e}: {close}", flush=True)
    return {"ranks": ranks, "backend": "nccl" if a.device == "cuda" else "gloo", "steps": STEPS,
            "parameters": sum(t.numel() for t in own.values()), "group_losses": group["losses"],
            "torch_losses": losses, "max_abs_loss_diff": loss_diff, "max_abs_weight_diff": diff,
            "max_weight_moved": moved, "update_relative_error": err / step if step else None, "close": close,
            "elements_off": sum(off.values()), "adamw_bound": bound,
            "atol": a.atol, "rtol": a.rtol,
            "group_s_with_start": round(group_s, 1), "torch_learner_s": round(torch_s, 1), "errors": errors}


# --- the pool's swap --------------------------------------------------------------------------------------------
def part_swap(a: argparse.Namespace) -> dict[str, Any]:
    """A learner's state out to host memory and into a fresh learner (timed, bit for bit); raw copies beside it."""
    import torch

    from loadtests import bench_swap_device as bsd
    from services.trainer.learner import Learner
    from services.trainer.swap import export_state, import_state, state_tensors
    from shared.kernel.config import load_config
    from tests.deepspeed.cases import micro_batches, train

    # The same step twice must give the same bits: deterministic kernels (cuBLAS's needs its workspace set first)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = load_config(write_config(a, "torch"))
    first = Learner(cfg, "m")
    train(first, cfg, steps=1)  # AdamW's moments exist
    pending = micro_batches(cfg, 1)
    first.micro_batch(pending[0], list(range(len(pending[0]))), cfg.train.advantage)  # and gradients
    sync(a.device)
    t0 = time.perf_counter()
    header, buf, meta = export_state(first)
    sync(a.device)
    export_s = time.perf_counter() - t0
    second = Learner(cfg, "m")
    sync(a.device)
    t0 = time.perf_counter()
    import_state(second, header, buf, meta)
    sync(a.device)
    import_s = time.perf_counter() - t0
    mine, theirs = state_tensors(first), state_tensors(second)
    same_state = mine.keys() == theirs.keys() and all(torch.equal(mine[k].cpu(), theirs[k].cpu()) for k in mine)
    for learner in (first, second):  # the step both finish: the same weights, bit for bit
        learner.micro_batch(pending[1], list(range(len(pending[1]))), cfg.train.advantage)
        learner.step()
    step_diff = max(float((t.cpu() - second.named_tensors()[k].cpu()).abs().max())
                    for k, t in first.named_tensors().items())
    same_step = step_diff == 0.0
    gb = header.nbytes / 1e9
    out: dict[str, Any] = {
        "state_gb": figure(gb), "export_s": figure(export_s), "export_gb_s": figure(gb / export_s),
        "import_s": figure(import_s), "import_gb_s": figure(gb / import_s),
        "state_identical": same_state, "next_step_identical": same_step, "next_step_max_abs_diff": step_diff,
        "errors": [] if same_state and same_step else [
            f"the swapped learner is not the original (deterministic kernels on): state identical {same_state}, "
            f"the next step's weights differ by up to {step_diff:.3e}"]}
    print(f"pool swap of a {gb:.2f} GB learner state: export {export_s:.3f} s ({gb / export_s:.1f} GB/s), "
          f"import {import_s:.3f} s ({gb / import_s:.1f} GB/s); state identical {same_state}, next step "
          f"identical {same_step}", flush=True)
    Path(a.result).write_text(json.dumps(out))  # kept if the raw copies below fail or run out of time
    del first, second, buf
    device = torch.device(a.device)
    tensors = bsd.state_tensors(a.swap_b, device)
    raw_gb = sum(t.numel() * t.element_size() for t in tensors) / 1e9
    out["raw"] = {"params_b": a.swap_b, "state_gb": figure(raw_gb)}
    for pinned in (True, False) if device.type == "cuda" else (False,):
        host = "pinned" if pinned else "pageable"
        try:
            measured = bsd.measure(tensors, pinned, a.repeats, device)
        except Exception as exc:  # noqa: BLE001 - e.g. no pinned memory to be had: the pageable copies still run
            out["errors"].append(f"raw copies into {host} memory: {type(exc).__name__}: {exc}")
            continue
        for layout, (off, on) in measured.items():
            out["raw"][f"{host} {layout}"] = {"offload_s": figure(off), "offload_gb_s": figure(raw_gb / off),
                                              "onload_s": figure(on), "onload_gb_s": figure(raw_gb / on)}
            print(f"raw {raw_gb:.2f} GB {host} {layout}: offload {off:.3f} s ({raw_gb / off:.1f} GB/s), onload "
                  f"{on:.3f} s ({raw_gb / on:.1f} GB/s)", flush=True)
    return out


PARTS = {"model": part_model, "rollout": part_rollout, "zero": part_zero, "swap": part_swap}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", required=True, help="the model directory (written by the model part)")
    p.add_argument("--work", required=True, help="a scratch directory")
    p.add_argument("--result", required=True, help="where the part's figures go (JSON)")
    p.add_argument("--budget", type=float, default=120.0, help="seconds this part may take")
    p.add_argument("--tiny", action="store_true", help="model: the tiny architecture and a byte-level tokenizer")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--shapes", default="equal,longtail")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--equal", type=int, default=12)
    p.add_argument("--long", type=int, default=256)
    p.add_argument("--short-max", type=int, default=40)
    p.add_argument("--atol", type=float, default=1e-4)
    p.add_argument("--rtol", type=float, default=1e-3)
    p.add_argument("--swap-b", type=float, default=0.5, help="swap: billions of parameters of the raw copies")
    p.add_argument("--ranks", type=int, default=0, help="zero: the group's ranks (0: 2 on CPU, min(2, GPUs) on CUDA)")
    a = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    figures = PARTS[a.part](a)
    Path(a.result).write_text(json.dumps(figures, indent=1))
    for error in figures.get("errors", []):
        print(f"error: {error}", file=sys.stderr)
    return 1 if figures.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
