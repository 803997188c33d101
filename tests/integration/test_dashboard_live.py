"""The dashboard's badge over a real nats-server: live while the run runs, finished once `chorus up` wrote the
run's summary, even though the server is still there."""

from __future__ import annotations

import asyncio

import yaml

from shared.kernel.config import ChorusConfig
from shared.launcher.dashboard import DashState, Feed, follow_bus
from tests.waits import wait_until


async def test_a_finished_run_is_not_shown_live_while_its_server_stays_up(nats_url: str) -> None:
    cfg = ChorusConfig(**yaml.safe_load("run: {id: dash}\nmodels: {m: {}}\nagents: {solver: {model: m}, "
                                        "verifier: {model: m}}\n"))
    feed = Feed(DashState(models=["m"], agents={"solver": "m", "verifier": "m"}, max_versions=10, run="dash"))
    ended = asyncio.Event()
    stop = asyncio.Event()
    task = asyncio.create_task(follow_bus(feed, cfg, nats_url, stop, ended=ended.is_set))
    try:
        await wait_until(lambda: feed.state.live == "live", "live")
        ended.set()  # summary.json written: the run is over, its server is not
        await wait_until(lambda: feed.state.live == "finished", "finished")
        assert any(u == {"t": "live", "live": "finished"} for u in feed.pending)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
