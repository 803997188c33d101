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
    await wait_until(lambda: getattr(svc, "_micro", None) is not None, "the service started")
    sub = await svc.nc.subscribe(svc.names.metrics("echo", "0"))
    msg = await sub.next_msg(timeout=2)
    assert json.loads(msg.data)["service"] == "echo"
    r = await svc.nc.request(svc.names.control("echo", "x"), b"hi", timeout=2)
    assert r.data == b"hi"
    r = await svc.nc.request("$SRV.PING.chorus-echo", b"", timeout=2)
    assert json.loads(r.data)["name"] == "chorus-echo"
    svc.stop()
    assert await asyncio.wait_for(task, 20) == 0
