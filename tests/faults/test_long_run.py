"""A long run at high concurrency keeps training and holds a flat number of JetStream consumers.

Every weight sync used to leave a KV-watch consumer behind for minutes; at 1000 consumers nats-server refuses
new ones and every sync fails. ``make test-long`` (in CI beside ``make test``) runs one minute of it, ``make faults``
one and five.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.kernel.bus import kv_get_int, run_consumers
from shared.kernel.subjects import Names
from tests.conftest import ROOT
from tests.e2e.cluster import Cluster
from tests.faults.harness import MODELS, Broker, fault_config
from tests.waits import connect

SAMPLE_S = 3.0
START_S = 300.0  # the most start-up may take (every model trained once) on a busy machine


@pytest.mark.parametrize("minutes", [pytest.param(1.0, id="1min", marks=pytest.mark.full),
                                     pytest.param(5.0, id="5min", marks=pytest.mark.full)])
async def test_the_tiny_run_at_concurrency_64_keeps_training_with_a_flat_consumer_count(minutes, tmp_path, run_id):
    broker = Broker.single(tmp_path / "nats")
    config = fault_config(tmp_path, run_id, max_versions=10_000_000, concurrency=64)
    cluster = Cluster(config, broker.url, tmp_path / "logs")
    names = Names(run_id)
    nc = await connect(broker.url)
    samples: list[tuple[float, dict[str, int], int]] = []  # (seconds of training, trained per model, consumers)
    try:
        cluster.start_all(MODELS)
        js = nc.jetstream()

        async def trained() -> dict[str, int]:
            try:
                kv = await js.key_value(names.kv_bucket)
            except Exception:  # noqa: BLE001 - the services create it on start
                return dict.fromkeys(MODELS, 0)
            return {m: await kv_get_int(kv, Names.trained_key(m)) for m in MODELS}

        # The minutes count from the first version of every model: start-up (imports, model loads, the first
        # batch) takes what the machine gives it.
        deadline = time.monotonic() + START_S
        while min((await trained()).values()) < 1:
            assert not cluster.dead(), f"a service died\n{cluster.logs()}"
            assert time.monotonic() < deadline, f"no version of every model within {START_S:.0f}s\n{cluster.logs()}"
            await asyncio.sleep(0.5)
        t0 = time.monotonic()
        while time.monotonic() - t0 < minutes * 60:
            await asyncio.sleep(SAMPLE_S)
            assert not cluster.dead(), f"a service died\n{cluster.logs()}"
            now = await trained()
            consumers = sum((await run_consumers(js, names, MODELS)).values())
            samples.append((time.monotonic() - t0, now, consumers))
    finally:
        codes = await cluster.stop_all()
        await nc.close()
        broker.stop()
    lines = ["seconds  " + "  ".join(MODELS) + "  consumers"]
    lines += [f"{t:7.0f}  " + "  ".join(f"{trained[m]:>{len(m)}}" for m in MODELS) + f"  {consumers:9}"
              for t, trained, consumers in samples]
    print("\n" + "\n".join(lines))
    out = ROOT / "runs" / "faults"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"long-run-{minutes:g}min.txt").write_text("\n".join(lines) + "\n")
    assert all(c == 0 for c in codes.values()), codes

    # Keeps training: every fifth of the run adds versions.
    fifth = minutes * 60 / 5
    for k in range(5):
        window = [s for s in samples if k * fifth <= s[0] <= (k + 1) * fifth]
        assert len(window) >= 2, samples
        for m in MODELS:
            assert window[-1][1][m] > window[0][1][m], (m, k, window)
    # Flat consumers: two per model (mq and trainer) and a read in flight at most, never a growing pile.
    warm = [c for _, _, c in samples]
    assert warm and max(warm) <= 2 * len(MODELS) + 2, warm
    assert warm[-1] <= warm[0] + 2, warm
    assert min(samples[-1][1].values()) > 50, samples[-1]
