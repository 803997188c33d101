"""The actions service over a real nats-server: batches, errors, timeouts, malformed requests, run_code."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgpack
import nats
import pytest

from services.actions.service import ActionsService
from shared.kernel.codec import decode, encode
from shared.kernel.config import load_config
from shared.kernel.schemas import ActionRequest, ActionResult
from tests.waits import wait_until


@pytest.fixture
async def actions(nats_url: str, run_id: str, tmp_path) -> AsyncIterator[ActionsService]:
    p = tmp_path / "c.yaml"
    p.write_text(
        f"run: {{id: {run_id}, dir: {tmp_path}}}\nmodels: {{a: {{}}}}\n"
        "agents: {solver: {model: a}, verifier: {model: a}}\n"
        # a cap a busy machine does not reach with the actions that are meant to finish
        "actions: {cores: 2, timeout_s: 5.0, memory_mb: 256}\nmetrics_interval_s: 0.2\n"
    )
    svc = ActionsService(load_config(p), nats_url=nats_url)
    task = asyncio.create_task(svc.serve())
    await wait_until(lambda: getattr(svc, "_sub", None) is not None or task.done(), "the actions service started")
    assert getattr(svc, "_sub", None) is not None, "actions service did not start"
    yield svc
    svc.stop()
    assert await asyncio.wait_for(task, 30) == 0


async def ask(nc: nats.NATS, svc: ActionsService, req: ActionRequest | bytes, timeout: float = 60) -> ActionResult:
    data = req if isinstance(req, bytes) else encode(req)
    msg = await nc.request(svc.names.actions_submit(), data, timeout=timeout)
    return decode(ActionResult, msg.data)


async def test_check_answer_batch_is_scored_per_payload(actions: ActionsService, nats_url: str):
    nc = await nats.connect(nats_url)
    try:
        payloads = [
            {"expected": "7", "response": "7", "finished": True},
            {"expected": "7", "response": "8x", "finished": False, "partial_credit": True},
            {"expected": "7", "response": "3", "finished": True, "partial_credit": True},
            {"expected": "7", "response": "?", "finished": True, "partial_credit": True},
        ]
        res = await ask(nc, actions, ActionRequest(action_id="a1", kind="check_answer", payloads=payloads))
        assert res.action_id == "a1" and res.error is None
        assert [r["reward"] for r in res.results] == pytest.approx([1.0, 0.45, 0.3, 0.0])
        assert [r["correct"] for r in res.results] == [True, False, False, False]
        assert res.errors == [None] * 4
    finally:
        await nc.close()


async def test_slow_and_crashing_actions_fail_alone_and_the_service_keeps_serving(
    actions: ActionsService, nats_url: str
):
    nc = await nats.connect(nats_url)
    try:
        req = ActionRequest(action_id="a2", kind="echo", timeout_s=2.0,
                            payloads=[{"sleep_s": 30}, {"exit_code": 1}, {"raise": "bad input"}, {"v": 1}])
        res = await ask(nc, actions, req)
        assert res.errors[0] == "timeout after 2s"
        assert res.errors[1] is not None and "exited with code 1" in res.errors[1]
        assert res.errors[2] == "RuntimeError: bad input"
        assert res.errors[3] is None and res.results[3] == {"v": 1}
        # The service-level cap (actions.timeout_s = 5.0) wins over a longer request timeout.
        capped = await ask(nc, actions, ActionRequest(action_id="a3", kind="echo", timeout_s=60,
                                                      payloads=[{"sleep_s": 30}]))
        assert capped.errors == ["timeout after 5s"]
        ok = await ask(nc, actions, ActionRequest(action_id="a4", kind="echo", payloads=[{"i": i} for i in range(6)]))
        assert ok.results == [{"i": i} for i in range(6)]
        assert actions.counters["action_timeouts"] == 2
        assert actions.pool.counters["restarts"] == 3
    finally:
        await nc.close()


async def test_malformed_and_unknown_requests_go_to_the_dlq_with_an_error_reply(
    actions: ActionsService, nats_url: str
):
    nc = await nats.connect(nats_url)
    try:
        dlq = await nc.subscribe(actions.names.dlq("actions"))
        res = await ask(nc, actions, b"\xc1not msgpack")
        assert res.error is not None and "malformed ActionRequest" in res.error
        entry = await dlq.next_msg(timeout=2)
        assert entry.data == b"\xc1not msgpack" and "not msgpack" in entry.headers["Chorus-Reason"]

        res = await ask(nc, actions, msgpack.packb({"schema": 1, "action_id": "x"}))
        assert res.error is not None and "kind" in res.error
        await dlq.next_msg(timeout=2)

        res = await ask(nc, actions, ActionRequest(action_id="u1", kind="rm_rf", payloads=[{}]))
        assert res.action_id == "u1" and res.error is not None and "unknown action kind 'rm_rf'" in res.error
        assert "rm_rf" in (await dlq.next_msg(timeout=2)).headers["Chorus-Reason"]
        assert actions.counters["rejected"] == 3
        ok = await ask(nc, actions, ActionRequest(action_id="e", kind="echo", payloads=[{"still": "up"}]))
        assert ok.results == [{"still": "up"}]
    finally:
        await nc.close()


async def test_requests_are_served_concurrently_up_to_the_core_budget(actions: ActionsService, nats_url: str):
    nc = await nats.connect(nats_url)
    seen: list[tuple[int, int]] = []  # (running, waiting) as the pool had them, sampled while the requests run

    async def sample() -> None:
        while True:
            seen.append((actions.pool.busy, actions.pool.queued))
            await asyncio.sleep(0.01)

    sampler = asyncio.create_task(sample())
    try:
        reqs = [ActionRequest(action_id=f"c{i}", kind="echo", payloads=[{"sleep_s": 1.0}]) for i in range(4)]
        results = await asyncio.gather(*(ask(nc, actions, r) for r in reqs))
        assert all(r.errors == [None] for r in results)
        # 4 actions on 2 cores: two ran side by side while the other two waited; never more than two at once.
        assert max(busy for busy, _ in seen) == 2 and (2, 2) in seen, sorted(set(seen))
    finally:
        sampler.cancel()
        await nc.close()


async def test_run_code_survives_loops_and_memory_bombs_and_keeps_serving(actions: ActionsService, nats_url: str):
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 5) == 15\n"
    nc = await nats.connect(nats_url)
    try:
        req = ActionRequest(action_id="code1", kind="run_code", timeout_s=30, payloads=[
            {"code": "def add(a, b):\n    while True:\n        pass\n", "tests": tests},
            {"code": "blob = bytearray(10**10)\n", "tests": tests},
            {"code": "hog = []\nwhile True:\n    hog.append(' ' * 10**6)\n", "tests": tests},
            {"code": "def add(a, b):\n    return a + b\n", "tests": tests},
            {"code": "def add(a, b):\n    return abs(a) + b\n", "tests": tests},
        ])
        res = await ask(nc, actions, req, timeout=120)
        assert res.error is None and res.errors == [None] * 5
        loop_r, bomb, hog, good, wrong = res.results
        # the loop is stopped within the service's 5 s cap (the limit it names), not at the request's 30 s
        assert loop_r["passed"] is False and loop_r["reward"] == 0.0
        assert loop_r["error"].startswith("timeout after ") and float(loop_r["error"][14:-1]) <= 5.0, loop_r
        assert bomb["passed"] is False and bomb["error"] == "MemoryError" and bomb["tests_passed"] == 0
        assert hog["passed"] is False and hog["error"] == "MemoryError"
        assert good == {"passed": True, "tests_passed": 3, "tests_total": 3, "reward": 1.0, "error": None,
                        "stdout": ""}
        assert wrong["passed"] is False and wrong["tests_passed"] == 2 and wrong["reward"] == pytest.approx(2 / 3)
        # The workers were never at risk: nothing was restarted, and the service answers at once.
        assert actions.pool.counters["restarts"] == 0
        assert actions.counters["result_errors"] == 4 and actions.counters["action_errors"] == 0
        more = await ask(nc, actions, ActionRequest(action_id="code2", kind="run_code", payloads=[
            {"code": "def add(a, b):\n    return b + a\n", "tests": tests},
            {"code": "import os\nos._exit(0)\n", "tests": tests},
        ]))
        assert more.results[0]["passed"] is True
        assert more.results[1]["error"] == "the code's process exited with status 0"
        math = await ask(nc, actions, ActionRequest(action_id="m1", kind="check_math", payloads=[
            {"expected": "72", "response": "She sold 48 + 24 clips.\n#### 72"},
            {"expected": "0.5", "response": "The answer is \\boxed{\\frac{1}{3}}"},
        ]))
        assert [r["correct"] for r in math.results] == [True, False]
    finally:
        await nc.close()


async def test_a_streamed_batch_answers_each_action_as_soon_as_it_ends(actions: ActionsService, nats_url: str):
    """One request with a slow and a fast action: the fast one's answer arrives first, not with the slow one."""
    nc = await nats.connect(nats_url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, max_msgs=2)
        req = ActionRequest(action_id="st", kind="cpu_affinity", payloads=[{"spin_s": 0.8}, {"spin_s": 0.0}],
                            timeout_s=5, stream=True)
        await nc.publish(actions.names.actions_submit(), encode(req), reply=inbox)
        got = []
        for _ in range(2):
            msg = await sub.next_msg(timeout=60)
            res = decode(ActionResult, msg.data)
            got.append((res.index, res))
        assert [i for i, _ in got] == [1, 0]  # the fast action (index 1) answered first
        for _, res in got:
            assert res.action_id == "st" and res.errors == [None] and "cpus" in res.results[0], res
    finally:
        await nc.close()


@pytest.mark.parametrize("setting", ["namespaces", "best_effort"])
async def test_a_run_that_asks_for_isolation_does_not_start_without_it(nats_url, run_id, tmp_path, monkeypatch,
                                                                       setting):
    # As inside a container with Docker's default seccomp profile: unshare is not permitted.
    import services.actions.service as actions_service
    from shared.kernel.service import EX_RUN_FAILED

    monkeypatch.setattr(actions_service, "isolation", lambda: ("none", "unshare: Operation not permitted"))
    p = tmp_path / "c.yaml"
    p.write_text(f"run: {{id: {run_id}, dir: {tmp_path}}}\nmodels: {{a: {{}}}}\n"
                 f"agents: {{solver: {{model: a}}, verifier: {{model: a}}}}\nactions: {{isolation: {setting}}}\n")
    svc = ActionsService(load_config(p), nats_url=nats_url)
    task = asyncio.create_task(svc.serve())
    if setting == "namespaces":  # the default: the service refuses to start, and the run stops (exit 78)
        assert await asyncio.wait_for(task, 60) == EX_RUN_FAILED
        assert getattr(svc, "_sub", None) is None
        return
    await wait_until(lambda: getattr(svc, "_sub", None) is not None or task.done(), "the actions service started")
    assert svc.metrics_snapshot()["isolation"] == "none"
    svc.stop()
    assert await asyncio.wait_for(task, 30) == 0
