"""A CPU install (`make venv`) pulls no CUDA library; the ucx extra is opt-in."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shared.launcher.depcheck import closure, cuda_packages

ROOT = Path(__file__).resolve().parents[2]


def venv_extras() -> tuple[str, ...]:
    m = re.search(r"^VENV_EXTRAS := (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, "Makefile defines no VENV_EXTRAS"
    return tuple(e.strip() for e in m.group(1).split(",") if e.strip())


def test_make_venv_installs_its_extras_and_checks_them() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -e '.[$(VENV_EXTRAS)]'" in makefile
    assert "python -m shared.launcher.depcheck $(VENV_EXTRAS)" in makefile
    assert "ucx" not in venv_extras()


def test_the_dependency_closure_of_make_venv_has_no_cuda_library() -> None:
    extras = venv_extras()
    deps = closure("chorus", extras)
    assert {"torch", "transformers", "nats-py", "pytest"} <= set(deps)  # the closure is really walked
    assert cuda_packages("chorus", extras) == {}


@pytest.mark.ucx
def test_the_ucx_extra_is_where_the_cuda_libraries_come_from() -> None:
    found = cuda_packages("chorus", ("dev", "ucx"))
    assert "ucxx-cu12" in found and "cuda-bindings" in found, found
    assert found["cuda-bindings"][:2] == ["chorus", "ucxx-cu12"]
