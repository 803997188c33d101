"""The continuous-batching engine against generating each request alone (the static engine, batch of one)."""

from __future__ import annotations

import random

import pytest
import torch

from services.rollouter.continuous import ContinuousEngine, support_problem
from services.rollouter.engine import SamplingParams, TorchEngine, behaviour_logprobs
from services.rollouter.speculate import OFF, Speculation
from shared.kernel.config import ChorusConfig
from shared.models.loading import load_model
from shared.models.tokenizer import BOS_ID, ByteTokenizer

TOK = ByteTokenizer()


def config(lora: bool) -> ChorusConfig:
    agents = ({"solver": {"model": "m", "adapter": "x"}, "verifier": {"model": "m", "adapter": "y"}} if lora
              else {"solver": {"model": "m"}, "verifier": {"model": "m"}})
    model: dict = {"arch": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128,
                            "max_position": 256}}
    if lora:
        model["lora"] = {"r": 4}
    return ChorusConfig(run={"id": "t"}, models={"m": model}, agents=agents)


@pytest.fixture(scope="module")
def lora_net() -> torch.nn.Module:
    net = load_model(config(True), "m")
    with torch.no_grad():  # adapters that really change the output
        gen = torch.Generator().manual_seed(1)
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return net


@pytest.fixture(scope="module")
def net() -> torch.nn.Module:
    return load_model(config(False), "m")


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[BOS_ID] + [rng.randrange(3, 250) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


def reference_logprobs(net: torch.nn.Module, prompt: list[int], ids: list[int], params: SamplingParams,
                       adapter: str | None) -> torch.Tensor:
    """Teacher-forced behaviour log-probs of ``ids`` after ``prompt``: one full forward of the HF model."""
    seq = torch.tensor([prompt + ids])
    kw = {"adapter_names": [adapter or "__base__"]} if adapter is not None or hasattr(net, "peft_config") else {}
    with torch.inference_mode():
        logits = net(input_ids=seq, **kw).logits[0, len(prompt) - 1 : -1].float()
    n = logits.shape[0]
    logp = behaviour_logprobs(logits, torch.full((n,), params.temperature), torch.full((n,), params.top_p))
    return logp.gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)


def test_the_tiny_llama_and_its_lora_are_supported(net: torch.nn.Module, lora_net: torch.nn.Module) -> None:
    assert support_problem(net) is None and support_problem(lora_net) is None


def test_requests_joining_mid_flight_give_what_each_gives_alone(lora_net: torch.nn.Module) -> None:
    """Different lengths, adapters and sampling settings, more rows than fit: rows join as others finish."""
    ps = prompts(14)
    ps[5] = list(ps[4])  # one prompt twice (shared prefill)
    adapters = [None, "x", "y", "x", "y", None, "x", "y", None, "x", "y", "y", None, "x"]
    settings = [SamplingParams(max_new_tokens=random.Random(i).randrange(1, 40), temperature=0.0,
                               ignore_eos=True) for i in range(14)]
    sampled = {3, 8, 11}  # rows sampled at a temperature, with a nucleus: their log-probs are checked
    for i in sampled:
        settings[i] = SamplingParams(max_new_tokens=25, temperature=0.8, top_p=0.9, ignore_eos=True)
    engine = ContinuousEngine(lora_net, TOK, max_batch=4)
    got = engine.generate(ps, settings, adapters)
    alone = TorchEngine(lora_net, TOK, max_batch=1)
    joined_late = 0
    for i, (p, s, a, g) in enumerate(zip(ps, settings, adapters, got, strict=True)):
        assert len(g.ids) == s.max_new_tokens and g.versions == [0] * len(g.ids) and g.finish == "length"
        if i in sampled:
            ref = reference_logprobs(lora_net, p, g.ids, s, a)
            assert torch.allclose(torch.tensor(g.logprobs), ref, atol=1e-4), i
            continue
        want = alone.generate([p], [s], [a])[0]
        assert g.ids == want.ids, f"row {i} (adapter {a}) differs from generating it alone"
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(want.logprobs), atol=1e-4)
        joined_late += i >= 4
    assert joined_late > 0
    # the 14 rows ran 4 at a time, rows joining as others left: far fewer steps than one request at a time
    assert engine.stats["steps"] < sum(s.max_new_tokens for s in settings)
    assert engine.stats["shared_prefills"] + engine.stats["prefix_hits"] >= 1
    assert engine.stats["merged_prefill_tokens"] > 0  # short prompts started inside the step's one forward
    assert not engine.busy and engine.reserved == 0


def test_grouped_query_attention_rows_give_the_model_s_log_probs() -> None:
    """Fewer key/value heads than query heads (SmolLM2: 9 and 3): the queries sharing a key/value head attend as
    one group of rows; decoding rows and rows started mid-step (a cached prefix, the rest merged into the
    step's forward) give the teacher-forced log-probs of the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.models.tokenizer import VOCAB_SIZE

    torch.manual_seed(0)
    net = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=256)).eval()
    rng = random.Random(7)
    shared = [BOS_ID] + [rng.randrange(3, 250) for _ in range(24)]
    ps = [shared + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 9))] for _ in range(9)]
    settings = [SamplingParams(max_new_tokens=rng.randrange(4, 20), temperature=t, top_p=0.9 if t else 1.0,
                               ignore_eos=True) for t in (0.0, 0.8, 0.0, 1.0, 0.0, 0.7, 0.0, 0.0, 1.0)]
    engine = ContinuousEngine(net, TOK, max_batch=3)
    got = engine.generate(ps, settings)
    assert engine.stats["merged_prefill_tokens"] > 0 and engine.stats["prefix_hits"] > 0
    for i, (p, s, g) in enumerate(zip(ps, settings, got, strict=True)):
        assert len(g.ids) == s.max_new_tokens
        ref = reference_logprobs(net, p, g.ids, s, None)
        assert torch.allclose(torch.tensor(g.logprobs), ref, atol=1e-4), i


def test_few_row_products_and_padded_rows_compute_what_the_model_computes(lora_net: torch.nn.Module) -> None:
    """On CPU a product of a few token rows follows the kernel plan measured at start (F.linear or W @ X^T, on
    rows padded with zeros or not): the hidden states and logits of 1 to 9 tokens (each adapter, and mixed)
    match the HF model's forward of the same tokens."""
    engine = ContinuousEngine(lora_net, TOK, max_batch=4)
    assert engine.kernels.plans  # the CPU path, with a measured plan, is the one under test
    gen = torch.Generator().manual_seed(3)
    for t in range(1, 10):
        for groups in ([(None, 0, t)], [("x", 0, t)], [("x", 0, t // 2), ("y", t // 2, t)]):
            ids = torch.randint(3, 250, (t,), generator=gen)
            positions = torch.arange(t)

            def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
                    enable_gqa=engine.n_kv != engine.n_heads)[0].transpose(0, 1)

            with torch.inference_mode():
                hidden = engine._run(ids, positions, groups, attend)
                got = engine._logits(hidden)
                assert hidden.shape[0] == t and got.shape[0] == t
                for adapter, s, e in groups:
                    if s == e:
                        continue
                    names = [adapter or "__base__"]
                    ref = lora_net(input_ids=ids[None, :e], adapter_names=names).logits[0, s:e].float()
                    # rows s..e of a mixed call see the other adapter's rows before them: compare only where a
                    # row's whole past shares its adapter (the first group), else the row alone
                    if s == 0:
                        torch.testing.assert_close(got[s:e], ref, atol=1e-4, rtol=1e-4)
            assert torch.isfinite(got).all()


def test_stop_ids_and_stop_strings_are_per_row(net: torch.nn.Module) -> None:
    p = prompts(1, seed=3)[0]
    free = ContinuousEngine(net, TOK, max_batch=4).generate([p], [SamplingParams(30, 0.0, ignore_eos=True)])[0]
    stop_id = free.ids[6]
    text = TOK.decode(free.ids)
    settings = [SamplingParams(30, 0.0, ignore_eos=True),
                SamplingParams(30, 0.0, stop_ids=(stop_id,), ignore_eos=True),
                SamplingParams(30, 0.0, stop=(text[8:10],), ignore_eos=True)]
    got = ContinuousEngine(net, TOK, max_batch=4).generate([p, p, p], settings)
    assert got[0].ids == free.ids and got[0].finish == "length"
    assert got[1].ids == free.ids[: free.ids.index(stop_id) + 1] and got[1].finish == "stop"
    assert got[2].finish == "stop" and text[8:10] in TOK.decode(got[2].ids) and len(got[2].ids) < 30


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts whose tokens repeat, so prompt lookup finds drafts from the first step."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, 250) for _ in range(rng.randrange(2, 6))]
        out.append([BOS_ID] + motif * rng.randrange(2, 5) + [rng.randrange(3, 250) for _ in range(rng.randrange(0, 4))])
    return out


def test_speculative_decoding_changes_no_greedy_id_and_no_log_prob(lora_net: torch.nn.Module) -> None:
    """Few rows in flight: prompt-lookup drafts verified in the step's forward pass. Greedy ids and log-probs are
    those of decoding one token at a time (speculation off), on base and adapter rows mixed in one batch, with
    drafts both kept and rejected, in fewer steps."""
    ps = repetitive_prompts(6, seed=1) + prompts(4, seed=2)
    adapters = [None, "x", "y", "x", None, "y", "x", None, "y", "x"]
    settings = [SamplingParams(max_new_tokens=random.Random(i).randrange(10, 40), temperature=0.0, ignore_eos=True)
                for i in range(len(ps))]
    plain = ContinuousEngine(lora_net, TOK, max_batch=3, speculate=OFF)
    want = plain.generate(ps, settings, adapters)
    spec = ContinuousEngine(lora_net, TOK, max_batch=3, speculate=Speculation(draft_tokens=6, max_rows=3))
    got = spec.generate(ps, settings, adapters)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.ids == w.ids, f"row {i} (adapter {adapters[i]}) differs with speculation"
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4), i
        assert g.finish == "length" and g.versions == [0] * len(g.ids)
    st = spec.stats
    assert plain.stats["draft_tokens"] == 0
    assert 0 < st["accepted_tokens"] < st["draft_tokens"]  # drafts kept and drafts rejected
    assert st["steps"] < plain.stats["steps"]
    assert not spec.busy and spec.reserved == 0


def test_a_speculating_row_ends_where_one_token_at_a_time_would(net: torch.nn.Module) -> None:
    """A stop id, a stop string or max_new_tokens inside an accepted draft ends the row at that token."""
    p = repetitive_prompts(1, seed=5)[0]
    free = ContinuousEngine(net, TOK, max_batch=1, speculate=OFF).generate(
        [p], [SamplingParams(48, 0.0, ignore_eos=True)])[0]
    engine = ContinuousEngine(net, TOK, max_batch=1)
    again = engine.generate([p], [SamplingParams(48, 0.0, ignore_eos=True)])[0]
    assert again.ids == free.ids and engine.stats["accepted_tokens"] > 0
    for n in (1, 2, 5, 13, 29):
        got = ContinuousEngine(net, TOK, max_batch=1).generate([p], [SamplingParams(n, 0.0, ignore_eos=True)])[0]
        assert got.ids == free.ids[:n] and got.finish == "length" and len(got.logprobs) == n
    for at in (3, 17, 30):
        stop_id = free.ids[at]
        got = ContinuousEngine(net, TOK, max_batch=1).generate(
            [p], [SamplingParams(48, 0.0, stop_ids=(stop_id,), ignore_eos=True)])[0]
        assert got.ids == free.ids[: free.ids.index(stop_id) + 1] and got.finish == "stop"
    text = TOK.decode(free.ids)
    stop = text[20:22]
    got = ContinuousEngine(net, TOK, max_batch=1).generate([p], [SamplingParams(48, 0.0, stop=(stop,),
                                                                                ignore_eos=True)])[0]
    assert got.finish == "stop" and stop in TOK.decode(got.ids) and stop not in TOK.decode(got.ids[:-1])
    assert got.ids == free.ids[: len(got.ids)]


def test_the_number_of_draft_positions_follows_the_price_of_a_position(net: torch.nn.Module) -> None:
    """Drafts are bought where a position costs little: none when every extra position doubles a step's cost,
    some when positions are nearly free; the ids are the same either way."""
    p = repetitive_prompts(1, seed=5)[0]
    out = {}
    for name, curve in (("steep", [0.0] + [2.0 ** t for t in range(16)]), ("flat", [0.0] + [1.0] * 16)):
        engine = ContinuousEngine(net, TOK, max_batch=1)
        assert engine._step_cost is not None  # the CPU path prices positions from its kernel plan
        engine._step_cost, engine._gap = curve, 0.0
        got = engine.generate([p], [SamplingParams(40, 0.0, ignore_eos=True)])[0]
        out[name] = (got.ids, engine.stats["draft_tokens"])
    assert out["steep"][1] == 0 and out["flat"][1] > 0
    assert out["steep"][0] == out["flat"][0]


def test_sampled_rows_keep_drafts_and_report_the_model_s_log_probs(net: torch.nn.Module) -> None:
    """A peaked model (its head scaled up) sampled at a temperature with a nucleus: drafts are kept, and every
    token's log-prob is the teacher-forced one of the distribution sampled from."""
    import copy

    sharp = copy.deepcopy(net)
    with torch.no_grad():
        sharp.lm_head.weight.mul_(40.0)
    ps = repetitive_prompts(3, seed=8)
    settings = [SamplingParams(30, 1.0, ignore_eos=True), SamplingParams(30, 0.7, top_p=0.9, ignore_eos=True),
                SamplingParams(25, 1.0, top_p=0.8, ignore_eos=True)]  # every row sampled
    engine = ContinuousEngine(sharp, TOK, max_batch=4, seed=3)
    got = engine.generate(ps, settings)
    assert 0 < engine.stats["accepted_tokens"] < engine.stats["draft_tokens"]
    for p, s, g in zip(ps, settings, got, strict=True):
        assert len(g.ids) == s.max_new_tokens
        ref = reference_logprobs(sharp, p, g.ids, s, None)
        assert torch.allclose(torch.tensor(g.logprobs), ref, atol=1e-4)


def test_a_group_shares_one_prefill_and_a_common_prefix_is_prefilled_once(net: torch.nn.Module) -> None:
    system = prompts(1, seed=4)[0] + [33] * 20
    questions = [system + [40 + i, 41, 42] for i in range(3)]
    group = [questions[0]] * 8 + questions[1:]
    settings = [SamplingParams(5, 0.0, ignore_eos=True)] * len(group)
    engine = ContinuousEngine(net, TOK, max_batch=16)
    got = engine.generate(group, settings)
    assert engine.stats["shared_prefills"] == 7  # the 8 copies: one prefill, KV copied 7 times
    assert engine.stats["prefix_hits"] == 2 and engine.stats["prefix_tokens_saved"] >= 2 * len(system)
    alone = TorchEngine(net, TOK, max_batch=1)
    for p, g in zip(group, got, strict=True):
        assert g.ids == alone.generate([p], [settings[0]])[0].ids


def test_slots_stay_contiguous_and_grouped_by_adapter(lora_net: torch.nn.Module) -> None:
    engine = ContinuousEngine(lora_net, TOK, max_batch=6)
    rng = random.Random(7)
    order = {None: 0, "x": 1, "y": 2}
    rows = [engine.row(p, SamplingParams(rng.randrange(1, 12), 0.0, ignore_eos=True), rng.choice([None, "x", "y"]),
                       handle=i) for i, p in enumerate(prompts(30, seed=5))]
    pending = rows
    while pending or engine.busy:
        engine.step(pending[:2])
        pending = pending[2:]
        running = engine.running
        assert [r.slot for r in running] == list(range(len(running)))
        keys = [order[r.adapter] for r in running]
        assert keys == sorted(keys)
        assert engine.reserved == sum(r.reserve for r in running)


def test_the_kv_budget_bounds_rows_in_flight_in_fifo_order(net: torch.nn.Module) -> None:
    ps = prompts(6, seed=9)
    settings = [SamplingParams(20, 0.0, ignore_eos=True)] * 6
    budget = max(len(p) for p in ps) * 2 + 40 + 1  # two rows at most
    engine = ContinuousEngine(net, TOK, max_batch=8, max_tokens=budget)
    rows = [engine.row(p, s, handle=i) for i, (p, s) in enumerate(zip(ps, settings, strict=True))]
    started: list[int] = []
    held = 0  # steps where rows waited with free slots: the budget, not max_batch, held them
    pending = rows
    while pending or engine.busy:
        engine.step(pending)
        pending = []
        assert engine.reserved <= budget
        held += bool(engine.waiting) and len(engine.running) < engine.max_batch
        started += [r.handle for r in engine.running if r.handle not in started]
    assert started == sorted(started)  # FIFO
    assert held > 0
    with pytest.raises(ValueError, match="rollouter.max_tokens"):
        engine.row(ps[0], SamplingParams(budget, 0.0))


def test_weights_changed_mid_generation_reprefill_and_each_token_keeps_its_version(net: torch.nn.Module) -> None:
    """Interrupt: rows pause at a step boundary, the weights change in place, the rows go on re-prefilled."""
    ps = prompts(3, seed=11)
    settings = [SamplingParams(24, 0.0, ignore_eos=True), SamplingParams(18, 1.0, ignore_eos=True),
                SamplingParams(30, 0.7, top_p=0.8, ignore_eos=True)]
    before = {k: v.clone() for k, v in net.state_dict().items()}
    engine = ContinuousEngine(net, TOK, max_batch=4)
    rows = [engine.row(p, s, handle=i) for i, (p, s) in enumerate(zip(ps, settings, strict=True))]
    done = engine.step(rows)  # one token per row and step, more where a draft is accepted
    while max(len(r.ids) for r in rows) < 8:
        done += engine.step()
    assert not done and all(len(r.ids) >= 1 for r in rows)
    first = [len(r.ids) for r in rows]  # tokens of version 0
    try:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        engine.version = 1
        while engine.busy:
            done += engine.step()
        after = {k: v.clone() for k, v in net.state_dict().items()}
        assert engine.stats["reprefills"] == 3
        for r, n in zip(rows, first, strict=True):
            assert r.versions == [0] * n + [1] * (len(r.ids) - n)
        # each token's log-prob is that of the weights it names (teacher-forced, full forward, per version)
        for version, state in ((0, before), (1, after)):
            net.load_state_dict(state)
            for r in rows:
                ref = reference_logprobs(net, r.prompt, r.ids, r.params, None)
                mine = [i for i, v in enumerate(r.versions) if v == version]
                assert torch.allclose(torch.tensor(r.logprobs)[mine], ref[mine], atol=1e-4), (version, r.handle)
    finally:
        net.load_state_dict(before)


@pytest.mark.cuda
def test_on_cuda_the_engine_gives_the_cpu_engine_s_greedy_ids(net: torch.nn.Module) -> None:
    """Run with `make test-cuda` on a machine with a GPU (deselected elsewhere; it fails, never skips, without one)."""
    import copy

    ps = prompts(6, seed=21)
    settings = [SamplingParams(12, 0.0, ignore_eos=True)] * 6
    cpu = ContinuousEngine(net, TOK, max_batch=4).generate(ps, settings)
    gpu_net = copy.deepcopy(net).to("cuda")
    got = ContinuousEngine(gpu_net, TOK, max_batch=4).generate(ps, settings)
    assert [g.ids for g in got] == [c.ids for c in cpu]
    for g, c in zip(got, cpu, strict=True):
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(c.logprobs), atol=1e-3)
