"""The one msgpack codec of the data plane, and the JSON codec of metrics and events.

Arrays travel as raw bytes with dtype and shape (:class:`shared.schemas.Array`), never as lists.
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
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"not msgpack: {type(exc).__name__}: {exc}") from exc
    if not isinstance(raw, dict):
        raise DecodeError(f"expected a msgpack map for {cls.__name__}, got {type(raw).__name__}")
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
