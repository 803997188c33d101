import asyncio
import json

from shared.kernel.config import load_config
from shared.kernel.service import Service
from tests.waits import wait_until


class Echo(Service):
    name = "echo"

    async def setup(self) -> None:
        async def handler(msg):
            await msg.respond(msg.data)

        await self.nc.subscribe(self.names.control("echo", "x"), cb=handler)


async def test_service_base_answers_status_and_publishes_metrics(nats_url, run_id, tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(f"run: {{id: {run_id}}}\nmodels: {{a: {{}}}}\nagents: {{solver: {{model: a}}, verifier: {{model: a}}}}\nmetrics_interval_s: 0.1\n")
    cfg = load_config(p)
    svc = Echo(cfg, nats_url=nats_url)
    task = asyncio.create_task(svc.serve())
    await wait_until(lambda: getattr(svc, "ready", False), "the service started")
    sub = await svc.nc.subscribe(svc.names.metrics("echo", "0"))
    msg = await sub.next_msg(timeout=2)
    assert json.loads(msg.data)["service"] == "echo"
    r = await svc.nc.request(svc.names.control("echo", "x"), b"hi", timeout=2)
    assert r.data == b"hi"
    r = await svc.nc.request("$SRV.PING.chorus-echo", b"", timeout=2)
    assert json.loads(r.data)["name"] == "chorus-echo"
    svc.stop()
    assert await asyncio.wait_for(task, 20) == 0


def _config(tmp_path, run_id, grace_s: float):
    p = tmp_path / "c.yaml"
    p.write_text(f"run: {{id: {run_id}, stop_grace_s: {grace_s}}}\nmodels: {{a: {{}}}}\n"
                 "agents: {solver: {model: a}, verifier: {model: a}}\n")
    return load_config(p)


async def test_python_311s_wait_for_can_swallow_a_cancellation():
    # Why a service's stop cancels its tasks more than once: when the awaited future completes in the same loop
    # iteration as the cancel, asyncio.wait_for (Python 3.11) returns its result and the cancellation is lost.
    loop = asyncio.get_running_loop()
    went_on = asyncio.Event()

    async def body():
        fut = loop.create_future()
        loop.call_soon(lambda: (fut.set_result(1), task.cancel()))
        await asyncio.wait_for(fut, 10)
        went_on.set()  # the cancel was swallowed: the task goes on with its loop
        await asyncio.sleep(3600)

    task = asyncio.create_task(body())
    await wait_until(went_on.is_set, "the task going on after its cancel")
    assert not task.done()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class Swallower(Service):
    """A loop that swallows its first cancellation, as a wait_for racing a reply does (the paramsync that once
    never stopped: its sync loop was back at its wake-up wait, 'cancelling' for ever)."""

    name = "swallower"

    async def setup(self) -> None:
        self.swallowed = 0
        self.spawn(self._loop(), "loop")

    async def _loop(self) -> None:
        wake = asyncio.Event()
        while True:
            try:
                await wake.wait()
            except asyncio.CancelledError:
                self.swallowed += 1
                if self.swallowed > 1:
                    raise


async def test_a_task_that_swallows_its_cancellation_does_not_keep_the_service_from_stopping(
        nats_url, run_id, tmp_path):
    svc = Swallower(_config(tmp_path, run_id, 5.0), nats_url=nats_url)
    task = asyncio.create_task(svc.serve())
    await wait_until(lambda: getattr(svc, "ready", False), "the service started")
    svc.stop()
    assert await asyncio.wait_for(task, 10) == 0  # within its 5 s grace (and the test's slack)
    assert svc.swallowed == 2


class Stuck(Service):
    """A teardown that never ends (a peer that never answers, a lock never released)."""

    name = "stuck"

    async def teardown(self) -> None:
        await asyncio.Event().wait()


async def test_a_teardown_that_never_ends_is_cut_at_the_stop_grace(nats_url, run_id, tmp_path):
    svc = Stuck(_config(tmp_path, run_id, 3.0), nats_url=nats_url)
    task = asyncio.create_task(svc.serve())
    await wait_until(lambda: getattr(svc, "ready", False), "the service started")
    svc.stop()
    assert await asyncio.wait_for(task, 10) == 0  # within its 3 s grace (and the test's slack)
    assert svc.counters["teardowns_cut"] == 1
