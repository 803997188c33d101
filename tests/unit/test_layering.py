"""The rooms of ``shared/`` and the services keep their layering: the import-linter contracts of pyproject.toml
hold on the code, and each kind of wrong arrow makes them fail (checked on a copy of the tree)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command(['--no-cache']))"]
ROOMS = {"kernel", "launcher", "models", "results", "rlmath"}


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the packages under ``tree`` (first on the path, ahead of the installed checkout)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(LINT, cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def copy_with_import(tmp_path: Path, module: str, imported: str) -> Path:
    """A copy of shared/, services/ and pyproject.toml in which ``module`` also imports ``imported``."""
    tree = tmp_path / "tree"
    for name in ("shared", "services"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    path = tree.joinpath(*module.split(".")).with_suffix(".py")
    source = path.read_text()
    body = ast.parse(source).body
    first = next(node for node in body if isinstance(node, ast.Import | ast.ImportFrom)
                 and not (isinstance(node, ast.ImportFrom) and node.module == "__future__"))
    lines = source.splitlines(keepends=True)
    lines.insert(first.lineno - 1, f"import {imported}  # noqa: F401\n")
    path.write_text("".join(lines))
    return tree


def test_the_contracts_hold_on_the_code() -> None:
    out = lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout, out.stdout


@pytest.mark.parametrize(("module", "imported", "broken"), [
    ("shared.kernel.codec", "shared.launcher.cli", "shared.kernel is not allowed to import shared.launcher"),
    ("shared.kernel.service", "services.mq.table", "shared.kernel is not allowed to import services"),
    ("services.trainer.learner", "shared.launcher.supervisor", "services is not allowed to import shared.launcher"),
    ("shared.models.weights", "shared.results.tracking", "shared.models is not allowed to import shared.results"),
    ("shared.rlmath.advantages", "shared.models.loading", "shared.rlmath is not allowed to import shared.models"),
    ("services.trainer.advantages", "services.rollouter.engine", "services.trainer is not allowed to import services.rollouter"),
])
def test_a_forbidden_import_breaks_a_contract(tmp_path: Path, module: str, imported: str, broken: str) -> None:
    out = lint(copy_with_import(tmp_path, module, imported))
    assert out.returncode == 1, out.stdout + out.stderr
    assert broken in out.stdout and f"{module} -> {imported}" in out.stdout, out.stdout


def test_shared_holds_only_rooms_each_saying_what_it_holds() -> None:
    entries = {p.name for p in (ROOT / "shared").iterdir() if p.name != "__pycache__"}
    assert entries == ROOMS | {"__init__.py"}, entries
    for room in ROOMS:
        doc = ast.get_docstring(ast.parse((ROOT / "shared" / room / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 25, f"shared/{room}/__init__.py needs a paragraph on what it holds"
    index = (ROOT / "docs" / "index.md").read_text()
    assert all(f"`shared/{room}/`" in index for room in ROOMS), "docs/index.md lacks the map of the rooms"
