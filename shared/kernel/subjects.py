"""Every subject, stream, consumer, KV and object-store name of a run, built in one place.

All subjects start with ``chorus.<run>.``; services never write a subject literal elsewhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
_OBJECT = re.compile(r"^(weights|state)/(?P<model>[A-Za-z0-9_-]+)/v(?P<version>\d+)(-[A-Za-z0-9]+)?$")

SERVICES = ("coordinator", "rollouter", "mq", "trainer", "paramsync", "actions", "critic")

# The subjects each service subscribes to (core NATS or a JetStream consumer's filter), by the Names method that
# builds them. Each one is fuzzed by the tests (tests/integration/test_fuzz.py), which also check on a live run
# that no service subscribes to anything else. ``status`` ignores its payload: any request gets the metrics.
LISTENS: dict[str, tuple[str, ...]] = {
    "coordinator": ("depth", "sync_done", "rollout_load", "status"),
    "rollouter": ("gen", "gen_direct", "rollout_control", "sync_done", "status"),
    "mq": ("traj", "status"),
    "trainer": ("ready", "weights_meta", "weights_pull", "status"),
    "paramsync": ("sync_announce", "status"),
    "actions": ("actions_submit", "status"),
    "critic": ("critic_values", "critic_samples", "status"),
}
# The subjects each service kind publishes on (core NATS, JetStream, requests), by the Names method that builds them;
# every kind also publishes its own OWN subjects and probes the status endpoint of any service (its peers). With
# LISTENS and the KV keys of KV_WRITES, shared/launcher/natsauth.py derives each kind's permissions (deploy/nats/auth.conf).
PUBLISHES: dict[str, tuple[str, ...]] = {
    "coordinator": ("traj", "gen", "gen_direct", "rollout_control", "actions_submit", "critic_values",
                    "critic_samples", "samples"),
    "rollouter": ("rollout_load", "weights_meta", "weights_pull"),
    "mq": ("depth", "ready"),
    "trainer": ("sync_announce",),
    "paramsync": ("sync_done", "rollout_control"),
    "actions": (),
    "critic": (),
}
OWN = ("metrics", "events", "dlq")
# The run's KV keys each kind writes (puts, compare-and-swaps, deletes), by the Names method that builds them.
KV_WRITES: dict[str, tuple[str, ...]] = {
    "coordinator": ("eval_final_key", "coordinator_closed_key"),
    "mq": ("mq_closed_key",),
    "trainer": ("trained_key", "weights_key"),
    "paramsync": ("version_key", "sync_key", "rollouter_key"),
    "rollouter": ("rollouter_key",),
    "critic": ("critic_key",),
}
OBJECT_WRITERS = ("trainer", "critic")  # weights and committed state go into the run's object store
# Subjects no service subscribes to: what services publish for people and tools to watch, and the general
# builders the subjects above are made with.
WATCHED_ONLY = ("metrics", "metrics_all", "metrics_every_run", "events", "events_all", "dlq", "srv_ping", "samples")
BUILDERS = ("control", "sync")


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

    @classmethod
    def any_run(cls) -> Names:
        """Names whose run id is the wildcard ``*``: subject patterns matching every run (for permissions)."""
        names = object.__new__(cls)
        object.__setattr__(names, "run", "*")
        return names

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

    def rollout_load(self, model: str) -> str:
        """Rollouter instances' load reports (JSON :class:`LoadReport`): the rollout manager's heartbeats."""
        return f"{self.prefix}.rollout.{model}.load"

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

    # --- MARFT's central critic (train.loss marft) --------------------------------------------
    def critic_values(self) -> str:
        """Request/reply to the critic: the values of a finished episode's observations."""
        return f"{self.prefix}.critic.values"

    def critic_samples(self) -> str:
        """The critic's training samples (JetStream, one CriticBatch per episode)."""
        return f"{self.prefix}.critic.samples"

    def critic_stream(self) -> str:
        return f"CHORUS_{_upper(self.run)}_CRITIC"

    @staticmethod
    def critic_consumer() -> str:
        return "critic"

    @staticmethod
    def critic_key() -> str:
        """The critic's commit point: JSON {version, object} of its newest committed head and optimizer."""
        return "critic"

    @staticmethod
    def critic_object(version: int, epoch: str) -> str:
        return f"critic/v{version}-{epoch}"

    # --- control, observability -------------------------------------------------------------
    def control(self, service: str, verb: str) -> str:
        return f"{self.prefix}.control.{service}.{verb}"

    def metrics(self, service: str, instance: str) -> str:
        return f"{self.prefix}.metrics.{service}.{instance}"

    def metrics_all(self) -> str:
        return f"{self.prefix}.metrics.>"

    @staticmethod
    def metrics_every_run() -> str:
        """The metrics of every run on the server (``chorus export-prometheus --all-runs``)."""
        return "chorus.*.metrics.>"

    def events(self, service: str) -> str:
        return f"{self.prefix}.events.{service}"

    def dlq(self, service: str) -> str:
        return f"{self.prefix}.dlq.{service}"

    def events_all(self) -> str:
        return f"{self.prefix}.events.>"

    def samples(self) -> str:
        """The coordinator's sampled episode records (JSON lines, as in samples.jsonl): what the agents said,
        for ``chorus dashboard``'s trajectory view."""
        return f"{self.prefix}.samples"

    def status(self, service: str, model: str | None, instance: str) -> str:
        """The status endpoint of one service instance (micro service API): its metrics snapshot, and the
        subject peers probe to tell a live instance from a dead or frozen one."""
        return f"{self.control(service, 'status')}.{model or '_'}.{instance}"

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

    def events_stream(self) -> str:
        """Every event of the run (``events.>``): steps and drops are written to it before what they report
        is acknowledged, so it is the run's ledger of which sample went where."""
        return f"CHORUS_{_upper(self.run)}_EVENTS"

    def streams(self, models: list[str]) -> list[str]:
        """Every stream of a run: the data plane, the events, the KV bucket's and the object store's."""
        out = [s for m in models for s in (self.traj_stream(m), self.ready_stream(m))]
        return out + [self.events_stream(), f"KV_{self.kv_bucket}", f"OBJ_{self.obj_bucket}"]

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
        """The trainer's committed version: its state (weights and optimizer) for that version is durable in the
        object store. Set by compare-and-swap: the commit point of a step, and the trainer's fencing token."""
        return f"trained.{model}"

    @staticmethod
    def weights_key(model: str) -> str:
        """The WeightsAnnounce (msgpack) of the newest committed version: what paramsync syncs to."""
        return f"weights.{model}"

    @staticmethod
    def sync_key(model: str) -> str:
        """Paramsync's protocol state (JSON): the version it is syncing and the phase, for a restarted paramsync."""
        return f"sync.{model}"

    @staticmethod
    def rollouter_key(model: str, instance: str) -> str:
        """Presence of a rollouter instance (set on start, deleted on stop)."""
        return f"rollouter.{model}.{instance}"

    @staticmethod
    def rollouter_prefix(model: str) -> str:
        return f"rollouter.{model}."

    @staticmethod
    def eval_final_key() -> str:
        """Set by the coordinator once its evaluation of the final weights is written (eval.every > 0): with every
        ``trained.<model>`` at train.max_versions, the run has finished."""
        return "eval.final"

    @staticmethod
    def coordinator_closed_key() -> str:
        """Set to train.max_versions once the coordinator sends no more samples of the run: every model reached
        max_versions and its last episodes' samples are in the traj streams. An mq started with --exit-when-done
        waits for it, so what was published is recorded before it exits."""
        return "closed.coordinator"

    @staticmethod
    def mq_closed_key(model: str) -> str:
        """Set to train.max_versions once the model's mq sends nothing more to its ready stream (every sample
        stored for the model dropped as finished): what a trainer started with --exit-when-done waits for."""
        return f"closed.mq.{model}"

    @staticmethod
    def config_key() -> str:
        return "config"

    @staticmethod
    def weights_object(model: str, version: int, epoch: str = "") -> str:
        """The flat weights of a version; ``epoch`` names the trainer incarnation that wrote them, so a stale
        trainer never overwrites the objects a newer one committed."""
        return f"weights/{model}/v{version}" + (f"-{epoch}" if epoch else "")

    @staticmethod
    def state_object(model: str, version: int, epoch: str) -> str:
        """The trainer's committed state of a version (its weights are the weights object): optimizer, the step
        record, recent sample ids."""
        return f"state/{model}/v{version}-{epoch}"

    @staticmethod
    def object_version(model: str, name: str) -> int | None:
        """The version in an object name of ``model`` built above, or None for any other name."""
        m = _OBJECT.match(name)
        return int(m["version"]) if m is not None and m["model"] == model else None
