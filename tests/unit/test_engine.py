"""The rollouter's torch engine and its dynamic batcher, without a broker."""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from services.rollouter.batcher import Batcher, RequestExpired
from services.rollouter.engine import SamplingParams, TorchEngine, behaviour_logprobs, left_pad
from shared.kernel.config import ChorusConfig
from shared.models.modeling import build_model
from shared.models.tokenizer import BOS_ID, EOS_ID, PAD_ID

PROMPTS = [[BOS_ID, 10, 11, 12, 13, 14, 15, 16], [BOS_ID, 40], [BOS_ID, 1, 2, 3]]


def make_cfg() -> ChorusConfig:
    return ChorusConfig(run={"id": "unit"}, models={"m": {}},
                        agents={"solver": {"model": "m"}, "verifier": {"model": "m"}})


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    torch.set_num_threads(1)
    return TorchEngine(build_model(make_cfg(), "m"), seed=1)


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)  # type: ignore[arg-type]


def test_left_pad_puts_padding_on_the_left_and_masks_it() -> None:
    ids, mask = left_pad([[1, 2, 3], [4]])
    assert ids.tolist() == [[1, 2, 3], [PAD_ID, PAD_ID, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_batched_greedy_equals_each_prompt_alone(engine: TorchEngine) -> None:
    batched = engine.generate(PROMPTS, [greedy(10)] * len(PROMPTS))
    for prompt, row in zip(PROMPTS, batched, strict=True):
        alone = engine.generate([prompt], [greedy(10)])[0]
        assert row.ids == alone.ids
        assert row.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_greedy_logprobs_equal_a_teacher_forced_forward_pass(engine: TorchEngine) -> None:
    rows = engine.generate(PROMPTS, [greedy(8)] * len(PROMPTS))
    for prompt, row in zip(PROMPTS, rows, strict=True):
        full = torch.tensor([prompt + row.ids])
        with torch.inference_mode():
            logits = engine.model(input_ids=full).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        expected = [float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(row.ids)]
        assert torch.allclose(torch.tensor(row.logprobs), torch.tensor(expected), atol=1e-5)
        assert all(tok == int(logits[len(prompt) - 1 + t].argmax()) for t, tok in enumerate(row.ids))


def test_sampled_logprobs_are_under_the_temperature_scaled_distribution(engine: TorchEngine) -> None:
    prompt = PROMPTS[0]
    row = engine.generate([prompt], [SamplingParams(max_new_tokens=6, temperature=0.7)])[0]
    full = torch.tensor([prompt + row.ids])
    with torch.inference_mode():
        logits = engine.model(input_ids=full).logits[0]
    logp = torch.log_softmax(logits / 0.7, dim=-1)
    expected = [float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(row.ids)]
    assert row.logprobs == pytest.approx(expected, abs=1e-4)


def test_eos_as_a_stop_id_stops_the_row_and_is_included(engine: TorchEngine) -> None:
    free = engine.generate([PROMPTS[1]], [greedy(6)])[0]
    stop_at = free.ids[2]
    row = engine.generate([PROMPTS[1]], [greedy(6, stop_ids=(stop_at,))])[0]
    assert row.finish == "stop"
    assert row.ids == free.ids[: free.ids.index(stop_at) + 1]


def test_eos_token_stops_a_row_while_others_continue(engine: TorchEngine) -> None:
    # A hook on the output layer makes EOS the argmax of row 0 only, from its second token on.
    calls = {"n": 0}

    def boost_eos(_module: torch.nn.Module, _inputs: object, out: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] >= 2:
            out = out.clone()
            out[0, -1, EOS_ID] += 100.0
        return out

    handle = engine.model.get_output_embeddings().register_forward_hook(boost_eos)
    try:
        rows = engine.generate(PROMPTS[:2], [greedy(6)] * 2)
    finally:
        handle.remove()
    assert rows[0].finish == "stop" and len(rows[0].ids) == 2 and rows[0].ids[-1] == EOS_ID
    assert rows[0].logprobs[-1] == pytest.approx(0.0, abs=1e-4)
    assert rows[1].finish == "length" and len(rows[1].ids) == 6 and EOS_ID not in rows[1].ids


def test_max_new_tokens_is_respected_per_row(engine: TorchEngine) -> None:
    rows = engine.generate(PROMPTS, [greedy(3), greedy(7), SamplingParams(max_new_tokens=1, temperature=1.0)])
    assert [len(r.ids) for r in rows] == [3, 7, 1]
    assert all(r.finish == "length" for r in rows)
    assert all(len(r.logprobs) == len(r.ids) for r in rows)


def test_top_p_renormalises_over_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    logp = behaviour_logprobs(logits, torch.tensor([1.0]), torch.tensor([0.7]))
    probs = logp.exp()[0]
    assert probs.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=1e-6)
    assert math.isinf(float(logp[0, 3]))


def test_more_rows_than_max_batch_are_chunked(engine: TorchEngine) -> None:
    small = TorchEngine(engine.model, max_batch=2)
    rows = small.generate(PROMPTS, [greedy(4)] * 3)
    assert [r.ids for r in rows] == [r.ids for r in engine.generate(PROMPTS, [greedy(4)] * 3)]


async def test_batcher_merges_concurrent_requests_into_one_batch(engine: TorchEngine) -> None:
    with ThreadPoolExecutor(1) as pool:
        b = Batcher(engine, pool, max_batch=16, window_s=0.05, request_timeout_s=10)
        runner = asyncio.create_task(b.run())
        try:
            futs = [b.submit([p], greedy(3)) for p in PROMPTS]
            results = await asyncio.wait_for(asyncio.gather(*futs), 10)
        finally:
            runner.cancel()
    assert b.stats.batches == 1 and b.stats.max_requests_per_batch == 3
    assert [len(rows) for _, rows in results] == [1, 1, 1]


async def test_paused_batcher_queues_requests_until_resume(engine: TorchEngine) -> None:
    with ThreadPoolExecutor(1) as pool:
        b = Batcher(engine, pool, max_batch=16, window_s=0.0, request_timeout_s=10)
        runner = asyncio.create_task(b.run())
        try:
            b.pause()
            assert await b.drain(1.0)
            fut = b.submit([PROMPTS[0]], greedy(2))
            await asyncio.sleep(0.1)
            assert not fut.done() and b.queued == 1
            engine_version = engine.version
            await b.exclusive(lambda: setattr(engine, "version", engine_version + 7))
            b.resume()
            version, rows = await asyncio.wait_for(fut, 10)
        finally:
            runner.cancel()
            engine.version = engine_version
    assert version == engine_version + 7 and len(rows[0].ids) == 2


async def test_requests_waiting_past_their_timeout_expire(engine: TorchEngine) -> None:
    with ThreadPoolExecutor(1) as pool:
        b = Batcher(engine, pool, max_batch=16, window_s=0.0, request_timeout_s=0.05)
        runner = asyncio.create_task(b.run())
        try:
            b.pause()
            fut = b.submit([PROMPTS[0]], greedy(2))
            await asyncio.sleep(0.1)
            b.resume()
            with pytest.raises(RequestExpired):
                await asyncio.wait_for(fut, 5)
        finally:
            runner.cancel()
    assert b.stats.expired == 1


def test_a_full_model_engine_ships_every_parameter(engine: TorchEngine) -> None:
    assert engine.named_tensors().keys() == dict(engine.model.named_parameters()).keys()
    assert not engine.lora and engine.adapters == () and engine.vocab_size == engine.tokenizer.vocab_size
