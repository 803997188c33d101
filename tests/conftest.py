"""Shared fixtures: uvloop for every async test, a real nats-server per session."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvloop
from hypothesis import settings

from shared.launcher.natsserver import NatsServer

# No test asserts how long something took: Hypothesis's per-example deadline (200 ms) is such an assertion, and a
# busy machine broke it ("Test took 358.43ms, which exceeds the deadline of 200.00ms"). Durations belong in loadtests/.
settings.register_profile("chorus", deadline=None)
settings.load_profile("chorus")

ROOT = Path(__file__).resolve().parents[1]


def pytest_asyncio_loop_factories(config, item):  # noqa: ANN001 - pytest-asyncio hook
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """One real nats-server with JetStream for the whole session, on a free loopback port."""
    srv = NatsServer(tmp_path_factory.mktemp("nats"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture
def run_id() -> str:
    """A fresh run id per test so streams and KV never collide."""
    return "t" + uuid.uuid4().hex[:10]
