"""The best held-out version against a real nats-server: the coordinator's keeper copies the served weights out of
the object store before an evaluation, keeps them only when the evaluation beats the best so far, and `chorus
export --version best` writes exactly those weights."""

from __future__ import annotations

import time
from pathlib import Path

import nats
import torch

from services.coordinator.keepbest import BestKeeper
from shared.kernel.bus import ensure_run
from shared.kernel.config import load_config
from shared.kernel.subjects import Names
from shared.models import best
from shared.models.export import export, load_checkpoint
from shared.models.loading import load_model, shipped_tensors
from shared.models.tokenizer import ByteTokenizer
from shared.models.weights import flatten, pack

MODEL = "m"


def record(final: float, failed: int = 0) -> dict[str, object]:
    return {"final": final, "failed": failed, "pass1": {"solver": final}, "version_max": 3, "time": time.time()}


async def test_the_best_evaluated_weights_are_kept_and_exported(nats_url: str, run_id: str, tmp_path: Path) -> None:
    (tmp_path / "runs" / run_id).mkdir(parents=True)
    config = tmp_path / "runs" / run_id / "config.yaml"
    config.write_text(f"run: {{id: {run_id}, dir: {tmp_path / 'runs'}}}\nmodels: {{{MODEL}: {{}}}}\n"
                      f"agents: {{solver: {{model: {MODEL}}}, verifier: {{model: {MODEL}}}}}\n")
    cfg = load_config(config)
    run_dir, names = cfg.run_dir, Names(run_id)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        _, obj = await ensure_run(js, cfg)
        versions = {}
        for version in (3, 4):  # the trainer's commits: v3 and v4, each its own weights
            net = load_model(cfg, MODEL)
            with torch.no_grad():
                for t in shipped_tensors(net, False).values():
                    t.add_(0.01 * version)
            header, buf = flatten(MODEL, version, {k: v.detach().clone() for k, v in shipped_tensors(net, False).items()})
            await obj.put(Names.weights_object(MODEL, version, "e1"), pack(header, buf))
            versions[version] = net
        keeper = BestKeeper(js, names, run_dir, [MODEL])
        keeper.synced(MODEL, 3, Names.weights_object(MODEL, 3, "e1"))  # the sync of v3 named its object

        staged = await keeper.stage({MODEL: 3})
        assert staged is not None and staged[MODEL] is not None and staged[MODEL].is_file()
        assert await keeper.settle(record(0.5), staged, {MODEL: 3})
        assert not staged[MODEL].exists()  # moved, not copied
        kept = best.read_record(run_dir)
        assert kept is not None and kept["versions"] == {MODEL: 3} and kept["final"] == 0.5

        # v4 scores lower: its copy is dropped and v3 stays the best; a coordinator that started after the sync
        # finds the object by its name
        keeper = BestKeeper(js, names, run_dir, [MODEL])
        assert keeper.best is not None and keeper.best["final"] == 0.5  # a restart goes on from the kept best
        staged = await keeper.stage({MODEL: 4})
        assert staged is not None and staged[MODEL] is not None
        assert not await keeper.settle(record(0.25), staged, {MODEL: 4})
        assert not staged[MODEL].exists() and best.read_record(run_dir)["versions"] == {MODEL: 3}  # type: ignore[index]
        # an evaluation that lost a task never becomes the best, however high it scored
        staged = await keeper.stage({MODEL: 4})
        assert not await keeper.settle(record(0.9, failed=1), staged, {MODEL: 4})
        assert await keeper.stage({MODEL: 9}) is None and keeper.errors == 1  # no such version: said and counted
    finally:
        await nc.close()

    out = tmp_path / "exported"
    done = export(run_dir, MODEL, out, "best")
    assert done.version == 3 and done.checkpoint == best.weights_path(run_dir, MODEL)
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([ByteTokenizer().encode("1+2=3")])
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
        torch.testing.assert_close(theirs, versions[3].eval()(input_ids=ids).logits)
        torch.testing.assert_close(load_checkpoint(cfg, MODEL, done.checkpoint)(input_ids=ids).logits, theirs)
        assert (theirs - versions[4].eval()(input_ids=ids).logits).abs().max() > 1e-4
