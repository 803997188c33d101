"""The fault suite's table: every case adds its outcome; the table is printed and written at the end (with xdist,
each worker writes its rows and the controller prints them all)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.faults.harness import Outcome, table

pytestmark = pytest.mark.e2e

_OUTCOMES: list[tuple[str, Outcome]] = []
OUT = ROOT / "runs" / "faults"


@pytest.fixture
def fault_table() -> Iterator[list[tuple[str, Outcome]]]:
    yield _OUTCOMES


def _worker(config: Any) -> str | None:
    return getattr(config, "workerinput", {}).get("workerid")


def _rows_files() -> list[Path]:
    return sorted(OUT.glob(".rows-*.md"))


def pytest_configure(config: Any) -> None:
    if _worker(config) is None:  # the controller (or a run without workers): no rows of an earlier run
        for f in _rows_files():
            f.unlink(missing_ok=True)


def pytest_sessionfinish(session: Any) -> None:
    worker = _worker(session.config)
    if worker is not None and _OUTCOMES:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f".rows-{worker}.md").write_text("\n".join(table(_OUTCOMES).splitlines()[2:]) + "\n")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _OUTCOMES:
        text = table(_OUTCOMES)
    else:
        rows = [line for f in _rows_files() for line in f.read_text().splitlines() if line]
        if not rows:
            return
        text = "\n".join([*table([]).splitlines()[:2], *rows])
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.md").write_text(text + "\n")
    terminalreporter.write_sep("=", "fault cases")
    terminalreporter.write_line(text)
    terminalreporter.write_line(f"(written to {OUT / 'report.md'})")
