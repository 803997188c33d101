"""How the continuous engine computes a matrix product of a few token rows: a plan measured per weight shape.

On CPU the fastest way to multiply a weight by a handful of token rows depends on the CPU, its BLAS and the
thread count, and no fixed rule holds across CPUs (one MKL thread, SmolLM2-135M's LM head, 49152 x 576 in
float32):

- an AVX2 Xeon: ``F.linear`` of 1 row is a gemv at about 11 GB/s and of 2 or 3 rows one gemv per row
  (3 rows 33 ms, 4 rows 16 ms), while ``W @ X^T`` of 2 to 4 rows is a gemm that streams the weight once
  (5.9 ms for 1 or 2 rows, 9.8 ms for 4): padding rows with zeros and using ``W @ X^T`` paid;
- an AVX-512/AMX Xeon: ``F.linear`` of 1, 2, 3, 4, 8 rows took 11.8, 12.4, 12.0, 21.4, 39.1 ms and
  ``W @ X^T`` 11.3, 27.6, 25.7, 27.0, 28.0 ms: the same rule made a step of one row slower than ``F.linear``.

A third way, oneDNN's linear on a copy of the weight prepacked for it (what vLLM's CPU build runs), wins on
the AMX Xeon from 4 rows on for the larger weights (the head of 8 rows: 20 ms) and loses at 1 row. A fourth,
Chorus's own kernel (``rows``: :mod:`.native`, compiled on the machine that runs it), streams a weight packed in
blocks of outputs once with a software prefetch ahead and keeps every row's sums in registers; where it was
built, it is one more candidate.

So :class:`KernelPlan` times the four ways with the real weight when the engine starts, for each distinct
(out, in, dtype, device, threads) among the engine's plain ``nn.Linear`` layers, at
:data:`MEASURED_ROWS` rows, and for every row count t up to :data:`PLAN_ROWS` picks the (method, rows r >= t)
of least time: t rows are padded with zero rows to r (the extra outputs are sliced away, so the result is
the product of the t rows). More than :data:`PLAN_ROWS` rows run unpadded by the method fastest at
:data:`MANY_ROWS` rows. On CUDA, or with the plan disabled: ``F.linear``, no padding. Plans are cached per process (:data:`PLANS`), so engines of one model measure once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.rollouter import native

PLAN_ROWS = 16  # products of at most this many rows follow the plan
MEASURED_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)
# more rows (a batch's decode step): unpadded, by the method fastest at this many rows (the LM head of a batch of
# 32 on an AVX2 EPYC: 49 ms with F.linear, 32 ms with oneDNN)
MANY_ROWS = 32
# F.linear(x, w) | torch.mm(w, x.t()).t() | oneDNN's linear on a prepacked copy of the weight (the kernel
# vLLM's CPU build uses): on an AMX Xeon, SmolLM2's head of 8 rows took 42 ms with F.linear, 36 with W @ X^T
# and 20 with oneDNN, and the whole engine ran 1.4x faster at batch 8 but 0.8x at batch 1: measured, not assumed
# and Chorus's own kernel (``rows``, services/rollouter/rows.cpp) where it could be built
METHODS = ("linear", "mm", "onednn", "rows")
PACK_ROWS_HINT = 8  # the batch size oneDNN is told to prepack for (a hint: any row count works)
REPEATS = 5  # timed runs per candidate (after one warm-up), the minimum kept ...
BUDGET_S = 0.02  # ... stopping once a candidate has spent this long (at least MIN_REPEATS runs)
MIN_REPEATS = 2
PAD_MARGIN = 0.05  # padding t rows must beat the best unpadded product of t rows by this fraction

Key = tuple[int, int, torch.dtype, str, int]  # out, in, dtype, device, torch threads
Choice = tuple[str, int]  # method, rows computed
Timer = Callable[[str, torch.Tensor, int], float]  # (method or "pad", weight, rows) -> seconds

PLANS: dict[Key, ShapePlan] = {}  # measured plans of this process


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packed(w: torch.Tensor) -> torch.Tensor:
    """``w`` prepacked for oneDNN's linear, kept on the tensor and packed again once ``w`` changed in place
    (a weight load bumps its version counter)."""
    cached = getattr(w, "_chorus_onednn", None)
    if cached is not None and cached[0] == w._version:
        return cached[1]
    pw = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS_HINT)
    w._chorus_onednn = (w._version, pw)  # type: ignore[attr-defined]
    return pw


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed(w), b, "none", [], "")


def product(method: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w^T`` [r, out] computed by ``method``; ``"pad"``: one row of ``x`` padded with zero rows to r."""
    if method == "pad":
        return torch.cat((x[:1], x.new_zeros((x.shape[0] - 1, x.shape[1]))))
    if method == "mm":
        return torch.mm(w, x.t()).t().contiguous()
    if method == "onednn":
        return onednn_linear(x, w, None)
    if method == "rows":
        return native.rows_linear(x, w, None)
    return F.linear(x, w)


def time_product(method: str, w: torch.Tensor, rows: int) -> float:
    """Seconds ``product(method, x, w)`` takes for ``rows`` rows: the least of a few runs after a warm-up."""
    gen = torch.Generator(device=w.device).manual_seed(0)
    with torch.inference_mode():
        x = torch.randn((rows, w.shape[1]), generator=gen, device=w.device).to(w.dtype)
        product(method, x, w)
        best, spent = float("inf"), 0.0
        for n in range(REPEATS):
            t0 = time.perf_counter()
            product(method, x, w)
            dt = time.perf_counter() - t0
            best, spent = min(best, dt), spent + dt
            if n + 1 >= MIN_REPEATS and spent >= BUDGET_S:
                break
    return best


def choose(times: Mapping[Choice, float], pad: float = 0.0, rows: int = PLAN_ROWS) -> tuple[Choice, ...]:
    """For t = 1..``rows``, the measured (method, r >= t) of least time, ``pad`` seconds added where r > t
    (ties: fewer rows, then F.linear); index 0 is unused. Where t itself was measured, padding must also win
    by :data:`PAD_MARGIN` (a near tie is noise). No measured r >= t: ``F.linear`` unpadded."""
    out: list[Choice] = [("linear", 0)]
    for t in range(1, rows + 1):
        cands = [(s + (pad if r > t else 0.0), r, METHODS.index(m)) for (m, r), s in times.items()
                 if rows >= r >= t and m in METHODS]
        best = min(cands, default=None)
        exact = min((c for c in cands if c[1] == t), default=None)
        if best is not None and exact is not None and best[0] * (1 + PAD_MARGIN) > exact[0]:
            best = exact
        out.append((METHODS[best[2]], best[1]) if best is not None else ("linear", t))
    many = [(s, METHODS.index(m)) for (m, r), s in times.items() if r == MANY_ROWS and m in METHODS]
    if many:  # index rows + 1: more than ``rows`` rows, unpadded (0)
        out.append((METHODS[min(many)[1]], 0))
    return tuple(out)


@dataclass(frozen=True)
class ShapePlan:
    """The plan for one weight shape: ``choices[t]`` is the (method, padded rows) for a product of t rows."""

    key: Key
    times: dict[Choice, float]  # seconds by (method, rows)
    pad: float  # seconds to pad a row with zero rows (a copy, an allocation)
    choices: tuple[Choice, ...]

    def summary(self) -> str:
        """``"1:mm 2:linear 3:linear@4 ..."``: t rows run as method, padded to @r rows where r > t."""
        few = " ".join(f"{t}:{m}" + (f"@{r}" if r > t else "")
                       for t, (m, r) in enumerate(self.choices[: PLAN_ROWS + 1]) if t)
        many = f" >{PLAN_ROWS}:{self.choices[PLAN_ROWS + 1][0]}" if len(self.choices) > PLAN_ROWS + 1 else ""
        return few + many


def shape_key(w: torch.Tensor) -> Key:
    return (int(w.shape[0]), int(w.shape[1]), w.dtype, str(w.device), torch.get_num_threads())


def measure(w: torch.Tensor, timer: Timer | None = None,
            rows: Sequence[int] = (*MEASURED_ROWS, MANY_ROWS)) -> ShapePlan:
    """Time every method at every row count with the weight ``w`` (``timer`` defaults to :func:`time_product`)."""
    timer = timer or time_product
    usable = {"linear": True, "mm": True, "onednn": onednn_available(), "rows": native.supports(w)}
    methods = [m for m in METHODS if timer is not time_product or usable[m]]
    times: dict[Choice, float] = {}
    for r in rows:
        for m in methods:
            try:
                times[(m, r)] = float(timer(m, w, r))
            except RuntimeError:  # oneDNN without a kernel for this dtype or CPU: not a candidate
                continue
    pad = float(timer("pad", w, 2))
    return ShapePlan(shape_key(w), times, pad, choose(times, pad))


class KernelPlan:
    """The measured plans of an engine's weights, by role (``"q_proj"``, ``"head"``, ...).

    ``enabled`` False, or weights off the CPU: nothing is measured and :meth:`choices` is None (F.linear).
    A ``timer`` given (tests) measures afresh and leaves the process cache alone.
    """

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], *, enabled: bool = True,
                 timer: Timer | None = None) -> None:
        self.enabled = enabled
        self.threads = torch.get_num_threads()
        self.measured = 0  # shapes this plan timed itself (not found in the cache)
        self.seconds = 0.0  # time spent measuring them
        self.plans: dict[Key, ShapePlan] = {}
        self.roles: dict[Key, list[str]] = {}
        t0 = time.perf_counter()
        for role, w in weights:
            if not enabled or w.device.type != "cpu":
                continue
            key = shape_key(w)
            if key not in self.plans:
                plan = PLANS.get(key) if timer is None else None
                if plan is None:
                    plan = measure(w.detach(), timer)
                    self.measured += 1
                    if timer is None:
                        PLANS[key] = plan
                self.plans[key] = plan
            roles = self.roles.setdefault(key, [])
            if role not in roles:
                roles.append(role)
        self.seconds = time.perf_counter() - t0

    def choices(self, w: torch.Tensor) -> tuple[Choice, ...] | None:
        plan = self.plans.get(shape_key(w))
        return plan.choices if plan is not None else None

    def cost(self, w: torch.Tensor) -> list[float] | None:
        """Seconds a product of ``w`` with t rows takes as planned, t = 0..PLAN_ROWS (index 0: 0), from the
        measured times; None without a plan for it."""
        plan = self.plans.get(shape_key(w))
        if plan is None:
            return None
        out = [0.0]
        for t in range(1, PLAN_ROWS + 1):
            method, r = plan.choices[t]
            s = plan.times.get((method, r))
            if s is None:  # an unpadded product between two measured row counts: the next measured one's
                s = min((v for (m, rr), v in plan.times.items() if m == method and PLAN_ROWS >= rr >= t),
                        default=out[-1])
            out.append(s + (plan.pad if r > t else 0.0))
        return out

    def summary(self) -> dict[str, str]:
        """Per weight shape (``"576x576 q_proj,o_proj"``), the choice for 1..PLAN_ROWS rows and for more; empty when
        off."""
        return {f"{k[0]}x{k[1]} {','.join(self.roles[k])}": p.summary() for k, p in self.plans.items()}


def planned_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                   choices: Sequence[Choice] | None) -> torch.Tensor:
    """``F.linear(x, w, b)`` for x [t, in], computed as ``choices[t]`` says (zero rows appended up to its r)."""
    t = x.shape[0]
    if choices is None or t == 0:
        return F.linear(x, w, b)
    if t > PLAN_ROWS:
        if len(choices) <= PLAN_ROWS + 1 or choices[PLAN_ROWS + 1][0] == "linear":
            return F.linear(x, w, b)
        method, r = choices[PLAN_ROWS + 1][0], t
    else:
        method, r = choices[t]
    if r > t:
        x = torch.cat((x, x.new_zeros((r - t, x.shape[1]))))
    if method == "mm":
        y = torch.mm(w, x.t())[:, :t].t()
        return (y + b if b is not None else y).contiguous()
    if method == "onednn":
        return onednn_linear(x, w, b)[:t] if r > t else onednn_linear(x, w, b)
    if method == "rows":
        return native.rows_linear(x, w, b)[:t] if r > t else native.rows_linear(x, w, b)
    if r > t:
        y = F.linear(x, w)[:t]
        return y + b if b is not None else y
    return F.linear(x, w, b)


__all__ = ["BUDGET_S", "MANY_ROWS", "MEASURED_ROWS", "METHODS", "PLANS", "PLAN_ROWS", "KernelPlan", "ShapePlan", "choose",
           "measure", "planned_linear", "time_product"]
