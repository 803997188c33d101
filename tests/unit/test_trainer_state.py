"""What a trainer commits with a version, read back as a restarted trainer reads it."""

from __future__ import annotations

import pytest
import torch

from services.trainer.learner import Learner
from services.trainer.state import RECENT_STEPS, RecentSteps, pack_state, steps_remembered, unpack_state
from shared.kernel.config import load_config
from shared.kernel.subjects import Names


def test_recent_steps_keep_the_ids_of_the_last_steps_only() -> None:
    recent = RecentSteps(keep=2)
    recent.add(1, ["a", "b"])
    recent.add(2, ["c"])
    recent.add(3, ["d"])
    assert list(recent.ids()) == ["c", "d"]
    assert RecentSteps(2, [(v, ids) for v, ids in recent.to_list()]).to_list() == recent.to_list()


def test_a_copy_older_than_the_remembered_steps_is_stale_anyway() -> None:
    assert steps_remembered(0) == steps_remembered(2) == RECENT_STEPS
    # trained at step T from version v >= T - s; a copy arriving at T + k has staleness >= k: stale once k > s.
    for s in (0, 2, 63, 100, 1000):
        assert steps_remembered(s) > s + 1


def test_a_committed_state_restores_the_optimizer_version_and_record(tmp_path) -> None:
    p = tmp_path / "run.yaml"
    p.write_text("models: {m: {arch: {hidden_size: 16, num_layers: 1, num_heads: 2, intermediate_size: 32}}}\n"
                 "agents: {solver: {model: m}, verifier: {model: m}}\n")
    cfg = load_config(p)
    a = Learner(cfg, "m")
    with torch.no_grad():  # an optimizer step's worth of change and state
        for t in a.trainable:
            t.grad = torch.ones_like(t)
    a.optimizer.step()
    recent = RecentSteps()
    recent.add(7, ["x_0_0", "x_0_1"])
    blob = pack_state(7, a.optimizer.state_dict(), {"version": 7, "sample_ids": ["x_0_0", "x_0_1"]}, recent)

    got = unpack_state(blob)
    assert got.version == 7 and got.record == {"version": 7, "sample_ids": ["x_0_0", "x_0_1"]}
    assert list(got.recent.ids()) == ["x_0_0", "x_0_1"]
    b = Learner(cfg, "m")
    b.load_state_dict({"version": got.version, "model": a.named_tensors(), "optimizer": got.optimizer})
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert b.version == 7 and sa.keys() == sb.keys()
    assert all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) and torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"])
               for k in sa)


def test_a_blob_that_is_not_a_committed_state_is_refused() -> None:
    import io

    buf = io.BytesIO()
    torch.save({"weights": torch.zeros(2)}, buf)
    with pytest.raises(ValueError, match="not a committed trainer state"):
        unpack_state(buf.getvalue())


def test_object_names_carry_model_version_and_epoch() -> None:
    assert Names.weights_object("m", 3) == "weights/m/v3"
    assert Names.weights_object("m", 3, "ab12") == "weights/m/v3-ab12"
    assert Names.state_object("solver_lm", 12, "ff") == "state/solver_lm/v12-ff"
    assert Names.object_version("m", "weights/m/v3-ab12") == 3
    assert Names.object_version("m", "state/m/v12-ff") == 12
    assert Names.object_version("m", "weights/other/v3") is None
    assert Names.object_version("m", "checkpoints/m/v3") is None
