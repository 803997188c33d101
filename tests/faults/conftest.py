"""The fault suite's table: every case adds its outcome; the table is printed and written at the end."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.faults.harness import Outcome, table

pytestmark = pytest.mark.e2e

_OUTCOMES: list[tuple[str, Outcome]] = []


@pytest.fixture
def fault_table() -> Iterator[list[tuple[str, Outcome]]]:
    yield _OUTCOMES


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _OUTCOMES:
        return
    text = table(_OUTCOMES)
    out = ROOT / "runs" / "faults"
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text + "\n")
    terminalreporter.write_sep("=", "fault cases")
    terminalreporter.write_line(text)
    terminalreporter.write_line(f"(written to {out / 'report.md'})")
