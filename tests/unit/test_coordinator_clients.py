"""The coordinator's request clients (services/coordinator/clients.py) against a scripted reply mux, no broker: bad
replies are sent again and counted, a rejected generation is the workflow's error, the attempts are bounded."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import nats.errors
import pytest
import structlog

from services.coordinator import clients
from services.coordinator.clients import MAX_ATTEMPTS, RequestClient
from services.coordinator.workflows import Abandon, Stopping, WorkflowError
from shared.kernel.codec import encode
from shared.kernel.schemas import ActionResult, Array, GenOutput, GenResponse
from shared.kernel.subjects import Names


class Mux:
    """Answers each request with the next scripted reply (bytes, or an exception to raise)."""

    def __init__(self, replies: list[bytes | Exception]) -> None:
        self.replies = replies
        self.subjects: list[str] = []

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        self.subjects.append(subject)
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


class Host:
    def __init__(self) -> None:
        self.nc = SimpleNamespace(is_closed=False, is_draining=False)
        self.names = Names("r")
        self.cfg = SimpleNamespace(models={"m": SimpleNamespace(rollouter=SimpleNamespace(request_timeout_s=5.0))},
                                   balance=SimpleNamespace(dispatch="random"),
                                   actions=SimpleNamespace(timeout_s=1.0, cores=2))
        self.counters: Counter[str] = Counter()
        self.stop_after: Callable[[], bool] = lambda: False
        self.link_settle_s = 0.0

    @property
    def stopping(self) -> bool:
        return self.stop_after()

    def link_dropped_since(self, t0: float) -> bool:
        return False

    async def wait_link(self, settle_s: float) -> None:
        return None


class Tokenizers:
    async def get(self, model: str) -> Any:
        return SimpleNamespace(eos_id=2)


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clients, "backoff", lambda attempt: 0.0)


def client(replies: list[bytes | Exception]) -> tuple[RequestClient, Host, Mux]:
    host, mux = Host(), Mux(replies)
    return RequestClient(host, mux, None, Tokenizers(), structlog.get_logger()), host, mux  # type: ignore[arg-type]


def gen_reply(rows: int, error: str | None = None) -> bytes:
    out = GenOutput(ids=Array.of([5, 6]), logprobs=Array.of([-0.1, -0.2], "float32"), finish="stop")
    return encode(GenResponse(request_id="x", outputs=[out] * rows, version=3, error=error))


async def generate(c: RequestClient, prompts: int = 2) -> Any:
    return await c.generate("m", None, [[1, 4]] * prompts, max_new_tokens=4, temperature=1.0, top_p=1.0)


async def test_bad_generation_replies_are_sent_again_and_counted() -> None:
    c, host, mux = client([b"not msgpack", gen_reply(1), gen_reply(2, error="oom"), gen_reply(2)])
    rows = await generate(c)
    assert [(r.ids, r.version, r.finished) for r in rows] == [([5, 6], 3, True)] * 2
    assert host.counters == Counter(gen_error_replies=3, gen_retries=3, gen_requests=1)
    assert mux.subjects == [Names("r").gen("m")] * 4


async def test_a_rejected_generation_is_the_workflows_error_and_not_sent_again() -> None:
    c, host, mux = client([gen_reply(0, error="rejected: prompt longer than the context")])
    with pytest.raises(WorkflowError, match="the rollouter of m rejected: prompt longer"):
        await generate(c)
    assert host.counters == Counter(gen_rejected=1) and len(mux.subjects) == 1


async def test_generation_gives_up_after_max_attempts_of_bad_replies() -> None:
    c, host, _ = client([gen_reply(1)] * MAX_ATTEMPTS)
    with pytest.raises(Abandon, match="generation for m failed after retries"):
        await generate(c)
    assert host.counters == Counter(gen_error_replies=MAX_ATTEMPTS, gen_retries=MAX_ATTEMPTS)


async def test_a_bad_reply_while_stopping_leaves_the_request() -> None:
    c, host, _ = client([encode(ActionResult(action_id="a", error="sandbox gone"))])
    host.stop_after = lambda: True
    with pytest.raises(Stopping, match="check actions left: the coordinator is stopping"):
        await c.act("check", [{"x": 1}])
    assert host.counters == Counter(act_error_replies=1, act_retries=1)


async def test_actions_retry_bad_replies_and_timeouts_and_mark_the_rows_that_failed() -> None:
    ok = encode(ActionResult(action_id="a", results=[{"score": 1.0}, {"score": 0.0}], errors=[None, "boom"]))
    c, host, mux = client([encode(ActionResult(action_id="a", results=[{}])), nats.errors.TimeoutError(), ok])
    assert await c.act("check", [{"x": 1}, {"x": 2}]) == [{"score": 1.0}, {"score": 0.0, "action_error": "boom"}]
    assert host.counters == Counter(act_error_replies=1, act_retries=2, act_timeouts=1, act_row_errors=1)
    assert mux.subjects == [Names("r").actions_submit()] * 3
