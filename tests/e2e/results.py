"""Checks that a finished run's results are usable: its TensorBoard event files, `chorus export-prometheus`
scraped over HTTP, and `chorus export` loaded back with plain transformers / peft."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from tests.e2e.conftest import CHORUS

SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')
LABEL = re.compile(r'^(?P<k>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<v>(?:[^"\\]|\\.)*)"$')


def parse_exposition(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Strictly parse the text exposition format: prometheus_client's parser must accept it, and every sample
    line follows the HELP and TYPE lines of its metric. Samples by (name, labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name for f in text_string_to_metric_families(text)}
    assert families, text[:500]
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    helped: set[str] = set()
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helped.add(line.split(" ")[2])
        elif line.startswith("# TYPE "):
            typed.add(line.split(" ")[2])
        else:
            m = SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            assert m["name"] in helped and m["name"] in typed, f"no HELP/TYPE before {line!r}"
            labels = frozenset((lm["k"], lm["v"]) for lm in (LABEL.match(p) for p in
                                                             (m["labels"] or "").split(",") if p) if lm)
            out[(m["name"], labels)] = float(m["value"])
    return out


@contextlib.asynccontextmanager
async def prometheus_exporter(nats_url: str) -> AsyncIterator[Callable[[], Awaitable[str]]]:
    """`chorus export-prometheus --all-runs` on a free port; yields a scrape function (GET /metrics). On the way
    out it is stopped with SIGTERM and must exit 0 within 10 s."""
    proc = await asyncio.create_subprocess_exec(
        CHORUS, "export-prometheus", "--nats", nats_url, "--all-runs", "--port", "0",
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "400"})
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    m = re.search(r"on (http://\S+/metrics)", line)
    assert m, f"export-prometheus did not say where it serves: {line!r}"
    url = m.group(1)

    def get() -> str:
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            return resp.read().decode()

    async def scrape() -> str:
        return await asyncio.to_thread(get)

    try:
        yield scrape
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(proc.wait(), 60)
            rest = (await proc.stdout.read()).decode(errors="replace")
            assert code == 0, rest[-2000:]


def assert_served(samples: dict[tuple[str, frozenset[tuple[str, str]]], float],
                  last: dict[str, dict[str, Any]]) -> int:
    """Every numeric field of the last metrics message of every instance is served with its value; the count."""
    from shared.results.promexport import metric_name
    from shared.results.tracking import scalars

    checked = 0
    for payload in last.values():
        labels = frozenset({"run": payload["run"], "service": payload["service"], "model": payload["model"] or "",
                            "instance": payload["instance"]}.items())
        for path, value in scalars({k: v for k, v in payload.items()
                                    if k not in ("run", "service", "model", "instance")}, sep=".").items():
            key = (metric_name(path), labels)
            assert key in samples, f"{key} not served"
            assert samples[key] == value or abs(samples[key] - value) <= 1e-9 * abs(value), (key, samples[key], value)
            checked += 1
    return checked


def assert_tensorboard_matches_metrics(run_dir: Path, models: list[str]) -> int:
    """Each model's event files under tensorboard/<model>/ hold, at step = version, every numeric field of each of
    its metrics.jsonl step records (``eval``: the evaluation records, in tensorboard/eval/); the number of values
    compared."""
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from shared.results.tracking import scalars

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    checked = 0
    for m in models:
        acc = EventAccumulator(str(run_dir / "tensorboard" / m), size_guidance={"scalars": 0})
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        steps = [r for r in records if (r.get("kind") == "eval" if m == "eval" else
                                        r.get("model") == m and "kind" not in r)]
        assert steps, f"no {m} record in metrics.jsonl"
        expected = {}
        for r in steps:
            for tag, value in scalars(r).items():
                expected[(tag, r["version"])] = value
        got = {(tag, e.step): e.value for tag in tags for e in acc.Scalars(tag)}
        assert {t for t, _ in expected} == tags, (sorted(tags ^ {t for t, _ in expected}))
        for key, value in expected.items():
            assert key in got, f"{m}: {key} not in the event files"
            assert got[key] == np.float32(value), (m, key, got[key], value)  # TensorBoard keeps float32
            checked += 1
    return checked


def export(run_dir: Path, model: str, out: Path) -> str:
    """`chorus export RUN_DIR --model M --out OUT`; its output. In this process (a `chorus` process would spend
    seconds importing torch, transformers and peft again)."""
    from typer.testing import CliRunner

    from shared.launcher.cli import app

    done = CliRunner().invoke(app, ["export", str(run_dir), "--model", model, "--out", str(out)],
                              env={"COLUMNS": "400"})
    assert done.exit_code == 0, done.output
    return done.output


def assert_exports_load_with_chorus_logits(run_dir: Path, tmp_path: Path, lora_model: str, adapter: str,
                                           full_model: str) -> None:
    """The final checkpoints of both models, exported and loaded with transformers (and peft for the adapter),
    give the logits of Chorus's own learner restored from the same checkpoint."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from services.trainer.learner import Learner
    from shared.kernel.config import load_config
    from shared.models.tokenizer import ByteTokenizer

    cfg = load_config(run_dir / "config.yaml")
    ids = torch.tensor([ByteTokenizer().encode("1+2=3"), ByteTokenizer().encode("3+3=6")])

    out = tmp_path / "export-lora"
    text = export(run_dir, lora_model, out)
    assert f"adapter {adapter}" in text, text
    assert "byte tokenizer" in (out / "README.md").read_text()  # the tiny model has no HF tokenizer: said so
    ours = Learner(cfg, lora_model)
    assert ours.restore_latest(run_dir / "checkpoints" / lora_model) is not None
    assert ours.version == cfg.train.max_versions
    ours.net.eval()
    with torch.no_grad():
        chorus = ours.net(input_ids=ids, adapter_names=[adapter] * len(ids)).logits
        base = AutoModelForCausalLM.from_pretrained(out / "base").eval()
        plain_base = base(input_ids=ids).logits
        agent = PeftModel.from_pretrained(base, out / "adapters" / adapter).eval()
        theirs = agent(input_ids=ids).logits
    torch.testing.assert_close(theirs, chorus)
    assert (chorus - plain_base).abs().max() > 1e-4, "the trained adapter changes nothing: was it exported?"

    out = tmp_path / "export-full"
    export(run_dir, full_model, out)
    ours = Learner(cfg, full_model)
    assert ours.restore_latest(run_dir / "checkpoints" / full_model) is not None
    ours.net.eval()
    with torch.no_grad():
        chorus = ours.net(input_ids=ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
    torch.testing.assert_close(theirs, chorus)
