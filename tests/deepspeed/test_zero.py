"""DeepSpeed ZeRO trainer groups against the torch learner: the same global batches, the same weights after them.

Marked deepspeed (`make test-deepspeed`); without the deepspeed extra they fail, not skip. Each group runs as rank
0 in its own interpreter (tests/deepspeed/cases.py: DeepSpeed keeps process-wide state) with one more rank beside
it; the torch learner runs here on the same batches.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.trainer.learner import Learner
from shared.kernel.config import load_config
from tests.deepspeed.cases import STEPS, case_config, train

pytestmark = pytest.mark.deepspeed
ROOT = Path(__file__).resolve().parents[2]
# DeepSpeed sums the ranks' gradients in another order than one process does: float32 rounding, nothing more
ATOL, RTOL = 1e-4, 1e-3


def run_group(config: Path, out: Path, mode: str = "train") -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.deepspeed.cases", str(config), str(out), mode], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    return torch.load(out)


def test_deepspeed_is_installed() -> None:
    import deepspeed

    assert deepspeed.__version__


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_two_rank_zero_group_trains_the_weights_the_torch_learner_trains(tmp_path, stage: int, lora: bool) -> None:
    config = case_config(tmp_path, stage=stage, lora=lora)  # with a KL term to the reference in the loss
    group = run_group(config, tmp_path / "group.pt")
    cfg = load_config(config)
    learner = Learner(cfg, "m")
    start = {k: t.clone() for k, t in learner.named_tensors().items()}
    losses = train(learner, cfg)
    assert group["version"] == STEPS
    assert group["losses"] == pytest.approx(losses, rel=1e-4, abs=1e-6)
    own = learner.named_tensors()
    assert group["tensors"].keys() == own.keys()
    moved = max(float((own[k] - start[k]).abs().max()) for k in own)
    assert moved > 1e-3  # the steps changed the weights: the comparison below is not of untouched tensors
    for name, t in own.items():
        torch.testing.assert_close(group["tensors"][name], t, atol=ATOL, rtol=RTOL, msg=name)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_group_restored_from_weights_alone_trains_from_them(tmp_path, stage: int) -> None:
    """A restore without a DeepSpeed checkpoint (another machine, a deleted directory) puts the committed weights into
    every rank's shards and the optimizer's own copy of them: the steps after it are the torch learner's from those
    weights with a fresh AdamW, not a continuation of the weights the group held before."""
    config = case_config(tmp_path, stage=stage, lora=False, kl=False)
    group = run_group(config, tmp_path / "group.pt", mode="restore")
    cfg = load_config(config)
    learner = Learner(cfg, "m")
    losses = train(learner, cfg)
    assert group["version"] == STEPS
    assert group["losses"] == pytest.approx(losses, rel=1e-4, abs=1e-6)
    for name, t in learner.named_tensors().items():
        torch.testing.assert_close(group["tensors"][name], t, atol=ATOL, rtol=RTOL, msg=name)


@pytest.mark.parametrize("variant", ["action", "token"])
@pytest.mark.parametrize("stage", [2, 3])
def test_marfts_step_on_a_two_rank_zero_group_is_the_torch_learners(tmp_path, stage: int, variant: str) -> None:
    """train.loss marft (MARFT-A, MARFT-T) on a DeepSpeed group, agent by agent over two LoRA adapters: the same
    losses and weights as the torch learner's on the same batches (each step trains one agent's adapter)."""
    config = case_config(tmp_path, stage=stage, lora=True, kl=False, marft=variant)
    group = run_group(config, tmp_path / "group.pt")
    cfg = load_config(config)
    learner = Learner(cfg, "m")
    start = {k: t.clone() for k, t in learner.named_tensors().items()}
    losses = train(learner, cfg)
    assert group["version"] == STEPS
    assert all(abs(x) > 1e-6 for x in losses)  # the advantages are not zero: the loss moves the weights
    assert group["losses"] == pytest.approx(losses, rel=1e-4, abs=1e-6)
    own = learner.named_tensors()
    moved = {k for k in own if float((own[k] - start[k]).abs().max()) > 1e-4}
    assert any(".sol." in k or "sol" in k for k in moved) and any("ver" in k for k in moved), sorted(moved)[:6]
    for name, t in own.items():
        torch.testing.assert_close(group["tensors"][name], t, atol=ATOL, rtol=RTOL, msg=name)
