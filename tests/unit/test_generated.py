"""The coordinator's generated tokens against trained versions: one metrics.jsonl line per change of the
trained versions, read back (the last one continues the count after a restart)."""

from __future__ import annotations

import json
from pathlib import Path

from services.coordinator.generated import GeneratedTokens
from shared.results.plotting import last_generated, load_evals, load_generated, load_metrics


def test_a_line_only_when_a_trained_version_moves_and_the_count_goes_on_from_the_last_line(tmp_path: Path) -> None:
    g = GeneratedTokens()
    assert g.on_trained({"m": 0}) is None  # nothing trained yet
    g.add(40)
    g.add(60)
    first = g.on_trained({"m": 1, "k": 0})
    assert first is not None and (first["tokens_generated"], first["tasks"], first["versions"]) == (100, 2, {"k": 0, "m": 1})
    assert g.on_trained({"m": 1, "k": 0}) is None
    g.add(5)
    second = g.on_trained({"m": 1, "k": 1})
    assert second is not None and second["tokens_generated"] == 105
    metrics = tmp_path / "metrics.jsonl"
    step = {"model": "m", "version": 1, "reward_mean": 0.5}
    metrics.write_text("\n".join([json.dumps(step), json.dumps(first), json.dumps(second),
                                  '{"kind": "generated", "tokens_gen']) + "\n")  # the last line cut by a crash
    assert last_generated(metrics) == (105, 3)
    assert [r["tokens_generated"] for r in load_generated(metrics)] == [100, 105]
    assert load_metrics(metrics) == [step] and load_evals(metrics) == []  # the other readers skip these lines
    assert last_generated(tmp_path / "none.jsonl") == (0, 0)
    resumed = GeneratedTokens(*last_generated(metrics))
    resumed.add(10)
    line = resumed.on_trained({"m": 2, "k": 1})
    assert line is not None and (line["tokens_generated"], line["tasks"]) == (115, 4)
