"""Rows of the experience-store tables (FlexMARL Fig. 3): meta, data and status columns, type-aware hybrid storage.

A row keeps its meta columns (``policy_version``, ``sample_id``, ``is_processing``), one cell per data column
of :data:`COLUMNS` and one status per data column (is the value filled). A simple value (int, float, bool,
None) is stored by value in its cell; anything else (token arrays, strings, lists, the Sample fields that are
no column) lives in :class:`Blobs` and the cell keeps only a :class:`Ref` to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from pydantic import ValidationError

from shared.kernel.schemas import Array, Sample

H = TypeVar("H")

COLUMNS = ("prompt", "response", "reward", "advantage")  # data columns, each with a status column
DATA_FIELDS = frozenset({"prompt_ids", "response_ids", "behavior_logprobs", "reward", "advantage"})
_PLACEHOLDER = {"prompt_ids": Array.of([]), "response_ids": Array.of([]),
                "behavior_logprobs": Array.of([], "float32"), "reward": 0.0}


@dataclass(frozen=True, slots=True)
class Ref:
    """The key of a complex value in :class:`Blobs`."""

    key: str


Cell = int | float | bool | Ref | None


@dataclass
class Row(Generic[H]):
    """One row of an agent's table."""

    policy_version: int
    sample_id: str
    is_processing: bool
    values: dict[str, Cell]  # data column -> value, or Ref for a complex value
    status: dict[str, bool]  # data column -> filled
    head: Ref  # the Sample fields that are no column (run, turn, group_key, ...)
    group_key: str  # index into the store's groups
    handle: H
    seq: int  # arrival order, for oldest-first dispatch

    @property
    def filled(self) -> bool:
        return all(self.status.values())


def head_of(sample: Sample) -> dict[str, Any]:
    """The fields of a Sample that are no data column: the head of a row opened partially."""
    return {k: getattr(sample, k) for k in Sample.model_fields if k not in DATA_FIELDS}


def columns_of(sample: Sample) -> dict[str, Any]:
    """A Sample's data columns."""
    return {"prompt": sample.prompt_ids, "response": (sample.response_ids, sample.behavior_logprobs),
            "reward": sample.reward, "advantage": sample.advantage}


def checked_head(head: Mapping[str, Any]) -> dict[str, Any]:
    """A row head validated as a Sample's (defaults filled in), or ValueError naming the bad field."""
    data = sorted(DATA_FIELDS & set(head))
    if data:
        raise ValueError(f"row head has data fields {data}; pass them as columns {', '.join(COLUMNS)}")
    try:
        return head_of(Sample.model_validate({**head, **_PLACEHOLDER}))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(f"bad row head: {'.'.join(map(str, first['loc']))}: {first['msg']}") from exc


def checked(sid: str, column: str, value: Any) -> Any:
    """A column value in its stored type, or ValueError saying what was expected."""
    def bad(expected: str) -> ValueError:
        return ValueError(f"column {column!r} of sample {sid}: expected {expected}, got {type(value).__name__}")

    number = isinstance(value, int | float) and not isinstance(value, bool)
    if column == "prompt":
        if not isinstance(value, Array):
            raise bad("an Array of token ids")
    elif column == "response":
        if not (isinstance(value, tuple | list) and len(value) == 2 and all(isinstance(a, Array) for a in value)):
            raise bad("(response ids, behaviour log-probs) as two Arrays")
        if len(value[0]) != len(value[1]):
            raise ValueError(f"column 'response' of sample {sid}: {len(value[0])} ids but {len(value[1])} log-probs")
        value = tuple(value)
    elif column == "reward":
        if not number:
            raise bad("a number")
        value = float(value)
    elif column == "advantage":
        if value is not None and not number:
            raise bad("a number or None")
        value = None if value is None else float(value)
    else:
        raise ValueError(f"unknown column {column!r} for sample {sid}: the data columns are {', '.join(COLUMNS)}")
    return value


class Blobs(dict[str, Any]):
    """The complex values of one store's rows by key; rows hold :class:`Ref` to them."""

    def new_row(self, head: Mapping[str, Any], handle: H, seq: int) -> Row[H]:
        """An empty row (every status false) whose head is stored by reference."""
        sid = head["sample_id"]
        ref = Ref(f"{sid}/head")
        self[ref.key] = {k: v for k, v in head.items() if k not in ("sample_id", "version")}
        return Row(policy_version=head["version"], sample_id=sid, is_processing=False,
                   values=dict.fromkeys(COLUMNS), status=dict.fromkeys(COLUMNS, False), head=ref,
                   group_key=head["group_key"], handle=handle, seq=seq)

    def write(self, row: Row[H], column: str, value: Any) -> None:
        """Store by value if simple, else by reference; flip the column's status."""
        self._free(row.values[column])
        if value is None or isinstance(value, bool | int | float):
            row.values[column] = value
        else:
            ref = Ref(f"{row.sample_id}/{column}")
            self[ref.key] = value
            row.values[column] = ref
        row.status[column] = True

    def value(self, cell: Cell) -> Any:
        return self[cell.key] if isinstance(cell, Ref) else cell

    def sample(self, row: Row[H]) -> Sample:
        """The Sample a filled row was made of, field for field (validated when its columns were written)."""
        ids, logprobs = self.value(row.values["response"])
        return Sample.model_construct(
            **self[row.head.key], sample_id=row.sample_id, version=row.policy_version,
            prompt_ids=self.value(row.values["prompt"]), response_ids=ids, behavior_logprobs=logprobs,
            reward=cast(float, row.values["reward"]), advantage=cast("float | None", row.values["advantage"]),
        )

    def free(self, row: Row[H]) -> None:
        """Forget a removed row's values."""
        for cell in (row.head, *row.values.values()):
            self._free(cell)

    def _free(self, cell: Cell) -> None:
        if isinstance(cell, Ref):
            del self[cell.key]
