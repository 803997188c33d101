"""vLLM behind Chorus's step protocol, against Chorus's own engine and a teacher-forced forward of the same weights.

Marked vllm: `make test-vllm` runs them in the venv with the vllm extra; without vllm they fail (no skip).
"""

from __future__ import annotations

import random

import pytest
import torch

from services.rollouter.continuous import ContinuousEngine
from services.rollouter.engine import SamplingParams, behaviour_logprobs
from services.rollouter.vllm_engine import VllmEngine
from shared.kernel.config import ChorusConfig, VllmSection
from shared.models.loading import load_model, shipped_tensors
from shared.models.tokenizer import BOS_ID, ByteTokenizer

pytestmark = pytest.mark.vllm
TOK = ByteTokenizer()
# Where vLLM's greedy token differs from Chorus's, the reference's top two logits must be this close: float
# sums in other orders (vLLM's CPU attention and fused QKV against SDPA) only flip near-ties.
NEAR_TIE = 1e-3
# vLLM keeps its parallel groups in globals, and a garbage-collected engine tears them down under the others:
# every engine of this process stays referenced until the process ends (a rollouter holds exactly one).
ENGINES: list[VllmEngine] = []


def make_engine(net: torch.nn.Module, max_batch: int = 16) -> VllmEngine:
    engine = VllmEngine(net, TOK, settings=VllmSection(kv_cache_gib=0.25), max_batch=max_batch)
    ENGINES.append(engine)
    return engine


def config(lora: bool) -> ChorusConfig:
    agents = ({"solver": {"model": "m", "adapter": "x"}, "verifier": {"model": "m", "adapter": "y"}} if lora
              else {"solver": {"model": "m"}, "verifier": {"model": "m"}})
    # head_dim 32: vLLM's CPU attention has kernels for 32 and up, not the 16 of the default tiny arch
    model: dict = {"arch": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128,
                            "max_position": 256}}
    if lora:
        model["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj"]}
    return ChorusConfig(run={"id": "t"}, models={"m": model}, agents=agents)


def randomise_adapters(net: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    with torch.no_grad():  # adapters that really change the output
        gen = torch.Generator().manual_seed(seed)
        for name, p in net.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[BOS_ID] + [rng.randrange(3, 250) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


def reference_logits(net: torch.nn.Module, prompt: list[int], ids: list[int], adapter: str | None) -> torch.Tensor:
    """Teacher-forced logits of the positions that sampled ``ids`` after ``prompt`` (one HF forward)."""
    seq = torch.tensor([prompt + ids])
    kw = {"adapter_names": [adapter or "__base__"]} if hasattr(net, "peft_config") else {}
    with torch.inference_mode():
        return net(input_ids=seq, **kw).logits[0, len(prompt) - 1 : -1].float()


def assert_greedy_agrees(net: torch.nn.Module, prompt: list[int], mine: list[int], theirs: list[int],
                         adapter: str | None) -> None:
    """Equal ids, or a first difference where the reference's top two logits are within NEAR_TIE."""
    if mine == theirs:
        return
    i = next((k for k, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), min(len(mine), len(theirs)))
    logits = reference_logits(net, prompt, mine[: i + 1], adapter)[i]
    top = torch.topk(logits, 2).values
    gap = float(top[0] - top[1])
    assert gap <= NEAR_TIE, f"token {i} differs ({mine[i]} vs {theirs[i]}) but the top-two gap is {gap:.2e}"


@pytest.fixture(scope="module")
def base() -> tuple[torch.nn.Module, VllmEngine]:
    net = load_model(config(False), "m")
    return net, make_engine(net)


@pytest.fixture(scope="module")
def lora() -> tuple[torch.nn.Module, VllmEngine]:
    net = load_model(config(True), "m")
    randomise_adapters(net, 1)
    return net, make_engine(net)


GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def test_greedy_ids_equal_chorus_engine_on_the_base(base: tuple[torch.nn.Module, VllmEngine]) -> None:
    net, engine = base
    ps = prompts(10)
    ref = ContinuousEngine(net, TOK, max_batch=16).generate(ps, [GREEDY] * len(ps))
    out = engine.generate(ps, [GREEDY] * len(ps))
    for p, a, b in zip(ps, ref, out, strict=True):
        assert len(b.ids) == 12 and b.finish == "length"
        assert_greedy_agrees(net, p, a.ids, b.ids, None)
    assert sum(a.ids == b.ids for a, b in zip(ref, out, strict=True)) >= 8


def test_greedy_ids_equal_chorus_engine_on_mixed_adapter_batches(lora: tuple[torch.nn.Module, VllmEngine]) -> None:
    net, engine = lora
    ps = prompts(12, seed=3)
    adapters = [("x", "y", None)[i % 3] for i in range(len(ps))]
    ref = ContinuousEngine(net, TOK, max_batch=16).generate(ps, [GREEDY] * len(ps), adapters)
    out = engine.generate(ps, [GREEDY] * len(ps), adapters)
    for p, a, b, ad in zip(ps, ref, out, adapters, strict=True):
        assert_greedy_agrees(net, p, a.ids, b.ids, ad)
    assert sum(a.ids == b.ids for a, b in zip(ref, out, strict=True)) >= 10
    # the adapters matter: the same prompt under x, y and the base gives different continuations
    same = engine.generate([ps[0]] * 3, [GREEDY] * 3, ["x", "y", None])
    assert len({tuple(r.ids) for r in same}) == 3


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.7, 0.9)])
def test_behaviour_logprobs_match_a_teacher_forced_forward(lora: tuple[torch.nn.Module, VllmEngine],
                                                            temperature: float, top_p: float) -> None:
    net, engine = lora
    params = SamplingParams(max_new_tokens=10, temperature=temperature, top_p=top_p, ignore_eos=True)
    ps = prompts(6, seed=5)
    adapters = ["x", None, "y", "x", None, "y"]
    out = engine.generate(ps, [params] * len(ps), adapters)
    for p, r, a in zip(ps, out, adapters, strict=True):
        logits = reference_logits(net, p, r.ids, a)
        n = logits.shape[0]
        logp = behaviour_logprobs(logits, torch.full((n,), temperature), torch.full((n,), top_p))
        ref = logp.gather(-1, torch.tensor(r.ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=2e-4, rtol=1e-4)


def full_update(net: torch.nn.Module, engine: VllmEngine, version: int, seed: int) -> None:
    """What a weight transport does: write new tensors into the engine's staging copy, then ``loaded``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in engine.named_tensors().values():
            t.add_(torch.randn(t.shape, generator=gen) * 0.05)
    engine.loaded(version)


def test_after_a_full_model_update_outputs_are_those_of_the_new_weights() -> None:
    net = load_model(config(False), "m")
    engine = make_engine(net, 8)
    ps = prompts(4, seed=7)
    before = engine.generate(ps, [GREEDY] * 4)
    full_update(net, engine, 1, seed=11)  # net is the staging copy: it now holds v1
    after = engine.generate(ps, [GREEDY] * 4)
    ref = ContinuousEngine(net, TOK, max_batch=8).generate(ps, [GREEDY] * 4)
    assert [r.ids for r in before] != [r.ids for r in after]
    for p, a, b in zip(ps, ref, after, strict=True):
        assert_greedy_agrees(net, p, a.ids, b.ids, None)
        assert b.versions == [1] * len(b.ids)


def test_after_a_lora_update_outputs_are_those_of_the_new_adapters(lora: tuple[torch.nn.Module, VllmEngine]) -> None:
    net, engine = lora
    ps = prompts(4, seed=9)
    adapters = ["x", "y", "x", "y"]
    before = engine.generate(ps, [GREEDY] * 4, adapters)
    assert set(engine.named_tensors()) == set(shipped_tensors(net, lora=True))
    randomise_adapters(net, 2)
    engine.loaded(engine.version + 1)
    after = engine.generate(ps, [GREEDY] * 4, adapters)
    ref = ContinuousEngine(net, TOK, max_batch=8).generate(ps, [GREEDY] * 4, adapters)
    assert [r.ids for r in before] != [r.ids for r in after]
    for p, a, b, ad in zip(ps, ref, after, adapters, strict=True):
        assert_greedy_agrees(net, p, a.ids, b.ids, ad)
    assert len(engine.llm.list_loras()) == 3  # x, y and the base rows' zeros: the old version's ids retired


def test_an_interrupted_row_continues_under_the_new_weights_with_per_token_versions() -> None:
    net = load_model(config(False), "m")
    engine = make_engine(net, 8)
    p = prompts(1, seed=13)[0]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    row = engine.row(p, params)
    finished = engine.step([row])
    while len(row.ids) < 4:
        finished += engine.step()
    assert not finished
    k = len(row.ids)
    full_update(net, engine, 1, seed=17)
    while engine.busy:
        finished += engine.step()
    assert finished == [row] and len(row.ids) == 10
    assert row.versions == [0] * k + [1] * (10 - k)
    assert engine.stats["reprefills"] == 1
    # the tokens after the load are the new weights' greedy continuation of the prompt and the first k tokens
    ref = ContinuousEngine(net, TOK, max_batch=8).generate([p + row.ids[:k]], [SamplingParams(
        max_new_tokens=10 - k, temperature=0.0, ignore_eos=True)])[0]
    assert_greedy_agrees(net, p + row.ids[:k], ref.ids, row.ids[k:], None)
    logits = reference_logits(net, p + row.ids[:k], row.ids[k:], None)
    ref_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(row.ids[k:])[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(row.logprobs[k:]), ref_lp, atol=2e-4, rtol=1e-4)


def test_stop_ids_stop_strings_max_tokens_and_the_context(base: tuple[torch.nn.Module, VllmEngine]) -> None:
    net, engine = base
    p = prompts(1, seed=21)[0]
    free = engine.generate([p], [GREEDY])[0]
    stop_id = free.ids[3]
    first = free.ids.index(stop_id)
    r = engine.generate([p], [SamplingParams(max_new_tokens=12, temperature=0.0, stop_ids=(stop_id,), ignore_eos=True)])[0]
    assert r.ids == free.ids[: first + 1] and r.finish == "stop"
    text = TOK.decode(free.ids[:6])
    stop = text[-2:]
    r = engine.generate([p], [SamplingParams(max_new_tokens=12, temperature=0.0, stop=(stop,), ignore_eos=True)])[0]
    assert r.finish == "stop" and stop in TOK.decode(r.ids) and len(r.ids) <= 6
    r = engine.generate([p], [SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)])[0]
    assert len(r.ids) == 3 and r.finish == "length"
    with pytest.raises(ValueError, match="context"):
        engine.row([BOS_ID] * engine.context, GREEDY)
    # a row that reaches the context ends there, by length
    r = engine.generate([[BOS_ID] * (engine.context - 3)], [SamplingParams(max_new_tokens=50, ignore_eos=True)])[0]
    assert len(r.ids) == 3 and r.finish == "length"
