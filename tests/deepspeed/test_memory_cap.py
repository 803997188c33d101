"""A model whose training state does not fit one process's memory, trained by a ZeRO-3 group whose every rank fits.

The model: SmolLM2-360M's shape (32 layers of width 960, 15 heads, an MLP of 2,560; 354M parameters with the byte
vocabulary), randomly initialised: no weights are needed. Trained in float32 with AdamW, the torch learner holds
weights, gradients and two moments, 16 bytes a parameter (5.7 GB); ZeRO-3 over 2 ranks holds half of each per
rank. Every process runs under the same cap (``models.<m>.trainer.memory_mb``: a cgroup v1 memory group each,
set up as root):

- `chorus up` with the torch learner under the cap: the kernel's OOM killer ends the trainer at its first step,
  and the run says so by the model's name, with what to change, in its output, its events and `chorus status`;
- the 2-rank ZeRO-3 group, each rank under the same cap, trains it for a few steps to the weights the torch
  learner (run here without a cap) reaches on the same batches (every element within 2e-4 + 2e-3 relative, but for
  at most 1 in 10,000 of a tensor whose clipped gradient is near AdamW's eps: those within AdamW's own bound).

Marked deepspeed (`make test-deepspeed`, as root in CI). Where cgroups cannot be written the tests fail with the
reason: they are the proof that the cap holds, and a skip would prove nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from services.trainer.learner import Learner
from shared.kernel.config import load_config
from shared.kernel.memcap import MEMORY_GROUP_ENV, MEMORY_LIMIT_ENV, MemoryGroup, rank_groups, unavailable
from tests.deepspeed.cases import STEPS, case_config, train
from tests.e2e.conftest import CHORUS, ROOT
from tests.waits import connect

pytestmark = pytest.mark.deepspeed

ARCH = {"hidden_size": 960, "num_layers": 32, "num_heads": 15, "intermediate_size": 2560, "max_position": 64}
CAP_MB = 4608  # under the torch learner's 16 bytes a parameter (5.7 GB), over a ZeRO-3 rank's half of it
ATOL, RTOL = 2e-4, 2e-3


def _cgroups() -> None:
    why = unavailable()
    if why:
        pytest.fail(f"the memory-cap tests need to write cgroups: {why}")


def big_config(tmp_path: Path, *, stage: int = 3) -> Path:
    """tests/deepspeed/cases.py's config with SmolLM2-360M's shape, no KL term (its reference would double the
    weights), a 2-rank ZeRO-``stage`` group."""
    path = case_config(tmp_path, stage=stage, lora=False, kl=False)
    raw = yaml.safe_load(path.read_text())
    raw["models"]["m"]["arch"] = ARCH
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_zero3_group_whose_every_rank_is_under_the_cap_trains_what_the_torch_learner_trains(tmp_path) -> None:
    _cgroups()
    config = big_config(tmp_path)
    group = MemoryGroup.for_process("memcap-test", "trainer-m-0").create(CAP_MB * 2**20, fresh=True)
    out = tmp_path / "group.pt"
    try:
        proc = subprocess.run([sys.executable, "-m", "tests.deepspeed.cases", str(config), str(out), "stream"],
                              cwd=ROOT, capture_output=True, text=True, timeout=1500, preexec_fn=group.enter,
                              env={**os.environ, MEMORY_GROUP_ENV: str(group.path),
                                   MEMORY_LIMIT_ENV: str(CAP_MB * 2**20)})
        ranks = dict(rank_groups(group))
        peaks = {0: group.max_usage(), **{r: g.max_usage() for r, g in ranks.items()}}
        kills = {0: group.oom_kills(), **{r: g.oom_kills() for r, g in ranks.items()}}
        print("per-rank peak MB under the cap:", {r: round(p / 2**20) for r, p in peaks.items()}, "oom kills:", kills)
        assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
        assert sorted(ranks) == [1] and kills == {0: 0, 1: 0}
        assert all(0 < p <= CAP_MB * 2**20 for p in peaks.values()), peaks
    finally:
        for _, g in rank_groups(group):
            g.remove(parents=False)
        group.remove()
    result = torch.load(out)
    result["tensors"] = {k: t for part in result["parts"] for k, t in torch.load(part).items()}
    cfg = load_config(config)
    learner = Learner(cfg, "m")
    params = sum(t.numel() for t in learner.named_tensors().values())
    assert params > 3.4e8 and 16 * params > CAP_MB * 2**20 > 8 * params  # the cap sits between the two
    start = {k: t.clone() for k, t in learner.named_tensors().items()}
    losses = train(learner, cfg)
    assert result["version"] == STEPS
    assert result["losses"] == pytest.approx(losses, rel=1e-3, abs=1e-5)
    own = learner.named_tensors()
    assert max(float((own[k] - start[k]).abs().max()) for k in own) > 1e-3  # the steps moved the weights
    bound = 2 * cfg.models["m"].optim.lr * STEPS  # AdamW moves an element by about lr a step, whatever its gradient
    for name, t in own.items():
        got = result["tensors"][name]
        off = ~torch.isclose(got, t, atol=ATOL, rtol=RTOL)
        # Adam's update is about lr * sign(g) for any |g| well above eps: an element whose clipped gradient is within
        # float rounding of eps (1e-8) moves by a different fraction of lr when the ranks sum in another order. A
        # few such elements (at most 1 in 10,000 of a tensor) may differ, within Adam's bound; every other is close.
        assert int(off.sum()) <= max(1, t.numel() // 10_000), (name, int(off.sum()), t.numel())
        assert float((got - t).abs().max()) <= bound, (name, float((got - t).abs().max()), bound)


def run_config(tmp_path: Path) -> Path:
    """configs/tiny-chain.yaml with its solver's model in SmolLM2-360M's shape, trained by the torch learner under
    the cap; two tokens per answer, one global batch of 8 samples a version; a crash loop of two ends the run."""
    raw = yaml.safe_load((ROOT / "configs" / "tiny-chain.yaml").read_text())
    raw["run"] = {"id": "oom", "dir": str(tmp_path / "runs"), "seed": 0, "max_restarts": 1, "restart_delay_s": 1.0}
    raw.pop("nats", None)
    raw["models"]["solver_lm"]["arch"] = ARCH
    raw["models"]["solver_lm"]["trainer"] = {"memory_mb": CAP_MB}
    raw["workflow"].update(concurrency=2, group_size=2)
    raw["train"].update(global_batch=8, micro_batch=8, max_versions=3, checkpoint_every=0)
    path = tmp_path / "oom.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


async def test_the_torch_learner_under_the_cap_is_reported_out_of_memory_by_model_in_output_events_and_status(
        tmp_path) -> None:
    _cgroups()
    config = run_config(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHORUS_NATS")}
    proc = await asyncio.create_subprocess_exec(CHORUS, "up", str(config), "--timeout-s", "1500", cwd=ROOT, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    lines: list[str] = []
    events: list[dict] = []
    nc = None
    assert proc.stdout is not None
    async for raw in proc.stdout:
        line = raw.decode(errors="replace").rstrip("\n")
        lines.append(line)
        url = re.search(r"embedded nats-server at (nats://\S+)", line)
        if url and nc is None:
            run_id = next(m.group(1) for x in lines if (m := re.match(r"run (\S+) in ", x)))
            run_dir = tmp_path / "runs" / run_id
            password = (run_dir / "nats" / "observer.password").read_text().strip()
            nc = await connect(url.group(1), user="observer", password=password)

            async def on_event(msg) -> None:  # noqa: ANN001 - nats Msg
                events.append(json.loads(msg.data))

            await nc.subscribe(f"chorus.{run_id}.events.trainer", cb=on_event)
    code = await proc.wait()
    if nc is not None:
        await nc.close()
    text = "\n".join(lines)
    assert code != 0, text[-4000:]
    said = [x for x in lines if x.startswith("out of memory: trainer-solver_lm-0 (model solver_lm)")]
    assert len(said) == 2, text[-6000:]  # the start and the restart: a crash loop, said for what it is
    assert "killed by the kernel's out-of-memory killer (memory cap 4608 MB" in said[0]
    assert "models.solver_lm.trainer.backend: deepspeed" in said[0] and "zero_stage: 3" in said[0]
    oom = [e for e in events if e.get("kind") == "out_of_memory"]
    assert oom and oom[0]["model"] == "solver_lm" and "memory cap 4608 MB" in oom[0]["evidence"], events[-5:]
    assert "deepspeed" in oom[0]["advice"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["models"]["solver_lm"]["out_of_memory"] == 2 and summary["models"]["verifier_lm"]["out_of_memory"] == 0
    status = subprocess.run([CHORUS, "status", str(run_dir)], capture_output=True, text=True, timeout=120, env=env)
    assert "out of memory: the kernel's OOM killer ended 2 process(es) of solver_lm's trainer" in status.stdout, \
        status.stdout + status.stderr
    assert not (Path("/sys/fs/cgroup/memory/chorus") / run_id).exists()  # its memory groups are gone with it


def test_the_supervisor_tells_an_oom_kill_from_a_crash_and_finds_a_ranks_beside_its_own(tmp_path) -> None:
    """Supervisor.start under a cap: a process past it is reported out of memory with the group's evidence, a
    SIGKILL of one within it is not; a rank's group beside rank 0's is read too (what a DeepSpeed group makes)."""
    _cgroups()
    from collections import Counter

    from rich.console import Console

    from shared.launcher.supervisor import Supervisor, report_out_of_memory

    cfg = load_config(run_config(tmp_path))
    sup = Supervisor(tmp_path / "logs")
    hog = [sys.executable, "-c", "x = bytearray(400 * 2**20); import time; time.sleep(60)"]
    counts: Counter[str] = Counter()
    console = Console(record=True, width=400)
    try:
        child = sup.start("trainer-solver_lm-0", hog, 128 * 2**20, "memcap-unit")
        assert child.popen.wait(60) == -9
        said = report_out_of_memory(cfg, child, counts, console)
        assert said is not None and counts == {"solver_lm": 1}
        text = console.export_text()
        assert "out of memory: trainer-solver_lm-0 (model solver_lm): the process was killed by the kernel's " \
               "out-of-memory killer (memory cap 128 MB" in text and "zero_stage: 3" in text, text
        assert json.loads(said["CHORUS_LAST_EXIT"])["count"] == 1
        # a SIGKILL within the cap is a crash, not an OOM kill; the restarted group starts with zeroed counters
        quiet = sup.restart(child)
        quiet.popen.kill()
        quiet.popen.wait(60)
        assert report_out_of_memory(cfg, quiet, counts, console) is None and counts == {"solver_lm": 1}
        # a rank's group beside rank 0's (made by services/trainer/zero.py under CHORUS_MEMORY_GROUP)
        sleeper = sup.start("trainer-solver_lm-0", [sys.executable, "-c", "import time; time.sleep(60)"],
                            128 * 2**20, "memcap-unit")
        rank1 = MemoryGroup(sleeper.memory.path.with_name(sleeper.memory.path.name + "-rank1")).create(128 * 2**20)
        subprocess.run(hog, preexec_fn=rank1.enter, timeout=60)
        sleeper.popen.terminate()
        sleeper.popen.wait(60)
        found = sleeper.out_of_memory()
        assert [who for who, _ in found] == ["rank 1"], found
    finally:
        for c in sup.children.values():
            if c.alive():
                c.popen.kill()
                c.popen.wait()
        sup.remove_groups()
    assert not (Path("/sys/fs/cgroup/memory/chorus") / "memcap-unit").exists()
