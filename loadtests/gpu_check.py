"""The GPU check: what only a CUDA machine can show, in one bounded run (`make gpu-check`; deploy/gpu-check/run.sh
installs the carried wheels first).

    python loadtests/gpu_check.py [--budget 450] [--parts tests,rollout,zero,swap] [--out DIR]
    python loadtests/gpu_check.py --dry-run      # every part's code path on the CPU, tiny sizes, in about a minute

Parts, each a process of its own with its own time limit (a part that fails or runs out of time is recorded and the
next one runs):
- ``tests``: the tests marked cuda (`make test-cuda`'s), from the files under tests/ that have them;
- ``rollout``: Chorus's static and continuous engines beside transformers' ``generate`` on the GPU, float32 and
  bfloat16, new tokens per second of wall time (loadtests/bench_rollout.py's arms and workload);
- ``zero``: a DeepSpeed ZeRO-2 group on NCCL trains SmolLM2 against the torch learner (allclose);
- ``swap``: the training pool's device <-> host swap of a learner's state, and the raw copies.
The model of the last three is SmolLM2-135M-Instruct's config and tokenizer with random weights (its real weights
do not travel; loadtests/gpu_parts.py). Every figure goes to ``gpu-check.json`` in ``$OUT`` when it is set (else
runs/gpu-check/), each part's output to ``gpu-check-<part>.log`` beside it, and a summary table ends the run.
Exit status: 0 when every part passed, 1 when one did not, 2 when CUDA is missing (without ``--dry-run``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("tests", "rollout", "zero", "swap")
# Each part's own limit (seconds): a part is given the smaller of it and what is left of the budget.
LIMITS = {"model": 90, "tests": 120, "rollout": 170, "zero": 150, "swap": 90}
# A dry run (the CPU, tiny sizes, in make test) checks the parts' code paths, not their speed: a loaded machine may
# take many times an idle one's seconds, so its limits only catch a hang.
DRY_LIMITS = dict.fromkeys(LIMITS, 900)
DRY_BUDGET_S = 3600.0
FULL = ["--dtypes", "float32,bfloat16", "--batches", "1,8,32", "--repeats", "3"]
DRY = ["--dtypes", "float32,bfloat16", "--batches", "2", "--shapes", "longtail", "--repeats", "1", "--depth", "2",
       "--equal", "4", "--long", "8", "--short-max", "6", "--swap-b", "0.001"]


def cuda_test_files() -> list[str]:
    """The test files that hold tests marked cuda (collecting only these needs none of the optional extras)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "pytest.mark.cuda" in p.read_text())


def environment() -> dict[str, Any]:
    """The machine: Python, torch, its CUDA and the GPU (from a child, so this process never loads torch)."""
    probe = ("import json, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
             "'cuda': torch.version.cuda, 'cuda_available': c, 'gpus': [torch.cuda.get_device_name(i) for i in "
             "range(torch.cuda.device_count())] if c else []}))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    info: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable}
    if proc.returncode != 0:
        info["error"] = (proc.stderr.strip().splitlines() or ["torch does not import"])[-1]
        return info
    return {**info, **json.loads(proc.stdout.strip().splitlines()[-1])}


def run_part(name: str, cmd: list[str], limit: float, log: Path) -> dict[str, Any]:
    """Run one part's command with ``limit`` seconds, its output into ``log`` (and echoed); its record."""
    print(f"\n=== {name} (at most {limit:.0f} s): {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
        assert proc.stdout is not None
        timer = _Killer(proc, limit)
        for line in proc.stdout:
            fh.write(line)
            sys.stdout.write(f"  {line}")
        code = proc.wait()
        timer.cancel()
    seconds = round(time.perf_counter() - t0, 1)
    record: dict[str, Any] = {"status": "ok" if code == 0 else "failed", "seconds": seconds, "exit": code}
    if timer.fired:
        record.update(status="timeout", error=f"stopped at its limit of {limit:.0f} s")
    elif code != 0:
        tail = [ln for ln in log.read_text().splitlines() if ln.strip()][-3:]
        record["error"] = " | ".join(tail)[-400:] or f"exit {code}"
    return record


class _Killer:
    """Kills a part's whole process group (a ZeRO group's ranks too) at its limit."""

    def __init__(self, proc: subprocess.Popen[str], limit: float) -> None:
        self.fired = False
        self.proc = proc
        self.timer = threading.Timer(limit, self._kill)
        self.timer.start()

    def _kill(self) -> None:
        self.fired = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def cancel(self) -> None:
        self.timer.cancel()


def tests_command(junit: Path, limit: float, dry: bool) -> list[str]:
    """pytest on the tests marked cuda, as `make test-cuda` runs them, with what travels."""
    # tests/conftest.py imports uvloop, which does not travel (deploy/gpu-check/requirements.in); the cuda tests use
    # none of its fixtures
    bare = [] if importlib.util.find_spec("uvloop") else ["--noconftest"]
    # only the plugins the tests use (run_part sets PYTEST_DISABLE_PLUGIN_AUTOLOAD): a machine's own pytest plugins
    # may not load under the carried pytest
    plugins = [x for plugin in ("pytest_asyncio.plugin", "pytest_timeout")
               if importlib.util.find_spec(plugin.split(".")[0]) for x in ("-p", plugin)]
    stuck = [f"--timeout={max(limit - 15, 5):.0f}"] if "pytest_timeout" in plugins else []  # stacks, not a kill
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugins, *stuck, "-m", "cuda",
            f"--junitxml={junit}", *bare, *(["--collect-only"] if dry else []), *cuda_test_files()]


def tests_figures(log: Path, junit: Path, dry: bool) -> dict[str, Any]:
    """Counts of the tests part: from pytest's JUnit XML, or in a dry run the tests it collected."""
    if dry:
        collected = [ln for ln in log.read_text().splitlines() if "::" in ln and ln.strip().startswith("tests/")]
        return {"collected": len(collected), "ran": 0}
    if not junit.is_file():
        return {}
    import xml.etree.ElementTree as ET

    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")  # type: ignore[assignment]
    if suite is None:
        return {}
    cases = suite.findall("testcase")
    bad = [f"{c.get('classname')}::{c.get('name')}" for c in cases
           if c.find("failure") is not None or c.find("error") is not None]
    total, failures, errors = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors"))
    skipped = int(suite.get("skipped", 0))
    return {"collected": total, "passed": total - failures - errors - skipped, "failed": failures,
            "errors": errors, "skipped": skipped, "not_passed": bad}


def summary(result: dict[str, Any]) -> str:
    """The table printed at the end: a line per part, then its figures."""
    env = result["environment"]
    lines = [f"GPU check on {', '.join(env.get('gpus') or ['no GPU'])} (torch {env.get('torch')}, CUDA "
             f"{env.get('cuda')}, Python {env.get('python')}); device {result['device']}"
             f"{' (dry run: tiny sizes)' if result['dry_run'] else ''}",
             f"model: {result.get('model', '-')}", "",
             f"{'part':<9}{'status':<9}{'s':>7}"]
    for name, rec in result["parts"].items():
        lines.append(f"{name:<9}{rec['status']:<9}{rec.get('seconds', 0):>7.1f}"
                     + (f"  {rec['error']}" if rec.get("error") else ""))
        figures = rec.get("figures") or {}
        try:
            described = DESCRIBE.get(name, describe_any)(figures)
        except (KeyError, TypeError, ValueError):  # a part stopped halfway: its figures as they are
            described = describe_any(figures)
        lines += [f"    {line}" for line in described]
    lines.append(f"total {result['seconds']:.0f} s; every figure in {result['json']}")
    return "\n".join(lines)


def describe_any(f: dict[str, Any]) -> list[str]:
    return [f"{k} = {v}" for k, v in f.items()]


def describe_model(f: dict[str, Any]) -> list[str]:
    if not f:
        return []
    return [f"{f['model']}: {f['parameters']:,} parameters, tokenizer {f['tokenizer']}, config {f['config']}"]


def describe_tests(f: dict[str, Any]) -> list[str]:
    if "passed" not in f:
        return describe_any(f)
    out = [f"{f['collected']} tests marked cuda: {f['passed']} passed, {f['failed']} failed, {f['errors']} errors, "
           f"{f['skipped']} skipped"]
    return out + [f"not passed: {t}" for t in f.get("not_passed", [])]


def describe_rollout(f: dict[str, Any]) -> list[str]:
    if not f.get("cells"):
        return []
    arms = ("static", "continuous", "hf_generate")
    reps = ", ".join(f"{d} {n}" for d, n in f.get("repeats", {}).items())
    out = [f"new tokens per second of wall time on {f['device']} (medians over repeats: {reps}); same: rows whose "
           "first 4 tokens are the static arm's (random weights: near-ties differ between batch shapes)",
           f"{'cell':<24}" + "".join(f"{a:>13}" for a in arms) + f"{'cont/hf':>9}{'static/hf':>10}  same"]
    for key, cell in f["cells"].items():
        rates = "".join(f"{cell[a]['tok_s']:>13.1f}" if a in cell else f"{'-':>13}" for a in arms)
        ratios = "".join(f"{f['ratios'].get(f'{key} {a}/hf_generate', '-'):>{w}}"
                         for a, w in (("continuous", 9), ("static", 10)))
        same = " ".join(cell[a]["same_start_as_static"] for a in arms[1:] if a in cell)
        out.append(f"{key:<24}{rates}{ratios}  {same}")
    return out + [f"error: {e}" for e in f.get("errors", [])]


def describe_zero(f: dict[str, Any]) -> list[str]:
    if "max_abs_weight_diff" not in f:
        return describe_any(f)
    return [f"ZeRO-2, {f['ranks']} rank(s) on {f['backend']}, {f['parameters']:,} parameters, {f['steps']} steps "
            "against the torch learner:",
            f"max |w_zero - w_torch| {f['max_abs_weight_diff']:.2e} (weights moved up to {f['max_weight_moved']:.2e}); "
            f"allclose(atol={f['atol']}, rtol={f['rtol']}) {f['allclose']}; max |loss diff| "
            f"{f['max_abs_loss_diff']:.2e}; update's relative error {f['update_relative_error']:.2e}",
            f"group {f['group_s_with_start']} s with its start, torch learner {f['torch_learner_s']} s",
            *(f"error: {e}" for e in f.get("errors", []))]


def describe_swap(f: dict[str, Any]) -> list[str]:
    if "export_s" not in f:
        return describe_any(f)
    out = [f"pool swap of a learner's state ({f['state_gb']} GB): export {f['export_s']} s ({f['export_gb_s']} GB/s), "
           f"import {f['import_s']} s ({f['import_gb_s']} GB/s); state identical {f['state_identical']}, next step "
           f"identical {f['next_step_identical']}"]
    raw = f.get("raw", {})
    for key, v in raw.items():
        if isinstance(v, dict):
            out.append(f"raw {raw['state_gb']} GB ({raw['params_b']}B parameters) {key}: offload {v['offload_s']} s "
                       f"({v['offload_gb_s']} GB/s), onload {v['onload_s']} s ({v['onload_gb_s']} GB/s)")
    return out + [f"error: {e}" for e in f.get("errors", [])]


DESCRIBE = {"model": describe_model, "tests": describe_tests, "rollout": describe_rollout, "zero": describe_zero,
            "swap": describe_swap}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="on the CPU, tiny sizes: every part's code path, fast")
    p.add_argument("--device", default=None, help="cuda (default), or cpu (the default of --dry-run)")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for every part together (default 450; with --dry-run {DRY_BUDGET_S:.0f})")
    p.add_argument("--out", default=None, help="where the JSON and logs go (default $OUT, else runs/gpu-check)")
    a = p.parse_args()
    started = time.perf_counter()
    deadline = time.monotonic() + (a.budget if a.budget is not None else DRY_BUDGET_S if a.dry_run else 450.0)
    device = a.device or ("cpu" if a.dry_run else "cuda")
    parts = [x.strip() for x in a.parts.split(",") if x.strip()]
    if any(x not in PARTS for x in parts):
        p.error(f"--parts from {','.join(PARTS)}")
    out = Path(a.out or os.environ.get("OUT") or ROOT / "runs" / "gpu-check").resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = ROOT / "runs" / "gpu-check" / "work" if not a.out else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    env = environment()
    if device == "cuda" and not env.get("cuda_available"):
        why = env.get("error") or f"torch {env.get('torch')} sees no CUDA device (torch.cuda.is_available() is False)"
        print(f"gpu-check: {why} in {sys.executable}; this check needs a CUDA GPU and a CUDA build of torch "
              "(--dry-run runs it on the CPU)", file=sys.stderr)
        return 2
    limits = DRY_LIMITS if a.dry_run else LIMITS
    sizes = DRY if a.dry_run else FULL
    model = work / "model"
    result: dict[str, Any] = {"device": device, "dry_run": a.dry_run, "environment": env, "parts": {},
                              "json": str(out / "gpu-check.json")}

    def save() -> None:
        result["seconds"] = round(time.perf_counter() - started, 1)
        (out / "gpu-check.json").write_text(json.dumps(result, indent=1))

    def part(name: str, cmd: list[str], figures: Any = None) -> dict[str, Any]:
        left = deadline - time.monotonic()
        if left < 10:
            rec: dict[str, Any] = {"status": "not run", "seconds": 0.0, "error": "the check's time was up"}
        else:
            limit = min(limits[name], left)
            fig_file = work / f"{name}.json"
            fig_file.unlink(missing_ok=True)
            rec = run_part(name, [*cmd, *(["--budget", f"{max(limit - 20, 10):.0f}", "--result", str(fig_file)]
                                          if figures is None else [])], limit, out / f"gpu-check-{name}.log")
            found = figures() if figures is not None else (json.loads(fig_file.read_text())
                                                            if fig_file.is_file() else {})
            if isinstance(found, dict) and "skipped" in found and rec["status"] == "ok":
                rec.update(status="skipped", error=found.pop("skipped"))
            rec["figures"] = found
        result["parts"][name] = rec
        save()
        return rec

    py = sys.executable
    common = ["--device", device, "--model", str(model), "--work", str(work), *sizes]
    if {"rollout", "zero", "swap"} & set(parts):
        made = part("model", [py, "loadtests/gpu_parts.py", "model", *common, *(["--tiny"] if a.dry_run else [])])
        result["model"] = made.get("figures", {}).get("model", "not made")
    for name in parts:
        if name == "tests":
            junit = work / "junit.xml"
            junit.unlink(missing_ok=True)
            cmd = tests_command(junit, min(limits["tests"], deadline - time.monotonic()), a.dry_run)
            part("tests", cmd, lambda j=junit: tests_figures(out / "gpu-check-tests.log", j, a.dry_run))
        elif result["parts"].get("model", {}).get("status") != "ok":
            result["parts"][name] = {"status": "not run", "seconds": 0.0, "error": "the model was not made"}
        else:
            part(name, [py, "loadtests/gpu_parts.py", name, *common])
    save()
    print("\n" + summary(result), flush=True)
    (out / "gpu-check-summary.txt").write_text(summary(result) + "\n")
    return 0 if all(r["status"] in ("ok", "skipped") for r in result["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
