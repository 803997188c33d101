"""Check that an install pulls no CUDA library: the dependency closure of ``chorus[<extras>]`` over the installed
distributions holds no ``nvidia-*``, ``cuda-*`` or ``*-cu1x`` package.

``python -m shared.launcher.depcheck dev`` (run by ``make venv``) exits 1 naming each such package and the chain of
requirements that pulled it in.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

CUDA = re.compile(r"^(nvidia-|cuda-|cupy)|-cu1\d$|^lib.*-cu1\d$")


def closure(root: str, extras: tuple[str, ...]) -> dict[str, list[str]]:
    """Every installed distribution ``root[extras]`` requires, directly or not, with the chain that pulls it."""
    seen: dict[str, list[str]] = {}
    todo: list[tuple[str, tuple[str, ...], list[str]]] = [(root, extras, [])]
    while todo:
        name, want, chain = todo.pop()
        key = canonicalize_name(name)
        if key in seen and not want:
            continue
        seen.setdefault(key, [*chain, key])
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue  # a requirement whose marker did not apply here, or not installed: nothing below it
        for text in dist.requires or []:
            req = Requirement(text)
            envs = [{"extra": e} for e in want] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
                continue
            dep = canonicalize_name(req.name)
            if dep not in seen or req.extras:
                todo.append((req.name, tuple(sorted(req.extras)), seen[key]))
    return seen


def cuda_packages(root: str = "chorus", extras: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The CUDA distributions in the closure, each with the chain of requirements that pulls it in."""
    return {name: chain for name, chain in closure(root, extras).items() if CUDA.search(name)}


def main(argv: list[str] | None = None) -> int:
    extras = tuple(e for arg in (sys.argv[1:] if argv is None else argv) for e in arg.split(",") if e)
    found = cuda_packages("chorus", extras)
    target = f"chorus[{','.join(extras)}]" if extras else "chorus"
    if found:
        print(f"error: {target} pulls CUDA libraries into this environment:", file=sys.stderr)
        for name, chain in sorted(found.items()):
            print(f"  {name}  (via {' -> '.join(chain)})", file=sys.stderr)
        print("a CPU install needs none: install torch from the CPU index (make venv "
              "TORCH_INDEX=https://download.pytorch.org/whl/cpu) and leave out the ucx extra", file=sys.stderr)
        return 1
    print(f"{target}: no CUDA library in its {len(closure('chorus', extras))} installed dependencies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
