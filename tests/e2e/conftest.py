"""Helpers for end-to-end tests: a small two-model run config, `chorus up`, a run's sample books."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT

CHORUS = str(Path(sys.executable).parent / "chorus")

pytestmark = pytest.mark.e2e


def small_run_config(tmp_path: Path, run_id: str, sections: dict[str, dict[str, object]] | None = None,
                     **train: object) -> Path:
    """configs/tiny-chain.yaml shrunk for a test: one group per step, quick versions; ``train`` keys and whole
    ``sections`` (merged into the file's) on top."""
    base = yaml.safe_load((ROOT / "configs" / "tiny-chain.yaml").read_text())
    base["run"] = {"id": run_id, "dir": str(tmp_path / "runs"), "seed": 0}
    base.pop("nats", None)
    base.setdefault("train", {}).update({"checkpoint_every": 0, **train})
    for name, values in (sections or {}).items():
        base.setdefault(name, {}).update(values)
    base["metrics_interval_s"] = 0.5
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


UP_BACKSTOP_S = 1100  # the least --timeout-s an e2e `chorus up` gets: below pytest's own 1200 s limit


async def chorus_up(config: Path, nats_url: str, timeout_s: int) -> tuple[int | None, str]:
    """`chorus up <config>` against the test's broker, the way a user starts it: its exit code and output. A run
    ends at its max_versions; ``timeout_s`` is only a backstop, and a loaded machine gets 1100 s at least (below
    pytest's own 1200 s limit) rather than a window that blames the run for the machine's speed."""
    proc = await asyncio.create_subprocess_exec(CHORUS, "up", str(config), "--timeout-s", str(max(timeout_s, UP_BACKSTOP_S)),
                                                env={**os.environ, "CHORUS_NATS__URL": nats_url},
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = await proc.communicate()
    return proc.returncode, out.decode(errors="replace")


def assert_books(records: list[dict[str, Any]], published: set[str], model: str, versions: int) -> None:
    """Every sample of ``model`` that was published is in exactly one of its step or drop records (of ``records``,
    the run's events), and its step versions run 1..``versions``."""
    places: Counter[str] = Counter()
    for r in records:
        if r.get("model") == model and r.get("kind") in ("step", "drop"):
            places.update(r["sample_ids"])
    assert published and set(places) == published, (model, len(published), len(places))
    assert max(places.values()) == 1, [sid for sid, n in places.items() if n > 1][:5]
    steps = sorted(r["version"] for r in records if r.get("model") == model and r.get("kind") == "step")
    assert steps == list(range(1, versions + 1)), model
