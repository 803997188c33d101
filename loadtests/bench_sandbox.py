"""The cost of the run_code sandbox, measured: one run in namespaces against one in a forked child (the
unisolated fallback), interleaved in one process so both see the same machine.

    python loadtests/bench_sandbox.py [--runs 20] [--repeats 3]

Each run is a trivial passing program with three asserts (verdicts computed outside either way). Prints the
median milliseconds per run of each path in every repeat, their ratio, and the median over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

from services.actions import coderun
from services.actions.verdicts import plan_tests

CODE = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(0, 0) == 0\n"


def timed(run, plan) -> float:
    t0 = time.perf_counter()
    out = run(CODE, plan, 5.0, coderun.LIMITS)
    assert out["passed"], out
    return (time.perf_counter() - t0) * 1000


def isolated_ms(runs: int = 20) -> float | None:
    """The sandbox's cost per run here: the median milliseconds of ``runs`` runs in namespaces (None without them)."""
    if coderun.isolation()[0] != "namespaces":
        return None
    plan = plan_tests(TESTS)
    return statistics.median(timed(coderun._run_isolated, plan) for _ in range(runs))  # noqa: SLF001


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    mode, how = coderun.isolation()
    if mode != "namespaces":
        raise SystemExit(f"no namespaces on this host ({how}): nothing to compare")
    plan = plan_tests(TESTS)
    isolated, forked, ratios = [], [], []
    for r in range(args.repeats):
        iso, frk = [], []
        for _ in range(args.runs):
            iso.append(timed(coderun._run_isolated, plan))  # noqa: SLF001 - the two paths side by side
            frk.append(timed(coderun._run_forked, plan))  # noqa: SLF001
        a, b = statistics.median(iso), statistics.median(frk)
        isolated.append(a)
        forked.append(b)
        ratios.append(a / b)
        print(f"repeat {r + 1}: namespaces {a:6.1f} ms  forked {b:5.1f} ms  ratio {a / b:4.1f}x  (medians of {args.runs})")
    print(f"median of {args.repeats}: namespaces {statistics.median(isolated):.1f} ms, forked "
          f"{statistics.median(forked):.1f} ms, ratio {statistics.median(ratios):.1f}x")


if __name__ == "__main__":
    main()
