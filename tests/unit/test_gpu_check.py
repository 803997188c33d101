"""The GPU check's plumbing on the CPU (`make gpu-check ARGS=--dry-run`): deploy/gpu-check/run.sh finds the python,
installs what was carried, runs every part in its own process at tiny sizes and writes every figure; without CUDA
the real check stops at once with its reason. The ZeRO-2 part, which needs the deepspeed extra, is marked
deepspeed (`make test-deepspeed`)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "deploy" / "gpu-check" / "run.sh"
_spec = importlib.util.spec_from_file_location("gpu_check_install", ROOT / "deploy" / "gpu-check" / "install.py")
assert _spec is not None and _spec.loader is not None
install = importlib.util.module_from_spec(_spec)  # deploy/gpu-check/install.py: a script beside run.sh
_spec.loader.exec_module(install)


def run_check(tmp_path: Path, *args: str, timeout: float = 1100) -> subprocess.CompletedProcess:
    """`make gpu-check ARGS=...` as run.sh runs it, on this machine seen as one without a GPU, whatever it has."""
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_SITE": str(tmp_path / "site"),
           "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(["bash", str(RUN), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_dry_run_measures_every_part_on_the_cpu_and_writes_every_figure(tmp_path):
    proc = run_check(tmp_path, "--dry-run", "--out", str(tmp_path), "--parts", "tests,rollout,swap")
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-4000:])
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    assert result["device"] == "cpu" and result["dry_run"] is True
    parts = result["parts"]
    assert list(parts) == ["model", "tests", "rollout", "swap"]
    assert all(p["status"] == "ok" for p in parts.values()), {k: p.get("error") for k, p in parts.items()}
    assert parts["model"]["figures"]["parameters"] > 0
    assert parts["tests"]["figures"]["collected"] >= 4  # the tests marked cuda, collected (not run) on the CPU
    cells = parts["rollout"]["figures"]["cells"]
    assert set(cells) == {"float32 B=2 longtail", "bfloat16 B=2 longtail"}
    for cell in cells.values():
        assert set(cell) == {"static", "continuous", "hf_generate"}
        assert all(arm["tok_s"] > 0 and arm["short_rows"] == 0 for arm in cell.values())
    assert len(parts["rollout"]["figures"]["ratios"]) == 4
    swap = parts["swap"]["figures"]
    assert swap["state_identical"] and swap["next_step_identical"] and swap["export_gb_s"] > 0
    assert {"pageable one buffer", "pageable per tensor"} <= set(swap["raw"])
    summary = (tmp_path / "gpu-check-summary.txt").read_text()
    assert summary in proc.stdout and "continuous" in summary and "pool swap" in summary
    assert {p.name for p in tmp_path.glob("gpu-check-*.log")} == {f"gpu-check-{n}.log" for n in parts}


@pytest.mark.deepspeed
def test_the_dry_runs_zero2_group_trains_what_the_torch_learner_trains(tmp_path):
    proc = run_check(tmp_path, "--dry-run", "--out", str(tmp_path), "--parts", "zero")
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-4000:])
    zero = json.loads((tmp_path / "gpu-check.json").read_text())["parts"]["zero"]
    assert zero["status"] == "ok", zero
    figures = zero["figures"]
    assert figures["backend"] == "gloo" and figures["ranks"] == 2 and figures["close"]
    assert figures["max_weight_moved"] > 1e-3 and figures["update_relative_error"] < 1e-2


def test_without_cuda_the_check_stops_at_once_with_its_reason(tmp_path):
    proc = run_check(tmp_path, "--out", str(tmp_path))
    assert proc.returncode == 2
    reason = proc.stderr.strip().splitlines()
    assert len(reason) == 1 and "torch.cuda.is_available() is False" in reason[0], proc.stderr
    assert not (tmp_path / "gpu-check.json").exists()


def test_carried_wheels_are_unpacked_for_this_python_only(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    for name, files in (("gcdemo-1.0-py3-none-any.whl", {"gcdemo/__init__.py": "X = 1\n"}),
                        (f"gcbin-2.0-{tag}-{tag}-manylinux_2_17_x86_64.whl", {"gcbin.py": "Y = 2\n"}),
                        ("gcbin-2.0-cp30-cp30-manylinux_2_17_x86_64.whl", {"gcbin.py": "Y = 3\n"}),
                        ("gcdata-1.0-py3-none-any.whl", {"gcdata-1.0.data/purelib/gcdata.py": "Z = 4\n"})):
        with zipfile.ZipFile(wheels / name, "w") as zf:
            for path, text in files.items():
                zf.writestr(path, text)
    reqs = tmp_path / "requirements.txt"
    reqs.write_text('gcdemo==1.0\ngcbin==2.0\ngcdata==1.0\ngcold==1.0; python_version == "3.0"\n')
    site = tmp_path / "site"
    monkeypatch.setattr(sys, "argv", ["install.py", "--wheels", str(wheels), "--requirements", str(reqs),
                                      "--site", str(site)])
    assert install.main() == 0
    assert (site / "gcdemo" / "__init__.py").is_file() and (site / "gcdata.py").read_text() == "Z = 4\n"
    assert (site / "gcbin.py").read_text() == "Y = 2\n" and not list(site.glob("*.data"))
    reqs.write_text("gcmissing==1.0\n")
    assert install.main() == 1  # named, not silently skipped
