"""Model loading: seeded LoRA adapters on a tiny base, mixed-adapter batches, what a weight update ships."""

from __future__ import annotations

import pytest
import torch

from shared.kernel.config import ChorusConfig
from shared.models.loading import adapter_of_tensor, load_model, load_tokenizer, shipped_tensors


def two_agents(model: str, **agent: str) -> dict[str, dict[str, str]]:
    return {"solver": {"model": model, **agent}, "verifier": {"model": model, **agent}}


def lora_config() -> ChorusConfig:
    return ChorusConfig(
        models={"base": {"lora": {"r": 4}}},
        agents={"solver": {"model": "base", "adapter": "sol"}, "verifier": {"model": "base", "adapter": "ver"}},
    )


def perturbed(cfg: ChorusConfig) -> torch.nn.Module:
    """A LoRA model whose adapters differ from each other (fresh adapters are exact no-ops: B = 0)."""
    net = load_model(cfg, "base").eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in shipped_tensors(net, lora=True).values():
            t.add_(torch.randn(t.shape, generator=gen) * 0.1)
    return net


def test_every_process_builds_the_same_version_zero_adapters():
    a, b = load_model(lora_config(), "base"), load_model(lora_config(), "base")
    ta, tb = shipped_tensors(a, lora=True), shipped_tensors(b, lora=True)
    assert ta.keys() == tb.keys() and len(ta) > 0
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert {adapter_of_tensor(k, ["sol", "ver"]) for k in ta} == {"sol", "ver"}


def test_only_adapter_tensors_are_trainable_and_shipped():
    net = load_model(lora_config(), "base")
    trainable = {k for k, p in net.named_parameters() if p.requires_grad}
    assert trainable == set(shipped_tensors(net, lora=True))
    assert all("lora_" in k for k in trainable)
    assert len(shipped_tensors(net, lora=False)) > len(trainable)


def test_a_mixed_adapter_batch_gives_the_logits_of_single_adapter_passes():
    net = perturbed(lora_config())
    ids = torch.randint(0, 256, (6, 9), generator=torch.Generator().manual_seed(2))
    rows = ["sol", "ver", "ver", "sol", "sol", "ver"]
    with torch.no_grad():
        mixed = net(input_ids=ids, adapter_names=rows).logits
        single = {}
        for a in ("sol", "ver"):
            net.set_adapter(a)
            single[a] = net(input_ids=ids).logits
    for i, a in enumerate(rows):
        assert torch.allclose(mixed[i], single[a][i], atol=1e-5)
    other = {"sol": "ver", "ver": "sol"}
    assert not torch.allclose(mixed[0], single[other[rows[0]]][0], atol=1e-3)  # the adapters really differ


def test_one_backward_pass_over_a_mixed_batch_trains_both_adapters():
    net = perturbed(lora_config())
    ids = torch.randint(0, 256, (4, 5), generator=torch.Generator().manual_seed(3))
    net(input_ids=ids, adapter_names=["sol", "ver", "sol", "ver"]).logits.square().mean().backward()
    grads = {adapter_of_tensor(k, ["sol", "ver"]): float(p.grad.abs().sum())
             for k, p in net.named_parameters() if p.requires_grad and p.grad is not None}
    assert grads.keys() == {"sol", "ver"} and all(g > 0 for g in grads.values())


def test_adapter_names_that_peft_would_confuse_are_rejected():
    with pytest.raises(ValueError, match="must not contain 'lora'"):
        ChorusConfig(models={"m": {"lora": {}}}, agents=two_agents("m", adapter="lora1"))


def test_an_adapter_needs_a_lora_section_and_a_lora_section_needs_an_adapter():
    with pytest.raises(ValueError, match="has no `lora` section"):
        ChorusConfig(models={"m": {}}, agents=two_agents("m", adapter="x"))
    with pytest.raises(ValueError, match="no agent names an adapter"):
        ChorusConfig(models={"m": {"lora": {}}}, agents=two_agents("m"))


def test_a_hf_model_needs_a_directory_with_a_config(tmp_path):
    with pytest.raises(ValueError, match="needs the path"):
        ChorusConfig(models={"m": {"source": "hf"}}, agents=two_agents("m"))
    cfg = ChorusConfig(models={"m": {"source": "hf", "path": str(tmp_path)}}, agents=two_agents("m"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_tokenizer(cfg, "m")
