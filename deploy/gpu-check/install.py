"""Put the wheels `make gpu-wheels` carried on this interpreter's path, with nothing but the standard library (no pip,
no network): each pinned distribution this interpreter lacks at that version is unpacked from its wheel into
``--site``, which run.sh then puts first on PYTHONPATH. Distributions already installed at the pinned version are
used as they are.

    python deploy/gpu-check/install.py --wheels DIR --requirements FILE --site DIR
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import re
import shutil
import sys
import zipfile
from pathlib import Path

# name==version, and at most a python_version marker (what wheels.py writes)
LINE = re.compile(r'^([A-Za-z0-9_.\-]+)==([^\s;]+)\s*(?:;\s*python_version\s*==\s*"(\d+\.\d+)")?\s*$')


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def fits(wheel: str) -> bool:
    """Whether a wheel's tags (``name-version[-build]-py-abi-platform.whl``) run on this interpreter."""
    py_tags, abi_tags, plat_tags = wheel[: -len(".whl")].split("-")[-3:]
    major, minor = sys.version_info[:2]
    cp = f"cp{major}{minor}"
    plat_ok = any(p == "any" or (p.startswith("manylinux") and p.endswith("_" + platform.machine()))
                  for p in plat_tags.split("."))
    abi_ok = any(a in ("none", "abi3", cp) for a in abi_tags.split("."))
    py_ok = any(p in ("py3", f"py{major}{minor}", cp) or
                ("abi3" in abi_tags and p.startswith(f"cp{major}") and int(p[3:] or 99) <= minor)
                for p in py_tags.split("."))
    return plat_ok and abi_ok and py_ok


def unpack(wheel: Path, site: Path) -> None:
    """What ``pip install --target`` does for a wheel: its files into ``site``, keeping their modes."""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            path = Path(zf.extract(info, site))
            mode = info.external_attr >> 16
            if mode and not info.is_dir():
                path.chmod(mode & 0o777)
    for data in site.glob("*.data"):  # a wheel's purelib/platlib parts belong on the path too
        for part in ("purelib", "platlib"):
            for item in (data / part).glob("*") if (data / part).is_dir() else []:
                shutil.copytree(item, site / item.name, dirs_exist_ok=True) if item.is_dir() \
                    else shutil.copy2(item, site / item.name)
        shutil.rmtree(data)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", type=Path, required=True)
    ap.add_argument("--requirements", type=Path, required=True)
    ap.add_argument("--site", type=Path, required=True)
    a = ap.parse_args()
    if not a.requirements.is_file():
        print(f"gpu-check: {a.requirements} is missing: nothing carried, so the parts use what this python has "
              "(on a machine with CUDA torch alone, run `make gpu-wheels` where PyPI is reachable and carry "
              "deploy/gpu-check/carry)", file=sys.stderr)
        return 0
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    wheels = list(a.wheels.glob("*.whl")) if a.wheels.is_dir() else []
    shutil.rmtree(a.site, ignore_errors=True)
    a.site.mkdir(parents=True)
    used, missing, kept = [], [], 0
    for raw in a.requirements.read_text().splitlines():
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        m = LINE.match(raw.strip())
        if m is None:
            print(f"gpu-check: cannot read {raw!r} in {a.requirements}", file=sys.stderr)
            return 1
        name, pinned, only = m.groups()
        if only is not None and only != version:
            continue
        try:
            if importlib.metadata.version(name) == pinned:
                kept += 1
                continue
        except importlib.metadata.PackageNotFoundError:
            pass
        found = [w for w in wheels if norm(w.name.split("-")[0]) == norm(name) and w.name.split("-")[1] == pinned
                 and fits(w.name)]
        if not found:
            missing.append(f"{name}=={pinned}")
            continue
        unpack(found[0], a.site)
        used.append(found[0].name)
    print(f"gpu-check: {len(used)} carried wheels unpacked into {a.site}, {kept} distributions already here at the "
          f"carried version (Python {version}, {sys.executable})")
    if missing:
        print(f"gpu-check: no wheel in {a.wheels} for Python {version} on {platform.machine()}: {', '.join(missing)}"
              " (make gpu-wheels builds them for CPython 3.11 and 3.12)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
