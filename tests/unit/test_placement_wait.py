"""Creating a run's streams and buckets on a cluster still forming: JetStream's "no suitable peers for placement"
is waited out (the meta leader learns its servers a moment after it is elected); any other refusal is not."""

from __future__ import annotations

import pytest
from nats.js.errors import BadRequestError

from shared.kernel import bus


async def test_no_peers_for_placement_is_retried_until_the_cluster_has_formed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bus.asyncio, "sleep", _no_sleep)
    calls = []

    async def create() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise BadRequestError(code=400, err_code=bus.NO_PEERS, description="no suitable peers for placement")
        return "created"

    assert await bus._placed(create) == "created"
    assert len(calls) == 3


async def test_another_bad_request_is_raised_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bus.asyncio, "sleep", _no_sleep)
    calls = []

    async def create() -> str:
        calls.append(1)
        raise BadRequestError(code=400, err_code=10058, description="stream name already in use")

    with pytest.raises(BadRequestError):
        await bus._placed(create)
    assert len(calls) == 1


async def test_a_cluster_that_never_forms_fails_after_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bus.asyncio, "sleep", _no_sleep)
    monkeypatch.setattr(bus, "PLACEMENT_WAIT_S", 0.0)

    async def create() -> str:
        raise BadRequestError(code=400, err_code=bus.NO_PEERS, description="no suitable peers for placement")

    with pytest.raises(BadRequestError):
        await bus._placed(create)


async def _no_sleep(_: float) -> None:
    return None
