"""The training pool through `chorus up` (configs/pool-tiny.yaml, shortened): four models' trainers share two slots
against a real nats-server. Every model reaches max_versions, every published sample is in exactly one step or drop
record of its model, and the pool's metrics say both slots trained and the states moved."""

from __future__ import annotations

import json
from collections import defaultdict

import nats
import yaml

from shared.kernel.codec import decode
from shared.kernel.schemas import Sample
from tests.conftest import ROOT
from tests.e2e.conftest import assert_books, chorus_up

MODELS = ["planner_lm", "solver_lm", "checker_lm", "answer_lm"]
VERSIONS = 20


async def test_four_models_on_two_slots_reach_their_versions_and_keep_their_books(nats_url, run_id, tmp_path):
    cfg = yaml.safe_load((ROOT / "configs" / "pool-tiny.yaml").read_text())
    cfg["run"] = {"id": run_id, "dir": str(tmp_path / "runs"), "seed": 0}
    cfg.pop("nats", None)
    cfg["train"]["max_versions"] = VERSIONS
    cfg["metrics_interval_s"] = 0.5
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(cfg))

    ours = f"chorus.{run_id}-"
    published: dict[str, set[str]] = defaultdict(set)
    records: list[dict] = []
    pool_metrics: list[dict] = []

    async def on_msg(msg) -> None:
        if not msg.subject.startswith(ours):
            return
        if ".traj." in msg.subject:
            s = decode(Sample, msg.data)
            published[s.model].add(s.sample_id)
        elif ".metrics." in msg.subject:
            m = json.loads(msg.data)
            if isinstance(m.get("pool"), dict) and "slots" in m["pool"]:  # the training pool's (not a rollouter's)
                pool_metrics.append(m["pool"])
        else:
            records.append(json.loads(msg.data))

    nc = await nats.connect(nats_url)
    await nc.subscribe("chorus.*.traj.*", cb=on_msg)
    await nc.subscribe("chorus.*.events.*", cb=on_msg)
    await nc.subscribe("chorus.*.metrics.>", cb=on_msg)
    code, text = await chorus_up(path, nats_url, 600)
    await nc.flush()
    await nc.close()
    assert code == 0, text[-4000:]
    assert "services that did not exit cleanly" not in text, text[-3000:]

    for m in MODELS:
        assert_books(records, published[m], m, VERSIONS)
        drops = {r["reason"] for r in records if r.get("model") == m and r.get("kind") == "drop"}
        assert drops <= {"finished", "stale"}, drops

    # the pool reported its slots: both trained, models took turns on them, states were set and got
    assert pool_metrics, "the training pool published no metrics"
    last = pool_metrics[-1]
    assert len(last["slots"]) == 2 and all(s["busy_s"] > 0 and s["grants"] > 0 for s in last["slots"]), last
    assert last["swap"]["sets"] > 4 * VERSIONS and last["swap"]["gets"] > 0, last
    assert last["swap"]["control_s"] > 0 and last["swap"]["data_s"] > 0 and last["resident_bytes"] > 0, last
    holders = {s["holder"] for snap in pool_metrics for s in snap["slots"]} | {
        s["last"] for snap in pool_metrics for s in snap["slots"]}
    assert set(MODELS) <= holders, holders
