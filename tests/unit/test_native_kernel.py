"""Chorus's own few-row product kernel: built where a compiler is, exact where it runs, absent with a reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.rollouter import kernels, native
from services.rollouter.kernels import planned_linear

ROOT = Path(__file__).resolve().parents[2]


def test_the_kernel_builds_wherever_a_compiler_is() -> None:
    if native.compiler() is None:
        assert "no C++ compiler" in native.why_unavailable() and not native.available()
    else:
        assert native.available(), native.why_unavailable()
        assert native.block() in (16, 32)


@pytest.mark.parametrize("n,k", [(1, 1), (5, 3), (31, 17), (32, 16), (33, 64), (100, 48), (64, 577), (200, 96)])
def test_rows_linear_equals_f_linear_for_any_shape_row_count_bias_and_threads(n: int, k: int) -> None:
    assert native.available(), native.why_unavailable()
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            for t in (*range(1, 18), 33):
                x = torch.randn(t, k, generator=gen)
                for bias in (None, b):
                    got = native.rows_linear(x, w, bias)
                    want = F.linear(x.double(), w.double(), None if bias is None else bias.double()).float()
                    assert got.shape == (t, n) and got.is_contiguous() and got.dtype == torch.float32
                    torch.testing.assert_close(got, want, atol=1e-5 * k ** 0.5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_a_non_contiguous_input_and_a_weight_changed_in_place() -> None:
    assert native.available(), native.why_unavailable()
    w = torch.nn.Linear(48, 40, bias=False).weight
    x = torch.randn(48, 6).t()  # [6, 48], strided
    assert not x.is_contiguous()
    with torch.no_grad():
        torch.testing.assert_close(native.rows_linear(x, w, None), F.linear(x, w), atol=1e-5, rtol=1e-5)
        first = native.packed(w)
        assert native.packed(w) is first  # kept while the weight is unchanged
        w.mul_(-2.0)  # a load writes in place (copy_): the packed copy is stale
        torch.testing.assert_close(native.rows_linear(x, w, None), F.linear(x, w), atol=1e-5, rtol=1e-5)
        assert native.packed(w) is not first
    native.forget(w)
    assert not hasattr(w, "_chorus_rows")


def test_the_plan_measures_the_kernel_and_a_plan_that_chose_it_is_exact() -> None:
    assert native.available(), native.why_unavailable()
    w = torch.randn(72, 40)
    plan = kernels.measure(w)
    assert {m for m, _ in plan.times} == set(kernels.METHODS) - ({"onednn"} - ({"onednn"} if kernels.onednn_available()
                                                                               else set()))
    choices = tuple(("rows", max(t, 1)) for t in range(kernels.PLAN_ROWS + 1)) + (("rows", 0),)
    for t in (1, 7, 16, 20):
        x = torch.randn(t, 40)
        torch.testing.assert_close(planned_linear(x, w, None, choices), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_without_the_kernel_the_plan_chooses_among_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    for off in ({"CHORUS_NATIVE_KERNELS": "0"}, {"PATH": "", "CXX": ""}):
        monkeypatch.setattr(native, "_lib", None)
        monkeypatch.setattr(native, "_why", None)
        for key, value in off.items():
            monkeypatch.setenv(key, value)
        assert not native.available()
        assert native.why_unavailable() == ("CHORUS_NATIVE_KERNELS=0" if "CHORUS_NATIVE_KERNELS" in off
                                            else "no C++ compiler ($CXX, c++, g++ or clang++) on PATH")
        w = torch.randn(24, 16)
        times = kernels.measure(w).times
        assert {m for m, _ in times} >= {"linear", "mm"} and all(m != "rows" for m, _ in times)
        monkeypatch.undo()


def test_a_fresh_cache_builds_once_and_later_processes_load_it(tmp_path: Path) -> None:
    if native.compiler() is None:
        pytest.fail("no C++ compiler on this machine: the kernel cannot be built")
    env = {**os.environ, "CHORUS_KERNEL_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT)}
    code = "from services.rollouter import native; print(native.available(), native.why_unavailable())"
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
        built = list(tmp_path.glob("*.so"))  # one library, no half-written file left
        assert len(built) == 1 and built[0].name.startswith("rows-")
