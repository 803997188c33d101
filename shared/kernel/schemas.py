"""Message schemas of the bus (pydantic v2). Each carries a ``schema`` version; see :mod:`shared.kernel.codec`."""

from __future__ import annotations

import hashlib
import time
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_NEW_TOKENS = 4096  # the most new tokens one generation request may ask for


class Message(BaseModel):
    """Base of every bus message: strict keys, a schema version serialised as ``schema``, finite numbers only, and
    at most ``MAX_BYTES`` encoded (None: bounded by the broker's max_payload only)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, arbitrary_types_allowed=False,
                              allow_inf_nan=False)
    SCHEMA: ClassVar[int] = 1
    MAX_BYTES: ClassVar[int | None] = 64 * 1024  # control-plane messages are small
    schema_: int = Field(default=1, alias="schema")


class Array(BaseModel):
    """An n-d array as raw little-endian bytes plus dtype and shape."""

    model_config = ConfigDict(extra="forbid")
    dtype: Literal["int32", "int64", "float32", "float16", "bfloat16", "uint8"]
    shape: list[int]
    data: bytes

    @field_validator("shape")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(d < 0 for d in v):
            raise ValueError("shape dimensions must be >= 0")
        return v

    def model_post_init(self, __context: Any) -> None:
        if self.dtype == "bfloat16":
            itemsize = 2
        else:
            itemsize = np.dtype(self.dtype).itemsize
        n = int(np.prod(self.shape)) if self.shape else 1
        if n * itemsize != len(self.data):
            raise ValueError(f"array of shape {self.shape} {self.dtype} needs {n * itemsize} bytes, got {len(self.data)}")

    @classmethod
    def of(cls, values: Any, dtype: str = "int32") -> Array:
        arr = np.ascontiguousarray(np.asarray(values, dtype=dtype))
        return cls(dtype=dtype, shape=list(arr.shape), data=arr.tobytes())

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)

    def tolist(self) -> list[Any]:
        return self.numpy().tolist()

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1


# --- rollouter ------------------------------------------------------------------------------


class GenRequest(Message):
    """Generate continuations for a batch of prompts (token ids) with one sampling setting."""

    MAX_BYTES: ClassVar[int | None] = None

    request_id: str
    prompts: list[Array] = Field(max_length=4096)
    max_new_tokens: int = Field(gt=0, le=MAX_NEW_TOKENS)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    adapter: str | None = None  # a LoRA adapter of the model; None: the base model with adapters disabled
    stop_ids: list[int] = Field(default_factory=list, max_length=256)
    stop: list[str] = Field(default_factory=list, max_length=16)  # a row ends once its text contains one
    # Unix time after which the requester no longer waits: a rollouter answers a request that arrives later
    # (the backlog of an instance that was frozen) with an error instead of generating for nobody.
    deadline: float | None = None

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty (an empty one would stop every row at once)")
        return v


class GenOutput(Message):
    ids: Array  # response token ids, int32 [n]
    logprobs: Array  # behaviour log-probs of those ids, float32 [n]
    finish: Literal["stop", "length"]
    # weight version that sampled each id, int32 [n]; None: every id has the response's version. Several
    # versions appear only with rollouter.on_sync interrupt (partial rollout).
    versions: Array | None = None


class GenResponse(Message):
    MAX_BYTES: ClassVar[int | None] = None

    request_id: str
    outputs: list[GenOutput] = Field(default_factory=list)
    version: int = 0  # weight version of the outputs' oldest token (of every token unless outputs say versions)
    instance: str = ""
    error: str | None = None


class RolloutControl(Message):
    """pause / load / resume of one rollouter instance, sent by paramsync; migrate, sent by the coordinator's
    rollout manager: drain, leave this model, serve ``target`` at its current version."""

    verb: Literal["pause", "load", "resume", "info", "migrate"]
    # load: the version to load; resume: the served version (an instance behind it stays out of routing)
    version: int = 0
    transport: Literal["nats", "ucx"] = "nats"
    object_name: str | None = None
    checksum: str | None = None
    timeout_s: float = 30.0
    # pause and load: how long the instance stays paused from this message on when no other control message comes
    # (None: ``timeout_s``), capped by the instance's ``paramsync.max_pause_s``; then it resumes by itself.
    lease_s: float | None = Field(default=None, gt=0)
    # The sender's status subject: a paused instance probes it, and resumes by itself once the sender is gone.
    peer: str | None = None
    target: str | None = Field(default=None, max_length=64)  # migrate: the model to serve next


class RolloutControlReply(Message):
    ok: bool
    instance: str
    version: int
    checksum: str | None = None
    in_flight: int = 0
    routing: bool = True  # subscribed to the model's generation subjects
    paused: bool = False  # admitting no new generations (between a sync's pause and its resume)
    error: str | None = None


# --- trajectories ---------------------------------------------------------------------------


class Sample(Message):
    """One agent turn of one rollout: what the trainer of ``model`` learns from. Non-finite numbers decode, so that
    a micro-batch holding one is rejected sample by sample (:mod:`shared.kernel.validation`), not whole."""

    model_config = ConfigDict(allow_inf_nan=True)
    MAX_BYTES: ClassVar[int | None] = None

    run: str
    episode: str
    sample_id: str  # {input_id}_{turn}_{trajectory}
    env_idx: int
    rollout_idx: int
    agent: str
    model: str
    adapter: str | None = None
    turn: int
    prompt_ids: Array
    response_ids: Array
    behavior_logprobs: Array
    reward: float
    truncated: bool = False  # the reply was cut at workflow.max_new_tokens (it did not stop on EOS)
    group_key: str  # AT-GRPO group: (env, agent, turn)
    group_size: int = Field(gt=0)
    advantage: float | None = None  # set by the coordinator under train.grouping "episode"; else the trainer's
    # MARFT (train.loss marft), set by the coordinator's GAE: per action (one entry for MARFT-A, one per response
    # token for MARFT-T) the critic's value V and the return R = V + A; MARFT-T's per-token advantages
    gae_values: Array | None = None
    gae_returns: Array | None = None
    token_advantages: Array | None = None
    # MARFT: the samples of this model in the on-policy batch this one belongs to (the coordinator publishes a
    # batch whole, its advantages normalised together); the trainer's step takes exactly them. None: global_batch
    batch_samples: int | None = Field(default=None, gt=0)
    version: int  # acting model's weight version at generation (of the oldest token: staleness counts from it)
    # weight version of each response token, int32 [n]; None: all ``version``. Several versions only when a
    # sync interrupted the generation (rollouter.on_sync interrupt).
    token_versions: Array | None = None
    versions: dict[str, int] = Field(default_factory=dict)  # snapshot of every model's version
    timings: dict[str, float] = Field(default_factory=dict)
    created_at: float = Field(default_factory=time.time)

    @staticmethod
    def make_id(input_id: str, turn: int, trajectory: int) -> str:
        return f"{input_id}_{turn}_{trajectory}"


class MicroBatch(Message):
    """Complete GRPO groups assembled by mq for one model's trainer."""

    MAX_BYTES: ClassVar[int | None] = None

    batch_id: str
    model: str
    samples: list[Sample]
    trained_version_seen: int = 0  # mq's view of the trainer version when it assembled this batch
    created_at: float = Field(default_factory=time.time)


# --- paramsync ------------------------------------------------------------------------------


class WeightsAnnounce(Message):
    """The trainer committed ``version`` of ``model``: its weights are in the object store under ``object_name``
    and, with transport ucx, also in the trainer's memory, served bucket by bucket over UCX. ``state_object``
    holds the rest of the trainer's state of the version (optimizer, step record). The newest announce is
    also the value of KV ``weights.<model>``, the trainer's commit point."""

    model: str
    version: int
    transport: Literal["nats", "ucx"] = "nats"
    object_name: str | None = None
    checksum: str  # of the flat buffer: the digest of its bucket digests (shared.models.weights.checksum)
    nbytes: int
    state_object: str | None = None
    created_at: float = Field(default_factory=time.time)


class WeightsMetaRequest(Message):
    """Rollouter -> trainer (transport ucx): the header of a version it holds."""

    model: str
    version: int


class WeightsPull(Message):
    """Rollouter -> trainer (transport ucx): send every bucket of ``version`` to the UCX worker at ``address``,
    bucket i with tag ``tag + i``; the reply comes once every send has completed."""

    model: str
    version: int
    instance: str
    address: bytes
    tag: int = Field(ge=0, lt=2**63)


class WeightsReply(Message):
    """The trainer's answer to WeightsMetaRequest (``header``: a packed WeightsHeader) or WeightsPull."""

    MAX_BYTES: ClassVar[int | None] = None

    ok: bool
    header: bytes | None = None
    held: list[int] = Field(default_factory=list)  # versions the trainer can serve
    seconds: float = 0.0
    error: str | None = None
    peer: str | None = None  # the trainer's status subject, probed while a pull is under way


class SyncDone(Message):
    model: str
    version: int
    loaded: list[str]  # instances that acked with the right checksum
    failed: dict[str, str] = Field(default_factory=dict)  # instance -> reason
    seconds: float = 0.0
    object_name: str | None = None  # the object store object holding the version's weights


# --- actions --------------------------------------------------------------------------------


class ActionRequest(Message):
    """A batch of CPU actions; ``kind`` names a registered action, ``payloads`` its inputs."""

    MAX_BYTES: ClassVar[int | None] = None

    action_id: str
    kind: str
    payloads: list[dict[str, Any]] = Field(max_length=4096)
    cores: int = Field(default=1, ge=1)
    timeout_s: float = Field(default=10.0, gt=0.0)
    # True: every payload answers on its own as soon as it ends (an ActionResult with its ``index`` on the reply
    # subject), instead of one answer when the slowest has ended
    stream: bool = False


class ActionResult(Message):
    MAX_BYTES: ClassVar[int | None] = None

    action_id: str
    results: list[dict[str, Any]] = Field(default_factory=list)
    errors: list[str | None] = Field(default_factory=list)  # one per payload; None when it ran
    seconds: float = 0.0
    error: str | None = None  # the whole request failed
    index: int | None = None  # a streamed answer: the payload it answers (its one result and error)


# --- observability --------------------------------------------------------------------------


class StepRecord(Message):
    """One trainer step; also one line of ``runs/<run>/metrics.jsonl``."""

    model: str
    version: int
    reward_mean: float
    reward_std: float
    samples: int
    staleness_mean: float
    staleness_max: int
    dropped_stale: int
    step_seconds: float
    loss: float
    truncated: float = 0.0  # share of the step's samples whose reply was cut at workflow.max_new_tokens
    agent_reward: dict[str, float] = Field(default_factory=dict)
    sample_ids: list[str] = Field(default_factory=list)
    time: float = Field(default_factory=time.time)


class DepthReport(Message):
    model: str
    depth: int  # samples accepted by mq and not yet acked by the trainer
    capacity: int
    trained_version: int
    dropped_stale: int = 0


class LoadReport(Message):
    """A rollouter instance's load (JSON on ``rollout.<model>.load``) when it changed (looked at every
    ``balance.report_interval_s``), and at least every ``balance.keepalive_s``: its heartbeat to the coordinator's
    rollout manager."""

    model: str
    instance: str
    queued_rows: int = Field(ge=0)  # rows of requests waiting in its queue
    running_rows: int = Field(ge=0)  # rows generating (or admitted and waiting for a slot)
    tokens: int = Field(default=0, ge=0)  # KV tokens in flight
    routing: bool = True  # False: it takes no new requests (loading weights, leaving, migrating)
    version: int = 0


class DropEvent(Message):
    """Samples removed without training, and why (on ``events.<service>`` with ``"kind": "drop"``)."""

    model: str
    sample_ids: list[str]
    reason: str  # one word: stale, finished, overflow, group_dropped, late, invalid, learner_error, nonfinite_grad
    count: int
    detail: str = ""  # the particulars in words ("staleness > 1 at trainer version 49")

    @property
    def record_id(self) -> str:
        """Idempotency key of the drop's record: the same samples dropped for the same reason are one record."""
        text = "\n".join([self.model, self.reason, *sorted(self.sample_ids)])
        return "drop." + hashlib.sha256(text.encode()).hexdigest()[:32]


class DlqEntry(Message):
    service: str
    instance: str
    subject: str
    reason: str
    data: bytes
    time: float = Field(default_factory=time.time)


class CriticRow(Message):
    """One observation for the central critic: token ids, and the positions whose hidden state it values (MARFT-A:
    the observation's last token; MARFT-T: the state before each response token)."""

    ids: Array
    positions: list[int]


class CriticRequest(Message):
    """The coordinator asks the critic for the values of a finished episode's observations (request/reply)."""

    rows: list[CriticRow]


class CriticValues(Message):
    """The critic's answer: per row, a value per position; ``version``: the critic's committed version."""

    values: list[list[float]] = Field(default_factory=list)
    version: int = 0
    error: str | None = None


class CriticSample(Message):
    """One observation to train the critic on: its values when the coordinator asked (V_old of the clipped value
    loss) and its GAE returns (the targets), one per position."""

    model_config = ConfigDict(allow_inf_nan=True)

    sample_id: str  # the policy sample it belongs to
    row: CriticRow
    old_values: list[float]
    returns: list[float]


class CriticBatch(Message):
    """The critic samples of one finished episode, published once (its id deduplicates a repeat)."""

    MAX_BYTES: ClassVar[int | None] = None

    batch_id: str
    samples: list[CriticSample]
