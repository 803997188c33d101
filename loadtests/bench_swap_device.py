"""Device <-> host swap of a learner's training state (FlexMARL §6.2, Fig. 11), on a GPU.

    python loadtests/bench_swap_device.py [--sizes 0.1,0.5,1.5] [--repeats 3]

For each model size (billions of parameters, float32 training state as Chorus's learner holds it: weights, AdamW's
two moments, accumulated gradients: 16 bytes per parameter, cut into tensors of a Llama-like shape), the state is
moved device -> host (offload, Set) and host -> device (onload, Get):
- into pinned host memory or into pageable host memory;
- as one contiguous buffer (the tensors copied into one device buffer first, then one transfer, as
  ``services/trainer/swap.py`` lays the state out) or tensor by tensor.
Prints seconds and GB/s per cell (medians over repeats), and the offload seconds beside Fig. 11's (0.5 s at 3B,
3.8 s at 32B on the paper's NPUs: about 0.13 s per billion parameters). Needs CUDA (exits 2 without it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

PAPER_OFFLOAD_S = {3: 0.5, 32: 3.8}  # Fig. 11 (billions of parameters: seconds)


def state_tensors(params_b: float, device: torch.device) -> list[torch.Tensor]:
    """Weights, two moments and gradients of a model with ``params_b`` billion parameters, in tensors of 4096 x k."""
    total = int(params_b * 1e9)
    rows = 4096
    sizes = []
    left = total
    while left > 0:
        n = min(left, rows * 11008)
        sizes.append(n)
        left -= n
    return [torch.randn(n, device=device) for _ in range(4) for n in sizes]


def timed(fn, device: torch.device) -> float:
    cuda = device.type == "cuda"  # gpu_check.py's dry run measures the same copies on the CPU
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def measure(tensors: list[torch.Tensor], pinned: bool, repeats: int, device: torch.device
            ) -> dict[str, tuple[float, float]]:
    """(offload s, onload s) medians, for one buffer and per tensor, into pinned or pageable host memory."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    host_one = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=pinned)
    host_each = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors]
    flat = torch.empty(nbytes // 4, dtype=torch.float32, device=device)

    def off_one() -> None:
        torch.cat([t.reshape(-1) for t in tensors], out=flat)
        host_one.copy_(flat, non_blocking=pinned)

    def on_one() -> None:
        flat.copy_(host_one, non_blocking=pinned)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()

    def off_each() -> None:
        for h, t in zip(host_each, tensors, strict=True):
            h.copy_(t, non_blocking=pinned)

    def on_each() -> None:
        for h, t in zip(host_each, tensors, strict=True):
            t.copy_(h, non_blocking=pinned)

    out = {}
    for layout, off, on in (("one buffer", off_one, on_one), ("per tensor", off_each, on_each)):
        offs = [timed(off, device) for _ in range(repeats)]
        ons = [timed(on, device) for _ in range(repeats)]
        out[layout] = (statistics.median(offs), statistics.median(ons))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0.1,0.5,1.5", help="billions of parameters")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: no CUDA device: this benchmark measures device <-> host copies", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(device)}")
    print(f"{'params B':>8} {'state GB':>9} {'host':>9} {'layout':>10} {'offload s':>10} {'GB/s':>7} "
          f"{'onload s':>9} {'GB/s':>7}")
    for b in (float(x) for x in args.sizes.split(",")):
        tensors = state_tensors(b, device)
        gb = sum(t.numel() * t.element_size() for t in tensors) / 1e9
        for pinned in (True, False):
            for layout, (o, i) in measure(tensors, pinned, args.repeats, device).items():
                print(f"{b:8.2f} {gb:9.2f} {'pinned' if pinned else 'pageable':>9} {layout:>10} {o:10.3f} "
                      f"{gb / o:7.1f} {i:9.3f} {gb / i:7.1f}")
        del tensors
        torch.cuda.empty_cache()
    slope = (PAPER_OFFLOAD_S[32] - PAPER_OFFLOAD_S[3]) / (32 - 3)
    print(f"Fig. 11 (FlexMARL, NPUs): offload {PAPER_OFFLOAD_S[3]} s at 3B, {PAPER_OFFLOAD_S[32]} s at 32B: "
          f"{slope:.3f} s per billion parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
