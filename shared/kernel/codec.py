"""The one msgpack codec of the data plane, and the JSON codec of metrics and events.

Arrays travel as raw bytes with dtype and shape (:class:`shared.kernel.schemas.Array`), never as lists.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class DecodeError(ValueError):
    """A message could not be decoded into the expected schema; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def encode(msg: BaseModel) -> bytes:
    """Serialise a message model to msgpack bytes."""
    return msgpack.packb(msg.model_dump(by_alias=True, mode="python"), use_bin_type=True)


def decode(cls: type[M], data: bytes) -> M:
    """Parse msgpack bytes into ``cls``; raise :class:`DecodeError` with a readable reason."""
    _check_size(cls, data)
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"not msgpack: {type(exc).__name__}: {exc}") from exc
    return _validate(cls, raw)


def decode_json_as(cls: type[M], data: bytes) -> M:
    """Parse a JSON message (a report meant to be readable with ``nats sub``) into ``cls``, as :func:`decode`."""
    _check_size(cls, data)
    return _validate(cls, decode_json(data))


def _check_size(cls: type[BaseModel], data: bytes) -> None:
    limit = getattr(cls, "MAX_BYTES", None)
    if limit is not None and len(data) > limit:
        raise DecodeError(f"{cls.__name__}: {len(data)} bytes, larger than the {limit} one can be")


def _validate(cls: type[M], raw: Any) -> M:
    if not isinstance(raw, dict):
        raise DecodeError(f"expected a map for {cls.__name__}, got {type(raw).__name__}")
    expected = getattr(cls, "SCHEMA", None)
    got = raw.get("schema")
    if expected is not None and got != expected:
        raise DecodeError(f"{cls.__name__}: schema version {got!r}, expected {expected}")
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise DecodeError(f"{cls.__name__}.{loc}: {first['msg']} ({exc.error_count()} error(s))") from exc


def encode_json(obj: Any) -> bytes:
    """Metrics and events are JSON so that a plain ``nats sub`` is readable."""
    if isinstance(obj, BaseModel):
        return obj.model_dump_json(by_alias=True).encode()
    return json.dumps(obj, separators=(",", ":"), default=str).encode()


def decode_json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise DecodeError(f"not JSON: {exc}") from exc
