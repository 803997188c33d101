"""`chorus export-prometheus`: the latest ``metrics.>`` message of every service instance, served in the
Prometheus text exposition format (version 0.0.4) on ``/metrics``.

Each numeric field of a metrics message becomes one gauge ``chorus_<path>`` (nested dicts joined with ``_``,
characters Prometheus does not allow replaced by ``_``) labelled with the message's run, service, model and
instance; strings, booleans and lists are left out. The HTTP server is asyncio's own, on the same loop as the
NATS subscription: a scrape renders from memory and never waits on the bus.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.results.tracking import scalars

PREFIX = "chorus_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("run", "service", "model", "instance")
_BAD = re.compile(r"[^a-zA-Z0-9_:]")


def metric_name(path: str) -> str:
    """``counters/dropped_stale`` -> ``chorus_counters_dropped_stale`` (a valid Prometheus metric name)."""
    name = _BAD.sub("_", path)
    return PREFIX + re.sub(r"_+", "_", name).strip("_")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


@dataclass
class Latest:
    """The last metrics message of every (run, service, model, instance), its numeric leaves by dotted path."""

    values: dict[tuple[str, ...], dict[str, float]] = field(default_factory=dict)
    seen: dict[tuple[str, ...], float] = field(default_factory=dict)
    messages: int = 0
    rejected: int = 0
    last_error: str = ""

    def update(self, subject: str, payload: Any) -> bool:
        """Take one message (``chorus.<run>.metrics.<service>.<instance>``); False (counted) if it is not a
        metrics object."""
        parts = subject.split(".")
        if not isinstance(payload, Mapping) or len(parts) < 5:
            self.rejected += 1
            self.last_error = f"{subject}: expected a JSON object on chorus.<run>.metrics.<service>.<instance>"
            return False
        self.messages += 1
        labels = (str(payload.get("run") or parts[1]), str(payload.get("service") or parts[3]),
                  str(payload.get("model") or ""), str(payload.get("instance") or parts[4]))
        self.values[labels] = scalars({k: v for k, v in payload.items() if k not in LABELS}, sep=".")
        self.seen[labels] = time.time()
        return True

    def exposition(self) -> str:
        """Every gauge, grouped by name with its HELP and TYPE lines, then the exporter's own counters."""
        by_name: dict[str, list[tuple[tuple[str, ...], float]]] = {}
        paths: dict[str, str] = {}
        for labels, values in sorted(self.values.items()):
            for path, v in values.items():
                name = metric_name(path)
                paths.setdefault(name, path)
                by_name.setdefault(name, []).append((labels, v))
            by_name.setdefault(PREFIX + "exporter_last_message_seconds", []).append((labels, self.seen[labels]))
        paths.setdefault(PREFIX + "exporter_last_message_seconds", "")
        lines: list[str] = []
        for name in sorted(by_name):
            what = (f"field {paths[name]} of the metrics.<service>.<instance> messages" if paths[name] else
                    "unix time the exporter received the latest metrics message of this instance")
            lines += [f"# HELP {name} Chorus: {what}", f"# TYPE {name} gauge"]
            for labels, v in by_name[name]:
                text = ",".join(f'{k}="{_label(x)}"' for k, x in zip(LABELS, labels, strict=True))
                lines.append(f"{name}{{{text}}} {_value(v)}")
        for name, v, what in ((PREFIX + "exporter_messages_total", self.messages, "metrics messages taken"),
                              (PREFIX + "exporter_rejected_total", self.rejected,
                               "messages on metrics.> that were not a JSON metrics object")):
            lines += [f"# HELP {name} Chorus exporter: {what}", f"# TYPE {name} counter", f"{name} {v}"]
        return "\n".join(lines) + "\n"


async def read_request(reader: asyncio.StreamReader, timeout_s: float = 10.0) -> tuple[str, str]:
    """The method and path (query string left out) of an HTTP/1.1 request; its headers are read and ignored."""
    request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
    method, target, *_ = request.split(b"\r\n", 1)[0].decode("latin-1").split(" ") + ["", ""]
    return method, target.split("?", 1)[0]


async def serve_http(latest: Latest, host: str, port: int) -> asyncio.Server:
    """An HTTP/1.1 server answering ``GET /metrics`` (everything else: 404); one response per connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path = await read_request(reader)
            if method not in ("GET", "HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET /metrics\n"
            elif path == "/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE, latest.exposition().encode()
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"the metrics are on /metrics\n"
            head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n").encode()
            writer.write(head + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass  # a client that went away or sent no request: nothing to answer
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)
