"""The DeepSpeed learner's comparison cases: configs, the global batches of a few steps, and a run of a trainer group
as rank 0 in its own process (``python -m tests.deepspeed.cases <config> <out>``: DeepSpeed keeps global state, so
each group runs in a fresh interpreter).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from shared.kernel.config import ChorusConfig, load_config
from shared.kernel.schemas import Array, Sample
from shared.models.tokenizer import BOS_ID, EOS_ID

STEPS = 3
MICRO = 4  # samples per micro-batch
GLOBAL = 8


def case_config(tmp: Path, *, stage: int, lora: bool, kl: bool = True, extra_train: str = "",
                ranks: int = 2, marft: str | None = None) -> Path:
    """A tiny model's config with ``trainer.backend: deepspeed`` at ZeRO ``stage`` (the torch learner ignores it);
    ``marft``: train.loss marft in that variant (action or token), agent by agent, in sync mode."""
    model = ("{arch: {hidden_size: 64, num_layers: 2, num_heads: 2, intermediate_size: 128, max_position: 64}, "
             "optim: {lr: 0.01, grad_clip: 1.0, weight_decay: 0.01}, "
             f"trainer: {{backend: deepspeed, deepspeed: {{ranks: {ranks}, zero_stage: {stage}}}}}")
    agents = "{solver: {model: m}, verifier: {model: m}}"
    if lora:
        model += ", lora: {r: 4, target_modules: [q_proj, v_proj, o_proj, gate_proj]}"
        agents = "{solver: {model: m, adapter: sol}, verifier: {model: m, adapter: ver}}"
    kl_keys = ", kl_coef: 0.1, kl_in: loss" if kl else ""
    if marft:
        extra_train += ", loss: marft, mode: sync, max_staleness: 0"
    path = tmp / f"zero{stage}{'-lora' if lora else ''}{f'-marft-{marft}' if marft else ''}.yaml"
    path.write_text(
        f"run: {{id: zero, dir: {tmp / 'runs'}}}\n"
        f"models: {{m: {model}}}}}\n"
        f"agents: {agents}\n"
        "workflow: {group_size: 2, temperature: 1.0}\n"
        f"train: {{global_batch: {GLOBAL}, micro_batch: {MICRO}{kl_keys}{extra_train}}}\n"
        + (f"marft: {{variant: {marft}, agent_interval: 1, kl_target: 1000.0}}\n" if marft else ""))
    return path


def sample(i: int, step: int, adapter: str | None, marft: bool = False) -> Sample:
    """One sample of the case's batches; ``marft``: with the coordinator's normalised advantages (one per sample
    and one per response token) of an on-policy batch of GLOBAL samples."""
    rng = np.random.default_rng(1000 * step + i)
    prompt = [BOS_ID, *rng.integers(32, 127, int(rng.integers(2, 9))).tolist()]
    resp_len = int(rng.integers(2, 12))
    resp = rng.integers(32, 127, resp_len).tolist()
    resp[-1] = EOS_ID
    lp = (-rng.random(resp_len) * 2 - 3).tolist()
    agent = "solver" if i % 2 == 0 else "verifier"
    return Sample(run="r", episode=f"e{step}-{i // 2}", sample_id=f"s{step}-{i}", env_idx=i // 2, rollout_idx=i % 2,
                  agent=agent, model="m", turn=0, prompt_ids=Array.of(prompt, "int32"),
                  response_ids=Array.of(resp, "int32"), behavior_logprobs=Array.of(lp, "float32"),
                  reward=float(rng.integers(0, 3)), group_key=f"g{step}-{i // 2}", group_size=2, version=step,
                  adapter=adapter, **(dict(advantage=float(rng.normal()), batch_samples=GLOBAL,
                                           token_advantages=Array.of(rng.normal(size=resp_len), "float32"))
                                      if marft else {}))


def micro_batches(cfg: ChorusConfig, step: int) -> list[list[Sample]]:
    """The global batch of ``step``: GLOBAL samples in micro-batches of MICRO; a LoRA model's alternate adapters."""
    adapters = cfg.adapters_of("m") if cfg.models["m"].lora is not None else None
    marft = cfg.train.loss == "marft"
    rows = [sample(i, step, adapters[i % len(adapters)] if adapters else None, marft) for i in range(GLOBAL)]
    return [rows[k : k + MICRO] for k in range(0, GLOBAL, MICRO)]


def train(learner, cfg: ChorusConfig, steps: int = STEPS) -> list[float]:  # type: ignore[no-untyped-def]
    """``steps`` steps of ``learner`` (a torch Learner or a TrainerGroup) on the case's batches; the losses."""
    losses = []
    for step in range(steps):
        for mb in micro_batches(cfg, step):
            learner.micro_batch(mb, list(range(len(mb))), cfg.train.advantage)
        result = learner.step()
        assert result is not None and not result.skipped, result
        losses.append(result.loss)
    return losses


def main(config: str, out: str, mode: str = "train") -> int:
    """``train``: STEPS steps (``stream``: the same, the weights written part by part). ``restore``: one step, then the group restored to its starting weights at version 0
    from the weights alone (no DeepSpeed checkpoint: AdamW afresh), then STEPS steps."""
    from services.trainer.zero import TrainerGroup

    cfg = load_config(config)
    group = TrainerGroup(cfg, "m")
    try:
        if mode == "restore":
            start = {k: t.clone() for k, t in group.named_tensors().items()}
            train(group, cfg, steps=1)
            group.load_state_dict({"version": 0, "model": start, "optimizer": None})
        losses = train(group, cfg)
        if mode == "stream":  # the weights part by part to <out>.parts/ (rank 0 never holds them all at once)
            parts = group.save_weights(Path(f"{out}.parts"))
            torch.save({"losses": losses, "parts": [str(p) for p in parts], "version": group.version}, out)
        else:
            torch.save({"losses": losses, "tensors": {k: t.clone() for k, t in group.named_tensors().items()},
                        "version": group.version}, out)
    finally:
        group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
