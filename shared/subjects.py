"""Every subject, stream, consumer, KV and object-store name of a run, built in one place.

All subjects start with ``chorus.<run>.``; services never write a subject literal elsewhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")

SERVICES = ("coordinator", "rollouter", "mq", "trainer", "paramsync", "actions")


def check_token(value: str, what: str) -> str:
    """Return ``value`` if it is a single NATS subject token made of [A-Za-z0-9_-], else raise."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must match [A-Za-z0-9_-]+ (it is used in NATS subjects)")
    return value


def _upper(value: str) -> str:
    return value.replace("-", "_").upper()


@dataclass(frozen=True)
class Names:
    """Names for one run. ``Names("r1").traj("m")`` -> ``chorus.r1.traj.m``."""

    run: str

    def __post_init__(self) -> None:
        check_token(self.run, "run id")

    @property
    def prefix(self) -> str:
        return f"chorus.{self.run}"

    # --- data plane -------------------------------------------------------------------------
    def traj(self, model: str) -> str:
        return f"{self.prefix}.traj.{model}"

    def ready(self, model: str) -> str:
        return f"{self.prefix}.ready.{model}"

    def gen(self, model: str) -> str:
        """Queue-group generation subject of a model (any instance answers)."""
        return f"{self.prefix}.rollout.{model}.gen"

    def gen_direct(self, model: str, instance: str) -> str:
        return f"{self.prefix}.rollout.{model}.{instance}.gen"

    def rollout_control(self, model: str, instance: str, verb: str) -> str:
        """pause / load / resume / info of one rollouter instance."""
        return f"{self.prefix}.control.rollouter.{model}.{instance}.{verb}"

    def depth(self, model: str) -> str:
        """mq's backlog report for a model (core NATS, JSON)."""
        return f"{self.prefix}.mq.{model}.depth"

    # --- paramsync --------------------------------------------------------------------------
    def sync(self, model: str, verb: str) -> str:
        return f"{self.prefix}.sync.{model}.{verb}"

    def sync_announce(self, model: str) -> str:
        return self.sync(model, "announce")

    def sync_done(self, model: str) -> str:
        return self.sync(model, "done")

    def weights_meta(self, model: str) -> str:
        """Request/reply to the trainer (transport ucx): the header of a version."""
        return self.sync(model, "weights.meta")

    def weights_pull(self, model: str) -> str:
        """Request/reply to the trainer (transport ucx): send a version's buckets to a UCX worker."""
        return self.sync(model, "weights.pull")

    # --- actions ----------------------------------------------------------------------------
    def actions_submit(self) -> str:
        return f"{self.prefix}.actions.submit"

    # --- control, observability -------------------------------------------------------------
    def control(self, service: str, verb: str) -> str:
        return f"{self.prefix}.control.{service}.{verb}"

    def metrics(self, service: str, instance: str) -> str:
        return f"{self.prefix}.metrics.{service}.{instance}"

    def metrics_all(self) -> str:
        return f"{self.prefix}.metrics.>"

    def events(self, service: str) -> str:
        return f"{self.prefix}.events.{service}"

    def dlq(self, service: str) -> str:
        return f"{self.prefix}.dlq.{service}"

    def events_all(self) -> str:
        return f"{self.prefix}.events.>"

    @staticmethod
    def srv_ping(service: str | None = None) -> str:
        """NATS micro API ping of every service, or of one Chorus service kind (answers carry metadata.run)."""
        return "$SRV.PING" if service is None else f"$SRV.PING.chorus-{service}"

    # --- JetStream objects ------------------------------------------------------------------
    def traj_stream(self, model: str) -> str:
        return f"CHORUS_{_upper(self.run)}_TRAJ_{_upper(model)}"

    def ready_stream(self, model: str) -> str:
        return f"CHORUS_{_upper(self.run)}_READY_{_upper(model)}"

    def mq_consumer(self, model: str) -> str:
        return f"mq_{model}"

    def trainer_consumer(self, model: str) -> str:
        return f"trainer_{model}"

    @property
    def kv_bucket(self) -> str:
        return f"chorus_{self.run}"

    @property
    def obj_bucket(self) -> str:
        return f"chorus_{self.run}_obj"

    # --- KV keys ----------------------------------------------------------------------------
    @staticmethod
    def version_key(model: str) -> str:
        """Weight version the model's rollouters serve (set by paramsync)."""
        return f"version.{model}"

    @staticmethod
    def trained_key(model: str) -> str:
        """Trainer's own version: optimizer steps applied (set by the trainer)."""
        return f"trained.{model}"

    @staticmethod
    def rollouter_key(model: str, instance: str) -> str:
        """Presence of a rollouter instance (set on start, deleted on stop)."""
        return f"rollouter.{model}.{instance}"

    @staticmethod
    def rollouter_prefix(model: str) -> str:
        return f"rollouter.{model}."

    @staticmethod
    def config_key() -> str:
        return "config"

    @staticmethod
    def weights_object(model: str, version: int) -> str:
        return f"weights/{model}/v{version}"

    @staticmethod
    def checkpoint_object(model: str, version: int) -> str:
        return f"checkpoints/{model}/v{version}"
