"""models.<m>.device and .dtype: resolving the device, bfloat16 training, weights and checkpoints across devices.

The tests marked ``cuda`` need a GPU; `make test` deselects them, `make test-cuda` runs them (and fails, not
skips, where torch sees no CUDA device).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.trainer.learner import Learner, collate
from shared.kernel.config import ChorusConfig, ConfigError
from shared.kernel.schemas import Array, Sample
from shared.models.loading import load_model, resolve_device, shipped_tensors
from shared.models.tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE
from shared.models.weights import flatten, load_into, pack, unpack

NO_CUDA = "models.m.device is cuda but torch.cuda.is_available() is False (no CUDA device or a CPU-only torch); " \
          "set device: cpu or auto"


def cfg_for(*, device: str = "cpu", dtype: str = "float32", lora: bool = False, lr: float = 0.01) -> ChorusConfig:
    def agent(adapter: str) -> dict[str, str]:
        return {"model": "m", **({"adapter": adapter} if lora else {})}

    return ChorusConfig(
        run={"id": "device"},
        models={"m": {"device": device, "dtype": dtype, "optim": {"lr": lr},
                      "arch": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64,
                               "max_position": 64},
                      **({"lora": {"r": 4}} if lora else {})}},
        agents={"solver": agent("sol"), "verifier": agent("ver")},
        workflow={"group_size": 2},
        train={"global_batch": 4, "micro_batch": 4},
    )


def samples(n: int = 4, lora: bool = False) -> list[Sample]:
    out = []
    for i in range(n):
        rng = np.random.default_rng(i)
        resp = [*rng.integers(32, 127, 2 + i).tolist(), EOS_ID]
        lp = [-math.log(VOCAB_SIZE)] * len(resp)
        out.append(Sample(run="r", episode=f"e{i}", sample_id=f"s{i}", env_idx=i, rollout_idx=0, agent="solver",
                          model="m", adapter=("sol" if i % 2 else "ver") if lora else None, turn=0,
                          prompt_ids=Array.of([BOS_ID, *rng.integers(32, 127, 4).tolist()], "int32"),
                          response_ids=Array.of(resp, "int32"), behavior_logprobs=Array.of(lp, "float32"),
                          reward=0.0, group_key=f"g{i}", group_size=2, version=0))
    return out


ADV = [1.0, -1.0, 0.5, -0.5]


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine as CI sees it, whatever torch build runs the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_device_cuda_without_cuda_is_a_config_error_naming_the_key(no_cuda):
    cfg = cfg_for(device="cuda")
    with pytest.raises(ConfigError) as err:
        resolve_device(cfg, "m")
    assert str(err.value) == NO_CUDA
    with pytest.raises(ConfigError, match="models.m.device is cuda"):
        Learner(cfg, "m")
    with pytest.raises(ConfigError, match="set device: cpu or auto"):
        load_model(cfg, "m")


def test_device_auto_is_cpu_without_cuda_and_cuda_with_it(no_cuda, monkeypatch):
    assert resolve_device(cfg_for(device="auto"), "m") == torch.device("cpu")
    assert resolve_device(cfg_for(device="cpu"), "m") == torch.device("cpu")
    assert Learner(cfg_for(device="auto"), "m").device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(cfg_for(device="auto"), "m") == torch.device("cuda")
    assert resolve_device(cfg_for(device="cpu"), "m") == torch.device("cpu")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_bfloat16_model_trains_a_step_and_its_weights_ship_and_load(lora):
    cfg = cfg_for(dtype="bfloat16", lora=lora)
    learner = Learner(cfg, "m")
    base = [p for n, p in learner.net.named_parameters() if "lora_" not in n]
    assert base and all(p.dtype == torch.bfloat16 for p in base)
    assert all(t.dtype == (torch.float32 if lora else torch.bfloat16) for t in learner.named_tensors().values())
    before = {k: v.clone() for k, v in learner.named_tensors().items()}
    batch = samples(lora=lora)
    with torch.no_grad():
        logp = learner.token_logprobs(collate(batch, learner.pad_id))
    assert logp.dtype == torch.float32  # the loss math is float32 on a bfloat16 network
    loss = learner.accumulate(batch, ADV)
    result = learner.step()
    assert result is not None and not result.skipped and result.version == 1
    assert math.isfinite(loss) and math.isfinite(result.loss) and math.isfinite(result.grad_norm)
    sent = learner.named_tensors()
    assert any(not torch.equal(t, before[k]) for k, t in sent.items())
    header, buf = flatten("m", 1, sent, bucket_bytes=1024)
    if not lora:
        assert {s.dtype for s in header.slots} == {"bfloat16"}
    got, body = unpack(pack(header, buf))
    receiver = load_model(cfg, "m")
    named = shipped_tensors(receiver, lora)
    assert load_into(named, got, body) == header.checksum
    for k, t in sent.items():
        assert named[k].dtype == t.dtype and torch.equal(named[k], t), k


def test_checkpoints_hold_cpu_tensors(tmp_path):
    learner = Learner(cfg_for(dtype="bfloat16"), "m")
    learner.accumulate(samples(), ADV)
    learner.step()
    state = learner.state_dict()
    tensors = [*state["model"].values(), *(t for s in state["optimizer"]["state"].values() for t in s.values())]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    learner.save_checkpoint(tmp_path)
    back = Learner(cfg_for(dtype="bfloat16"), "m")
    assert back.restore_latest(tmp_path) is not None and back.version == 1
    for k, t in learner.named_tensors().items():
        assert torch.equal(back.named_tensors()[k], t), k


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "lora"), [("float32", False), ("bfloat16", False), ("bfloat16", True)])
def test_on_cuda_the_learner_trains_ships_weights_both_ways_and_checkpoints(tmp_path, dtype, lora):
    assert torch.cuda.is_available(), "a test marked cuda ran where torch.cuda.is_available() is False"
    gpu = Learner(cfg_for(device="cuda", dtype=dtype, lora=lora), "m")
    cpu = Learner(cfg_for(device="cpu", dtype=dtype, lora=lora), "m")
    assert gpu.device.type == "cuda" and all(p.device.type == "cuda" for p in gpu.net.parameters())
    batch = samples(lora=lora)
    with torch.no_grad():
        a = gpu.token_logprobs(collate(batch, gpu.pad_id).to(gpu.device)).cpu()
        b = cpu.token_logprobs(collate(batch, cpu.pad_id))
    tol = 1e-3 if dtype == "float32" else 5e-2
    assert torch.allclose(a, b, atol=tol, rtol=tol)
    for learner in (gpu, cpu):
        learner.accumulate(batch, ADV)
        result = learner.step()
        assert result is not None and not result.skipped and math.isfinite(result.loss)
    # Trainer (cuda) -> CPU buffer -> a receiver on cuda and one on the CPU.
    sent = gpu.named_tensors()
    header, buf = flatten("m", 1, sent, bucket_bytes=4096)
    for device in ("cuda", "cpu"):
        receiver = shipped_tensors(load_model(cfg_for(device=device, dtype=dtype, lora=lora), "m"), lora)
        load_into(receiver, header, buf)
        for k, t in sent.items():
            assert receiver[k].device.type == device and torch.equal(receiver[k].cpu(), t.cpu()), k
    # A CPU-side sender into cuda tensors: what a trainer's commit does when it restores.
    header, buf = flatten("m", 1, cpu.named_tensors())
    own = {k: t.clone() for k, t in gpu.named_tensors().items()}
    load_into(own, header, buf)
    assert all(own[k].device.type == "cuda" and torch.equal(own[k].cpu(), t) for k, t in cpu.named_tensors().items())
    # Checkpoints: CPU tensors on disk, back onto the device.
    path = gpu.save_checkpoint(tmp_path)
    saved = torch.load(path, weights_only=True)
    assert all(t.device.type == "cpu" for t in saved["model"].values())
    back = Learner(cfg_for(device="cuda", dtype=dtype, lora=lora), "m")
    back.restore_latest(tmp_path)
    assert all(t.device.type == "cuda" for t in back.named_tensors().values())
    assert all(torch.equal(back.named_tensors()[k], t) for k, t in gpu.named_tensors().items())
    moments = [t for s in back.optimizer.state.values() for k, t in s.items() if k != "step"]
    assert moments and all(t.device.type == "cuda" for t in moments)
    assert all(s["step"].device.type == "cpu" for s in back.optimizer.state.values())  # AdamW keeps it there
