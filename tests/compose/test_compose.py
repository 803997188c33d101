"""docker-compose.yml in a real Docker engine, as docs/deploy.md runs it: `docker compose up --build
--exit-code-from coordinator` on the tiny run to its end; then a detached run whose trainer, rollouter and NATS
containers crash mid-run (their process SIGKILLed from the host), brought back by `restart: on-failure`, with nothing lost; `docker
compose down -v` leaves no container, network or volume. The ledger (tests/faults/ledger.py) watches from the host
as the stack's admin."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time

import pytest

from tests.compose.engine import say
from tests.compose.stack import MODELS, Stack
from tests.faults.ledger import violations

pytestmark = pytest.mark.compose
TINY_VERSIONS = 120  # the shipped tiny run (configs/tiny-chain.yaml), to an end set as a user would: an environment key
KILL_VERSIONS = 120
KILLS = (("trainer-solver-lm", 20), ("rollouter-verifier-lm", 45), ("nats", 70))


def _books(reports, max_versions: int) -> str:
    return "; ".join(f"{m}: {r.published} published, {r.stored} stored, {r.trained} trained, "
                     f"{sum(r.dropped.values())} dropped" for m, r in reports.items())


def test_the_image_builds_and_imports_every_dependency(built: float) -> None:
    # first, on its own (`make compose-build`: CI builds the image while other targets run); the runs below reuse it
    assert built >= 0


@pytest.mark.parametrize("stack", [{"CHORUS_TRAIN__MAX_VERSIONS": str(TINY_VERSIONS)}], indirect=True,
                         ids=[f"{TINY_VERSIONS}-versions"])
async def test_compose_up_runs_the_tiny_run_to_the_end_and_down_leaves_nothing(stack: Stack) -> None:
    t0 = time.monotonic()
    up = stack.popen("up", "--build", "--exit-code-from", "coordinator", log=stack.work / "up.log")
    try:
        run_id, ledger = await stack.attach(up=up, log=stack.work / "up.log")
        await stack.wait_trained(ledger, 1, 900, "a first version", up)
        first_step = round(time.monotonic() - t0, 1)
        code = await stack.wait_exit(up, 1800, "docker compose up's exit")
        up_s = round(time.monotonic() - t0, 1)
        assert code == 0, (stack.work / "up.log").read_text()[-6000:]
        # stopped with the stack, the books are read from its store: `docker start` of its container alone
        # (`docker compose start nats` would run the credentials one-shot again, with new passwords)
        subprocess.run(["docker", "start", stack.container("nats")], check=True, capture_output=True, timeout=60)
        await ledger.close()  # a fresh connection to it (what the ledger saw published is kept)
        await stack.reattach(ledger)
        trained = await stack.wait_trained(ledger, TINY_VERSIONS, 120, "the books")
        reports = await ledger.report()
        await ledger.close()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert trained == dict.fromkeys(MODELS, TINY_VERSIONS), trained
    problems = violations(reports, TINY_VERSIONS)
    assert not problems, problems
    logs = stack.logs("coordinator", "actions")
    assert "code actions run in Linux namespaces" in logs  # the sandbox works in its container
    assert "WITHOUT namespace isolation" not in logs
    abandoned = re.findall(r"got no answer after \d+ attempt", logs)
    assert not abandoned, f"{len(abandoned)} tasks abandoned while the models loaded"
    down_s = stack.down()
    assert stack.leftovers() == {"containers": [], "networks": [], "volumes": []}
    say(f"up --build --exit-code-from coordinator: run {run_id}, first step +{first_step}s, exit 0 after {up_s}s, "
        f"down -v {down_s}s; {_books(reports, TINY_VERSIONS)}")


@pytest.mark.parametrize("stack", [{"CHORUS_TRAIN__MAX_VERSIONS": str(KILL_VERSIONS)}], indirect=True,
                         ids=[f"{KILL_VERSIONS}-versions"])
async def test_killed_containers_come_back_and_the_run_loses_nothing(stack: Stack) -> None:
    t0 = time.monotonic()
    stack.run("up", "-d", timeout=stack.left(900, "docker compose up -d"))
    run_id, ledger = await stack.attach()
    killed = []
    try:
        for service, at in KILLS:
            landed = await stack.wait_trained(ledger, at, 900, f"v{at} before killing {service}")
            state = stack.inspect(service)
            restarts = state["RestartCount"]
            # A crash: the container's process SIGKILLed from the host, as the OOM killer or a failing node would.
            # (`docker kill` is a stop by hand to Docker: its restart policy leaves such a container stopped.)
            os.kill(state["State"]["Pid"], signal.SIGKILL)
            t_kill = time.monotonic()
            deadline = time.monotonic() + 120
            while True:  # restart: on-failure brings it back
                state = stack.inspect(service)
                if state["RestartCount"] > restarts and state["State"]["Running"]:
                    break
                assert time.monotonic() < deadline, f"{service} did not come back: {state['State']}"
                await asyncio.sleep(0.5)
            back = round(time.monotonic() - t_kill, 1)
            # every model trained on after it (the one behind, which may be far behind the other, included), or ended
            moved = await stack.wait_trained(ledger, min(min(landed.values()) + 5, KILL_VERSIONS), 900,
                                             f"training after {service}")
            killed.append((service, landed, back, moved))
            say(f"SIGKILL of {service}'s process at {landed}: running again after {back}s, training went on to {moved}")
        r = await stack.run_async("wait", "coordinator", want=1800, what="the coordinator's exit")
        # the coordinator's exit code: compose's own, and in its words
        assert r.returncode == 0 and re.search(r"(status code |^)0$", r.stdout.strip()), (r.stdout, r.stderr)
        trained = await stack.wait_trained(ledger, KILL_VERSIONS, 120, "the books")
        reports = await ledger.report()
    finally:
        await ledger.close()
    assert trained == dict.fromkeys(MODELS, KILL_VERSIONS), trained
    problems = violations(reports, KILL_VERSIONS)
    assert not problems, problems
    assert [k[0] for k in killed] == [k[0] for k in KILLS]
    down_s = stack.down()
    assert stack.leftovers() == {"containers": [], "networks": [], "volumes": []}
    say(f"three kills, run {run_id} done after {time.monotonic() - t0:.0f}s, down -v {down_s}s; "
        f"{_books(reports, KILL_VERSIONS)}")
