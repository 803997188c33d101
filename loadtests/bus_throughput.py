"""The bus patterns Chorus relies on, measured side by side in one run against a real nats-server.

    python loadtests/bus_throughput.py [--samples 3000]

Publishes real encoded ``Sample`` messages to a JetStream stream twice (one awaited ack per publish, as a
naive producer would, and ``publish_async`` with the acks gathered per batch, as the coordinator does) and
consumes them twice (``fetch(1)`` with one ack each, and ``fetch(256)`` with the acks sent together, as mq
does). Prints messages per second and the ratio of each pair; the ratios are what to compare across
machines, absolute rates depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable

import nats
import numpy as np
from nats.js import api as jsapi

from shared.kernel.bus import ensure_stream, fetch, pull_consumer
from shared.kernel.codec import encode
from shared.kernel.schemas import Array, Sample
from shared.launcher.natsserver import NatsServer

BATCH = 256


def sample(i: int, rng: np.random.Generator) -> bytes:
    """A sample of about 2 KB: 64 prompt tokens, 256 response tokens and their log-probs."""
    return encode(Sample(
        run="bench", episode=f"e{i}", sample_id=f"s{i}", env_idx=i, rollout_idx=0, agent="solver", model="m",
        turn=0, prompt_ids=Array.of(rng.integers(0, 256, 64).tolist(), "int32"),
        response_ids=Array.of(rng.integers(0, 256, 256).tolist(), "int32"),
        behavior_logprobs=Array.of((-rng.random(256)).tolist(), "float32"), reward=0.5,
        group_key=f"g{i // 8}", group_size=8, version=0,
    ))


async def timed(fn: Callable[[], Awaitable[int]]) -> float:
    t0 = time.perf_counter()
    n = await fn()
    return n / (time.perf_counter() - t0)


async def main(samples: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    payloads = [sample(i, rng) for i in range(samples)]
    with tempfile.TemporaryDirectory() as store, NatsServer(store) as server:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        rates: dict[str, float] = {}
        for name in ("one", "batched"):
            await ensure_stream(js, jsapi.StreamConfig(name=f"BENCH_{name.upper()}", subjects=[f"bench.{name}"]))

        async def publish_one() -> int:
            for i, data in enumerate(payloads):
                await js.publish("bench.one", data, headers={"Nats-Msg-Id": f"s{i}"})
            return len(payloads)

        async def publish_batched() -> int:
            for start in range(0, len(payloads), BATCH):
                futs = [await js.publish_async("bench.batched", data, headers={"Nats-Msg-Id": f"s{start + j}"})
                        for j, data in enumerate(payloads[start:start + BATCH])]
                await asyncio.gather(*futs)
            return len(payloads)

        async def consume(subject: str, stream: str, batch: int) -> int:
            sub = await pull_consumer(js, stream=stream, subject=subject, durable=f"c_{stream}_{batch}",
                                      ack_wait_s=30, max_ack_pending=4 * BATCH)
            got = 0
            while got < len(payloads):
                msgs = await fetch(sub, batch, timeout_s=1.0)
                if not msgs:
                    raise RuntimeError(f"{subject}: only {got} of {len(payloads)} messages arrived")
                if batch == 1:
                    for m in msgs:
                        await m.ack()
                else:
                    await asyncio.gather(*(m.ack() for m in msgs))
                got += len(msgs)
            await sub.unsubscribe()
            return got

        rates["publish, await each ack"] = await timed(publish_one)
        rates["publish_async, gather acks per 256"] = await timed(publish_batched)
        rates["fetch(1), ack each"] = await timed(lambda: consume("bench.one", "BENCH_ONE", 1))
        rates[f"fetch({BATCH}), acks together"] = await timed(lambda: consume("bench.batched", "BENCH_BATCHED", BATCH))
        await nc.close()
    return rates


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=3000)
    args = parser.parse_args()
    rates = asyncio.run(main(args.samples))
    for name, rate in rates.items():
        print(f"{name:40s} {rate:10.0f} msg/s")
    names = list(rates)
    print(f"publish ratio (batched / one-by-one): {rates[names[1]] / rates[names[0]]:.1f}x")
    print(f"consume ratio (fetch {BATCH} / fetch 1):   {rates[names[3]] / rates[names[2]]:.1f}x")
