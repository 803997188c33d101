"""The kernel plan of the continuous engine: few-row products measured per weight shape, chosen, cached, exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.rollouter import kernels, native
from services.rollouter.continuous import ContinuousEngine
from services.rollouter.engine import SamplingParams
from services.rollouter.kernels import (
    MANY_ROWS,
    MEASURED_ROWS,
    METHODS,
    PLAN_ROWS,
    KernelPlan,
    choose,
    planned_linear,
)
from shared.kernel.config import ChorusConfig
from shared.models.loading import load_model
from shared.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def tiny(hidden: int, lora: bool = False) -> torch.nn.Module:
    agents = ({"solver": {"model": "m", "adapter": "x"}, "verifier": {"model": "m", "adapter": "y"}} if lora
              else {"solver": {"model": "m"}, "verifier": {"model": "m"}})
    model: dict = {"arch": {"hidden_size": hidden, "num_layers": 2, "num_heads": 4, "intermediate_size": 2 * hidden,
                            "max_position": 128}}
    if lora:
        model["lora"] = {"r": 4}
    return load_model(ChorusConfig(run={"id": "t"}, models={"m": model}, agents=agents), "m")


def test_the_plan_gives_every_row_count_a_measured_padding_and_a_known_method() -> None:
    w = torch.randn(96, 64)
    plan = KernelPlan([("q_proj", w)])
    choices = plan.choices(w)
    assert choices is not None and len(choices) == PLAN_ROWS + 2
    for t in range(1, PLAN_ROWS + 1):
        method, r = choices[t]
        assert method in METHODS and r >= t and r in MEASURED_ROWS
    assert choices[PLAN_ROWS + 1][0] in METHODS and choices[PLAN_ROWS + 1][1] == 0  # more rows: unpadded
    assert list(plan.summary()) == ["96x64 q_proj"]


def test_the_cheapest_padded_choice_wins() -> None:
    # F.linear costs 20 per row, W @ X^T 12 flat from 2 rows (112 for one): one row runs as W @ X^T of two rows
    def timer(method: str, w: torch.Tensor, rows: int) -> float:
        if method == "pad":
            return 1.0
        return 20.0 * rows if method == "linear" else 12.0 + (0 if rows >= 2 else 100)

    w = torch.randn(8, 8)
    choices = KernelPlan([("head", w)], timer=timer).choices(w)
    assert choices is not None
    assert choices[1] == ("mm", 2)
    assert all(choices[t] == ("mm", t) for t in (2, 3, 4, 5, 6, 7, 8, 12, 16))
    assert choices[9] == ("mm", 12) and choices[13] == ("mm", 16)
    # F.linear cheap at 4 rows: 3 rows pad to 4, 4 rows stay
    times = {(m, r): 1.0 for m in METHODS for r in MEASURED_ROWS}
    times[("linear", 4)] = 0.5
    got = choose(times)
    assert got[1] == got[2] == got[3] == got[4] == ("linear", 4)
    assert got[5] == ("linear", 5)  # ties: the fewest rows, then F.linear
    # a near tie does not pad
    times = {(m, r): 1.0 for m in METHODS for r in MEASURED_ROWS}
    times[("mm", 2)] = 0.99
    assert choose(times)[1] == ("linear", 1) and choose(times)[2] == ("mm", 2)
    # padding's own cost counts: 3 rows pad to 4 only where that saves more than the copy
    times[("linear", 3)], times[("linear", 4)] = 1.0, 0.5
    assert choose(times, pad=0.1)[3] == ("linear", 4) and choose(times, pad=0.6)[3] == ("linear", 3)


def test_the_planned_cost_of_t_rows_is_the_chosen_product_s_time_and_its_padding() -> None:
    def timer(method: str, w: torch.Tensor, rows: int) -> float:
        if method == "pad":
            return 1.0
        return 20.0 * rows if method == "linear" else 12.0 + (0 if rows >= 2 else 100)

    w = torch.randn(8, 8)
    plan = KernelPlan([("head", w)], timer=timer)
    cost = plan.cost(w)
    assert cost is not None and len(cost) == PLAN_ROWS + 1 and cost[0] == 0.0
    assert cost[1] == 12.0 + 1.0  # W @ X^T of 2 rows, one padded
    assert cost[2] == cost[8] == 12.0 and cost[9] == 13.0
    assert KernelPlan([("head", w)], enabled=False).cost(w) is None


def test_more_rows_than_the_plan_run_unpadded_by_the_method_fastest_at_many_rows() -> None:
    def timer(method: str, w: torch.Tensor, rows: int) -> float:
        if method == "pad":
            return 1.0
        return {"linear": 3.0, "mm": 2.0, "onednn": 1.0 if rows == MANY_ROWS else 5.0, "rows": 4.0}[method] * rows

    w = torch.randn(24, 16)
    plan = KernelPlan([("head", w)], timer=timer)
    choices = plan.choices(w)
    assert choices is not None and choices[PLAN_ROWS + 1] == ("onednn", 0)
    assert all(choices[t][0] == "mm" for t in range(1, PLAN_ROWS + 1))
    assert plan.summary()["24x16 head"].endswith(f" >{PLAN_ROWS}:onednn")
    x = torch.randn(PLAN_ROWS + 5, 16)
    for method in METHODS:
        got = planned_linear(x, w, None, (*choices[: PLAN_ROWS + 1], (method, 0)))
        torch.testing.assert_close(got, F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_planned_products_equal_f_linear_for_every_choice() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=gen)
    b = torch.randn(48, generator=gen)
    for method in METHODS:
        for pad in (0, 1, 3):
            choices = tuple((method, min(max(t + pad, 1), PLAN_ROWS)) for t in range(PLAN_ROWS + 1))
            for t in range(1, 21):
                x = torch.randn(t, 32, generator=gen)
                for bias in (b, None):
                    got = planned_linear(x, w, bias, choices)
                    assert got.shape == (t, 48) and got.is_contiguous()
                    torch.testing.assert_close(got, F.linear(x, w, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lora", [False, True])
def test_the_engine_s_linear_follows_any_plan_exactly(lora: bool) -> None:
    net = tiny(64, lora)
    engine = ContinuousEngine(net, TOK, max_batch=2)
    names = set(" ".join(engine.kernel_choices()).split())
    assert {"q_proj,k_proj,v_proj,o_proj", "head"} <= names  # base layers of LoRA modules included
    layers = list(engine._choices)
    assert engine.lm_head in layers and len(layers) == 7 * 2 + 1
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for method in METHODS:
            for pad in (0, 2):
                for layer in layers:
                    engine._choices[layer] = tuple((method, min(t + pad, PLAN_ROWS)) for t in range(PLAN_ROWS + 1))
                for t in range(1, 21):
                    for layer in (layers[0], layers[-1]):
                        x = torch.randn(t, layer.weight.shape[1], generator=gen)
                        torch.testing.assert_close(engine._linear(x, layer), F.linear(x, layer.weight, layer.bias),
                                                   atol=1e-5, rtol=1e-5)


def test_a_second_engine_reuses_the_measured_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int, int]] = []
    real = kernels.time_product

    def counting(method: str, w: torch.Tensor, rows: int) -> float:
        calls.append((method, *w.shape))
        return real(method, w, rows)

    monkeypatch.setattr(kernels, "time_product", counting)
    net = tiny(40)  # a shape no other test uses, so nothing is cached yet
    first = ContinuousEngine(net, TOK, max_batch=2)
    shapes = {(o, i) for _, o, i in calls}
    assert len(shapes) == 4 and first.kernels.measured == 4  # q/k/v/o, gate/up, down, head
    usable = len(METHODS) - (not kernels.onednn_available()) - (not native.available())
    assert len(calls) == 4 * (usable * (len(MEASURED_ROWS) + 1) + 1)  # and many rows, and the padding
    calls.clear()
    second = ContinuousEngine(net, TOK, max_batch=2)
    assert calls == [] and second.kernels.measured == 0
    assert second.kernel_choices() == first.kernel_choices()


def test_without_the_plan_every_product_is_f_linear() -> None:
    engine = ContinuousEngine(tiny(64), TOK, max_batch=2, plan_kernels=False)
    assert engine.kernel_choices() == {} and set(engine._choices.values()) == {None}
    x = torch.randn(3, 64)
    torch.testing.assert_close(engine._linear(x, engine.lm_head), F.linear(x, engine.lm_head.weight))


def test_the_plan_follows_the_thread_count() -> None:
    engine = ContinuousEngine(tiny(64), TOK, max_batch=2)
    before = engine.kernels.threads
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        engine.generate([[1, 5, 6]], [SamplingParams(2, 0.0, ignore_eos=True)])
        assert engine.kernels.threads == threads + 1 != before
        assert all(k[4] == threads + 1 for k in engine.kernels.plans)
    finally:
        torch.set_num_threads(threads)


def test_the_onednn_copy_of_a_weight_follows_a_load_in_place() -> None:
    w = torch.nn.Parameter(torch.randn(48, 32), requires_grad=False)
    x = torch.randn(5, 32)
    choices = tuple(("onednn", t) for t in range(PLAN_ROWS + 1))
    torch.testing.assert_close(planned_linear(x, w, None, choices), torch.nn.functional.linear(x, w))
    with torch.no_grad():
        w.add_(1.0)  # what a weight transport's load does: the tensor changes in place
    torch.testing.assert_close(planned_linear(x, w, None, choices), torch.nn.functional.linear(x, w))
