"""The engine on a LoRA model and with model tokenizers: mixed-adapter batches, stop strings, in-place loads."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from services.rollouter.batcher import Batcher
from services.rollouter.engine import SamplingParams, TorchEngine, UnknownAdapter, tail_has_stop
from services.rollouter.service import load_weights
from shared.kernel.config import ChorusConfig
from shared.models.loading import load_model, shipped_tensors
from shared.models.modeling import build_model
from shared.models.tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from shared.models.weights import flatten

PROMPTS = [[BOS_ID, 10, 11, 12, 13], [BOS_ID, 40], [BOS_ID, 1, 2, 3, 4, 5, 6], [BOS_ID, 99, 98]]


def lora_config() -> ChorusConfig:
    return ChorusConfig(models={"m": {"lora": {"r": 4}}},
                        agents={"solver": {"model": "m", "adapter": "sol"}, "verifier": {"model": "m", "adapter": "ver"}})


def perturb(net: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Make the adapters differ from each other and from the base (fresh adapters are no-ops: B = 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in shipped_tensors(net, lora=True).values():
            t.add_(torch.randn(t.shape, generator=gen) * 0.3)
    return net


@pytest.fixture(scope="module")
def lora_engine() -> TorchEngine:
    torch.set_num_threads(1)
    return TorchEngine(perturb(load_model(lora_config(), "m"), seed=1), seed=3)


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)  # type: ignore[arg-type]


def test_a_mixed_adapter_batch_equals_each_adapter_generated_alone(lora_engine: TorchEngine) -> None:
    adapters: list[str | None] = ["sol", "ver", "ver", "sol", None, "sol", "ver", None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(adapters))]
    mixed = lora_engine.generate(prompts, [greedy(8)] * len(prompts), adapters)
    for name in ("sol", "ver", None):
        rows = [i for i, a in enumerate(adapters) if a == name]
        alone = lora_engine.generate([prompts[i] for i in rows], [greedy(8)] * len(rows), [name] * len(rows))
        for i, row in zip(rows, alone, strict=True):
            assert mixed[i].ids == row.ids
            assert torch.allclose(torch.tensor(mixed[i].logprobs), torch.tensor(row.logprobs), atol=1e-5)
    # the same prompt under each adapter gives different distributions: the rows really were routed
    by_adapter = {a: lora_engine.generate([PROMPTS[0]], [greedy(6)], [a])[0] for a in ("sol", "ver", None)}
    assert not torch.allclose(torch.tensor(by_adapter["sol"].logprobs), torch.tensor(by_adapter["ver"].logprobs),
                              atol=1e-3)


def test_lora_logprobs_equal_a_teacher_forced_pass_through_the_rows_adapter(lora_engine: TorchEngine) -> None:
    adapters: list[str | None] = ["ver", "sol", None]
    rows = lora_engine.generate(PROMPTS[:3], [greedy(6)] * 3, adapters)
    net = lora_engine.model
    for prompt, row, a in zip(PROMPTS, rows, adapters, strict=False):
        full = torch.tensor([prompt + row.ids])
        with torch.inference_mode():
            if a is None:
                with net.disable_adapter():  # type: ignore[operator]
                    logits = net(input_ids=full).logits[0]
            else:
                logits = net(input_ids=full, adapter_names=[a]).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        expected = [float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(row.ids)]
        assert torch.allclose(torch.tensor(row.logprobs), torch.tensor(expected), atol=1e-5)


def test_unknown_adapters_are_refused_before_any_compute(lora_engine: TorchEngine) -> None:
    with pytest.raises(UnknownAdapter, match="not one of this model's adapters"):
        lora_engine.generate([PROMPTS[0]], [greedy(2)], ["nope"])
    plain = TorchEngine(build_model(lora_config(), "m"))
    with pytest.raises(UnknownAdapter, match="no LoRA adapters"):
        plain.generate([PROMPTS[0]], [greedy(2)], ["sol"])
    assert plain.adapters == () and lora_engine.adapters == ("sol", "ver")


def test_a_lora_engine_ships_and_loads_only_adapter_tensors(lora_engine: TorchEngine) -> None:
    net = lora_engine.model
    assert lora_engine.named_tensors().keys() == shipped_tensors(net, lora=True).keys()
    assert all("lora_" in k for k in lora_engine.named_tensors())
    trained = perturb(load_model(lora_config(), "m"), seed=7)
    header, buf = flatten("m", 5, shipped_tensors(trained, lora=True))
    before = {k: v.clone() for k, v in lora_engine.named_tensors().items()}
    version = lora_engine.version
    try:
        # an update lacking one adapter tensor is refused and changes nothing
        partial = dict(shipped_tensors(trained, lora=True))
        partial.pop(next(iter(partial)))
        p_header, p_buf = flatten("m", 5, partial)
        with pytest.raises(ValueError, match="lack 1 of"):
            load_weights(lora_engine, "m", p_header, memoryview(p_buf), version=5, checksum=None)
        assert all(torch.equal(before[k], v) for k, v in lora_engine.named_tensors().items())
        digest = load_weights(lora_engine, "m", header, memoryview(buf), version=5, checksum=header.checksum)
        assert digest == header.checksum and lora_engine.version == 5
        want = shipped_tensors(trained, lora=True)
        assert all(torch.equal(want[k], v) for k, v in lora_engine.named_tensors().items())
    finally:
        with torch.no_grad():
            for k, v in lora_engine.named_tensors().items():
                v.copy_(before[k])
        lora_engine.version = version


# --- tokenizers and stop strings ---------------------------------------------------------------------


class CharTokenizer(ByteTokenizer):
    """Byte ids, but EOS and PAD are ordinary byte ids: the engine must take them from the tokenizer."""

    def __init__(self, eos_id: int, pad_id: int) -> None:
        self.eos_id = eos_id
        self.pad_id = pad_id

    def decode(self, ids: object) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("latin-1")  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def byte_net() -> torch.nn.Module:
    torch.set_num_threads(1)
    return build_model(lora_config(), "m")


def test_eos_and_pad_come_from_the_tokenizer(byte_net: torch.nn.Module) -> None:
    free = TorchEngine(byte_net).generate([PROMPTS[1]], [greedy(6)])[0]
    assert EOS_ID not in free.ids
    eos = free.ids[2]
    engine = TorchEngine(byte_net, CharTokenizer(eos_id=eos, pad_id=0))
    rows = engine.generate(PROMPTS[:2], [greedy(6)] * 2)
    assert rows[1].finish == "stop" and rows[1].ids == free.ids[: free.ids.index(eos) + 1]
    # the other row pads with the tokenizer's PAD while row 1 is done, and is unchanged by it
    assert rows[0].ids == TorchEngine(byte_net).generate([PROMPTS[0]], [greedy(6)])[0].ids[: len(rows[0].ids)]


def test_a_stop_string_ends_the_row_keeping_the_token_that_completed_it(byte_net: torch.nn.Module) -> None:
    tok = CharTokenizer(eos_id=EOS_ID, pad_id=256)
    engine = TorchEngine(byte_net, tok)
    free = engine.generate(PROMPTS, [greedy(12)] * len(PROMPTS))
    target = tok.decode(free[0].ids[3:5])
    first = next(n for n in range(1, 13) if target in tok.decode(free[0].ids[:n]))
    rows = engine.generate(PROMPTS, [greedy(12, stop=("\x00never", target))] + [greedy(12)] * (len(PROMPTS) - 1))
    assert rows[0].finish == "stop" and rows[0].ids == free[0].ids[:first]
    assert len(rows[0].logprobs) == first
    assert [r.ids for r in rows[1:]] == [r.ids for r in free[1:]]


def test_the_tail_check_agrees_with_decoding_everything() -> None:
    """Tokens of many characters and of none: the tail window grows until it covers the longest stop string."""

    class Words:
        eos_id, pad_id, vocab_size = 0, 0, 6
        words = ["", "a", "bb", "ccc", " ", "dddd"]

        def decode(self, ids: object) -> str:
            return "".join(self.words[int(i)] for i in ids)  # type: ignore[attr-defined]

    tok = Words()
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice([0, 0, 0, 1, 2, 3, 4, 5]) for _ in range(rng.randrange(1, 40))]  # 0 decodes to ""
        stops = tuple(rng.choice(["ab", "c c", "bbcc", "a dddd", "ccca", "bb bb", "x"]) for _ in range(2))
        first_full = next((n for n in range(1, len(ids) + 1) if any(s in tok.decode(ids[:n]) for s in stops)), None)
        first_tail = next((n for n in range(1, len(ids) + 1) if tail_has_stop(tok, ids[:n], stops)), None)  # type: ignore[arg-type]
        assert first_tail == first_full


# --- dynamic batching ---------------------------------------------------------------------------------


async def test_requests_with_different_adapters_and_settings_share_one_batch(lora_engine: TorchEngine) -> None:
    jobs: list[tuple[list[list[int]], SamplingParams, str | None]] = [
        ([PROMPTS[0], PROMPTS[1]], greedy(5), "sol"),
        ([PROMPTS[2]], greedy(3), "ver"),
        ([PROMPTS[3]], greedy(7), None),
        ([PROMPTS[1]], SamplingParams(max_new_tokens=4, temperature=0.9, top_p=0.8), "ver"),
    ]
    with ThreadPoolExecutor(1) as pool:
        b = Batcher(lora_engine, pool, max_batch=16, window_s=0.1, request_timeout_s=10)
        runner = asyncio.create_task(b.run())
        try:
            with pytest.raises(UnknownAdapter):
                b.submit([PROMPTS[0]], greedy(2), "nope")
            futs = [b.submit(p, s, a) for p, s, a in jobs]
            results = await asyncio.wait_for(asyncio.gather(*futs), 20)
        finally:
            runner.cancel()
    assert b.stats.batches == 1 and b.stats.max_requests_per_batch == 4 and b.stats.max_adapters_per_batch == 3
    for (prompts, params, adapter), (version, rows) in zip(jobs, results, strict=True):
        assert version == lora_engine.version and len(rows) == len(prompts)
        if params.temperature == 0:
            alone = lora_engine.generate(prompts, [params] * len(prompts), [adapter] * len(prompts))
            assert [r.ids for r in rows] == [r.ids for r in alone]
        else:
            assert 1 <= len(rows[0].ids) <= params.max_new_tokens and all(lp <= 0 for lp in rows[0].logprobs)
