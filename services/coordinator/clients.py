"""The coordinator's request clients: generation (to the rollouters), actions and the critic's values.

Two retry loops, one per layer. :meth:`RequestClient.request` sends one request until some instance answers
(timeouts, dead instances, refusals; nobody subscribed and this side's own connection down are waited out, not
counted as attempts). :meth:`RequestClient._replied` sends a generation or action request again while the answer is
an error or malformed: each request is idempotent. Counters are named ``<what>_...`` with ``what`` = ``gen``,
``act`` or ``critic``.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import nats.errors
from nats.aio.client import Client as NATS

from services.coordinator.routing import NoInstance, RolloutRouter
from services.coordinator.workflows import Abandon, GenResult, Stopping, Tokenizers, WorkflowError
from shared.kernel.codec import DecodeError, decode, encode
from shared.kernel.config import ChorusConfig
from shared.kernel.peers import NotAccepted, PeerGone, ReplyMux
from shared.kernel.schemas import ActionRequest, ActionResult, Array, GenRequest, GenResponse
from shared.kernel.subjects import Names

MAX_ATTEMPTS = 8
NOBODY_WARN_S = 30.0  # a request nobody has served this long is logged (then every 30 s more)
BACKOFF_MAX_S = 5.0

T = TypeVar("T")


def backoff(attempt: int) -> float:
    """Seconds to wait before attempt ``attempt + 1``: doubling from 0.1 s up to BACKOFF_MAX_S, jittered."""
    return min(BACKOFF_MAX_S, 0.1 * 2**attempt) * random.uniform(0.5, 1.0)


class RetryableError(Exception):
    """An error reply or malformed answer; the request is idempotent, so it is sent again."""


def _check(error: str | None, source: str, got: int, got_what: str, asked: int, asked_what: str) -> None:
    """Raise RetryableError for an error reply or one whose row count is not the request's."""
    if error:
        raise RetryableError(f"{source} error: {error}")
    if got != asked:
        raise RetryableError(f"{got} {got_what} for {asked} {asked_what}")


class Host(Protocol):
    """What the clients need of the service that owns them."""

    nc: NATS
    names: Names
    cfg: ChorusConfig
    counters: Counter[str]

    @property
    def stopping(self) -> bool: ...

    @property
    def link_settle_s(self) -> float: ...

    def link_dropped_since(self, t0: float) -> bool: ...

    async def wait_link(self, settle_s: float) -> None: ...


class RequestClient:
    """Requests of the coordinator to the other services, with their timeouts, retries and counters."""

    def __init__(self, host: Host, mux: ReplyMux, router: RolloutRouter, tokenizers: Tokenizers, log: Any) -> None:
        self.host = host
        self.mux = mux
        self.router = router
        self.tokenizers = tokenizers
        self.log = log

    async def request(self, subject: str, data: bytes | Callable[[], bytes], timeout_s: float, what: str) -> bytes:
        """Request with retries and backoff on timeout / a dead instance; raises Abandon when it gives up. Nobody
        subscribed (the services still loading their models, all of them restarting) and this coordinator's own
        connection down are waited out, not counted as attempts. ``data`` may be made anew for each attempt (a
        generation request carries its deadline)."""
        host, counters = self.host, self.host.counters
        attempt = 0
        waiting = 0.0  # since when nobody has answered (no responders)
        while attempt < MAX_ATTEMPTS:
            t0 = time.monotonic()
            try:
                return await self.mux.request(subject, data() if callable(data) else data, timeout_s)
            except nats.errors.NoRespondersError:
                counters[f"{what}_no_responders"] += 1
                waiting = waiting or t0
                if time.monotonic() - waiting > NOBODY_WARN_S:
                    self.log.warning("nobody serves this subject yet; waiting", subject=subject,
                                     seconds=round(time.monotonic() - waiting))
                    waiting = time.monotonic()
                if host.stopping:
                    raise Stopping(f"{what} request to {subject} left: the coordinator is stopping") from None
                await asyncio.sleep(backoff(min(attempt + 3, 6)))
                continue
            except PeerGone:
                counters[f"{what}_peer_gone"] += 1
            except NotAccepted:
                counters[f"{what}_not_accepted"] += 1
            except (nats.errors.TimeoutError, TimeoutError):
                counters[f"{what}_timeouts"] += 1
            except nats.errors.Error as exc:
                if host.stopping or host.nc.is_closed or host.nc.is_draining:
                    raise Stopping(f"{what} request left: the coordinator is stopping "
                                   f"({type(exc).__name__}: {exc})") from exc
                counters[f"{what}_connection_errors"] += 1  # reconnecting: wait and try again
            if host.stopping:
                raise Stopping(f"{what} request to {subject} left: the coordinator is stopping")
            if host.link_dropped_since(t0):  # this side of the network failed, not the peer: not an attempt
                counters[f"{what}_waits_for_link"] += 1
                await host.wait_link(host.link_settle_s)
                continue
            counters[f"{what}_retries"] += 1
            await asyncio.sleep(backoff(attempt))
            attempt += 1
        raise Abandon(f"{what} request to {subject} got no answer after {attempt} attempts")

    async def _replied(self, what: str, label: str, send: Callable[[], Awaitable[bytes]], parse: Callable[[bytes], T],
                       warning: str, **context: str) -> tuple[T, float]:
        """``send`` until ``parse`` accepts the reply (it raises DecodeError or RetryableError on one to send again;
        anything else goes to the caller): the parsed reply and the seconds its attempt took. ``label`` names the
        request in the Stopping / Abandon raised when the coordinator stops or every attempt got a bad reply."""
        counters = self.host.counters
        for attempt in range(MAX_ATTEMPTS):
            t0 = time.monotonic()
            raw = await send()
            try:
                reply = parse(raw)
            except (DecodeError, RetryableError) as exc:
                counters[f"{what}_error_replies"] += 1
                counters[f"{what}_retries"] += 1
                self.log.warning(warning, **context, error=str(exc))
                if self.host.stopping:
                    raise Stopping(f"{label} left: the coordinator is stopping") from exc
                await asyncio.sleep(backoff(attempt))
                continue
            return reply, time.monotonic() - t0
        raise Abandon(f"{label} failed after retries")

    async def generate(self, model: str, adapter: str | None, prompts: list[list[int]], *,
                       max_new_tokens: int, temperature: float, top_p: float,
                       stop: list[str] | None = None) -> list[GenResult]:
        """One row per prompt from a rollouter of ``model``; a request the rollouter rejects is a WorkflowError."""
        req = GenRequest(request_id=uuid.uuid4().hex, prompts=[Array.of(p, "int32") for p in prompts],
                         max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, adapter=adapter,
                         stop_ids=[(await self.tokenizers.get(model)).eos_id], stop=stop or [])
        timeout_s = self.host.cfg.models[model].rollouter.request_timeout_s

        def data() -> bytes:
            return encode(req.model_copy(update={"deadline": time.time() + timeout_s}))

        def parse(raw: bytes) -> GenResponse:
            resp = decode(GenResponse, raw)
            if resp.error and resp.error.startswith("rejected:"):
                # the request itself is wrong for this model (a prompt longer than its context, ids outside
                # its vocabulary): the same request would be rejected again, so it is the workflow's error
                self.host.counters["gen_rejected"] += 1
                raise WorkflowError(f"the rollouter of {model} {resp.error}")
            _check(resp.error, "rollouter", len(resp.outputs), "outputs", len(prompts), "prompts")
            return resp

        resp, seconds = await self._replied("gen", f"generation for {model}",
                                            lambda: self._gen_request(model, len(prompts), data, timeout_s), parse,
                                            "bad generation reply", model=model)
        self.host.counters["gen_requests"] += 1
        return [GenResult(ids=o.ids.tolist(), logprobs=o.logprobs.tolist(), finished=o.finish == "stop",
                          version=resp.version, seconds=seconds,
                          token_versions=None if o.versions is None else o.versions.tolist())
                for o in resp.outputs]

    async def _gen_request(self, model: str, rows: int, data: Callable[[], bytes], timeout_s: float) -> bytes:
        """To the least-loaded instance of the model (balance.dispatch least_loaded, when one is known), else to the
        model's queue group."""
        if self.host.cfg.balance.dispatch == "least_loaded":
            try:
                return await self.router.request(model, rows, data, timeout_s)
            except NoInstance:
                self.host.counters["gen_unrouted"] += 1  # none known yet (starting up): NATS picks one
            except TimeoutError as exc:
                raise Abandon(str(exc)) from exc
        return await self.request(self.host.names.gen(model), data, timeout_s, "gen")

    async def act(self, kind: str, payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One result per payload from the actions service; a row that failed there carries its ``action_error``."""
        acfg = self.host.cfg.actions
        req = ActionRequest(action_id=uuid.uuid4().hex, kind=kind, payloads=payloads, timeout_s=acfg.timeout_s)
        data = encode(req)
        # Actions queue FCFS behind other tasks' checks: allow for a full queue of timeouts.
        timeout_s = acfg.timeout_s * (1 + -(-len(payloads) // acfg.cores)) + 10.0

        def parse(raw: bytes) -> ActionResult:
            result = decode(ActionResult, raw)
            _check(result.error, "actions", len(result.results), "results", len(payloads), "payloads")
            return result

        result, _ = await self._replied("act", f"{kind} actions",
                                        lambda: self.request(self.host.names.actions_submit(), data, timeout_s, "act"),
                                        parse, "bad actions reply", kind=kind)
        failed = sum(e is not None for e in result.errors)
        if failed:
            self.host.counters["act_row_errors"] += failed  # those rows score 0 (a reward function's: dropped)
            return [{**r, "action_error": e} if e is not None else r
                    for r, e in zip(result.results, result.errors, strict=False)]
        return result.results
