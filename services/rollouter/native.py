"""Chorus's own few-row product kernel (``rows.cpp``), compiled on the machine that runs it and loaded with ctypes.

The kernel plan (:mod:`.kernels`) measures it as the method ``"rows"`` beside ``F.linear``, ``W @ X^T`` and
oneDNN, and uses it only for the weight shapes and row counts where it was fastest on this CPU.

Compiled once per (source, compiler, CPU) with the C++ compiler of ``$CXX`` or the first of ``c++``, ``g++``,
``clang++`` on ``PATH``, ``-O3 -march=native`` (the CPU's own vector width: AVX-512, AVX2, NEON) and OpenMP
where the compiler has it, into ``$CHORUS_KERNEL_CACHE`` (default ``$XDG_CACHE_HOME/chorus/kernels``, else
``~/.cache/chorus/kernels``): about a second, then a file found by later processes. The file's name holds a hash
of the source, the compiler's version and the CPU's flags, so a cache shared by machines of different CPUs never
loads code built for another. No compiler, a failed build or ``CHORUS_NATIVE_KERNELS=0``: the method is not a
candidate (:func:`why_unavailable` says why) and the plan chooses among the others.

Weights are float32 on the CPU; each is packed once into the kernel's layout (a copy the size of the weight, kept
on the tensor and packed again after the weight changed in place, like oneDNN's prepacked copy).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("rows.cpp")
ENV_OFF = "CHORUS_NATIVE_KERNELS"  # "0": never build or load the kernel
ENV_CACHE = "CHORUS_KERNEL_CACHE"
BUILD_TIMEOUT_S = 180
# tried in order: the CPU's own instructions with OpenMP, without OpenMP, then the compiler's defaults
FLAG_SETS = (("-O3", "-march=native", "-fopenmp"), ("-O3", "-march=native"), ("-O3",))

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why: str | None = None  # None: not tried yet; "": loaded
_block = 0


def cache_root() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "chorus" / "kernels"


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(cxx: str) -> Path:
    """The compiled library for this source, compiler and CPU: found in the cache or built into it."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    source = SOURCE.read_bytes()
    errors = []
    for flags in FLAG_SETS:
        digest = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(flags).encode(),
                                            _cpu_flags().encode(), platform.machine().encode()])).hexdigest()[:16]
        out = cache_root() / f"rows-{digest}.so"
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            done = subprocess.run([cxx, *flags, "-std=c++17", "-shared", "-fPIC", str(SOURCE), "-o", tmp],
                                  capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode == 0:
                os.replace(tmp, out)  # atomic: processes building at once each install a whole file
                return out
            errors.append(f"{' '.join(flags)}: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError("; ".join(errors))


def _load() -> None:
    global _lib, _why, _block
    if os.environ.get(ENV_OFF, "1") == "0":
        _why = f"{ENV_OFF}=0"
        return
    cxx = compiler()
    if cxx is None:
        _why = "no C++ compiler ($CXX, c++, g++ or clang++) on PATH"
        return
    try:
        lib = ctypes.CDLL(str(_build(cxx)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _why = f"could not build {SOURCE.name} with {cxx}: {exc}"
        return
    c_long, c_void_p = ctypes.c_long, ctypes.c_void_p
    lib.chorus_rows_product.argtypes = [c_void_p, c_long, c_long, c_void_p, c_long, c_void_p, ctypes.c_int]
    lib.chorus_rows_product.restype = None
    lib.chorus_rows_pack.argtypes = [c_void_p, c_long, c_long, c_void_p]
    lib.chorus_rows_pack.restype = None
    lib.chorus_rows_packed_size.argtypes = [c_long, c_long]
    lib.chorus_rows_packed_size.restype = c_long
    _block = int(lib.chorus_rows_block())
    _lib, _why = lib, ""


def library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first use; None where it cannot be (see :func:`why_unavailable`)."""
    if _why is None:
        with _lock:
            if _why is None:
                _load()
    return _lib


def available() -> bool:
    return library() is not None


def why_unavailable() -> str:
    """Empty when the kernel is loaded; else why it is not."""
    library()
    return _why or ""


def block() -> int:
    """Outputs per packed block (32 with AVX-512, 16 otherwise); 0 when unavailable."""
    library()
    return _block


def supports(w: torch.Tensor) -> bool:
    return w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2 and available()


def packed(w: torch.Tensor) -> torch.Tensor:
    """``w`` in the kernel's layout, kept on the tensor and packed again once ``w`` changed in place."""
    cached = getattr(w, "_chorus_rows", None)
    if cached is not None and cached[0] == w._version:
        return cached[1]
    lib = library()
    assert lib is not None, why_unavailable()
    src = w.detach().contiguous()
    n, k = src.shape
    p = torch.empty(lib.chorus_rows_packed_size(n, k), dtype=torch.float32)
    lib.chorus_rows_pack(src.data_ptr(), n, k, p.data_ptr())
    w._chorus_rows = (w._version, p)  # type: ignore[attr-defined]
    return p


def rows_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, w, b)`` for float32 x [t, in] on the CPU, by the kernel (the GIL released while it runs)."""
    if x.dtype != torch.float32:
        return torch.nn.functional.linear(x, w, b)
    lib = _lib if _lib is not None else library()
    assert lib is not None, why_unavailable()
    p = packed(w)
    x = x.contiguous()
    t, k = x.shape
    n = w.shape[0]
    y = torch.empty((t, n), dtype=torch.float32)
    lib.chorus_rows_product(x.data_ptr(), t, k, p.data_ptr(), n, y.data_ptr(), torch.get_num_threads())
    return y.add_(b) if b is not None else y


def forget(w: torch.Tensor) -> None:
    """Drop ``w``'s packed copy (a plan that did not choose the kernel for its shape)."""
    if hasattr(w, "_chorus_rows"):
        del w._chorus_rows


__all__ = ["available", "block", "cache_root", "compiler", "forget", "library", "packed", "rows_linear",
           "supports", "why_unavailable"]
