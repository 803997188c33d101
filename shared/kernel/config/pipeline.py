"""The services between generation and training: the sample queue (mq), the actions workers, the weight sync
(paramsync), and the balancing of generation over rollouter instances."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shared.kernel.config.base import Section


class MqConfig(Section):
    capacity: int | None = None  # samples in flight before backpressure; None: (max_staleness+1)*global_batch (MARFT: +2)
    report_interval_s: float = 0.5
    max_ready_msgs: int = 256


class ActionsConfig(Section):
    cores: int = Field(default=1, ge=1)  # CPU core budget: worker subprocesses
    # elastic: ARL-Tangram's action-level scheduler (docs/actions.md), an elastic kind gets 1..cores cores;
    # chorus: the same with Chorus's extensions (the estimate counts freed cores; shortest expected action first,
    # with an ageing bound); fcfs: one core per action in arrival order
    scheduler: Literal["elastic", "chorus", "fcfs"] = "chorus"
    # elastic and chorus: a cpu_tests suite's cases are handed to its cores one at a time, so that it gives a core
    # back at a case boundary when others wait and takes idle ones while nobody does (a case per worker call)
    malleable: bool = False
    # chorus: an action that has waited this long goes ahead of every younger one (the aged in arrival order), so a
    # long suite behind a stream of short tool calls waits at most about this long past its turn
    age_s: float = Field(default=30.0, ge=0)
    timeout_s: float = Field(default=5.0, gt=0)
    memory_mb: int = Field(default=512, ge=16)
    # namespaces: code actions run in Linux namespaces, and the actions service refuses to start (the run stops)
    # where they do not work (docs/sandbox.md says what a container needs); best_effort: there, code runs in a
    # forked child of the worker instead, with limits but no isolation, and the service says so at start
    isolation: Literal["namespaces", "best_effort"] = "namespaces"


class ParamSyncConfig(Section):
    # ucx: buckets straight from the trainer's memory into each rollouter over UCX (shared memory on one host,
    # RDMA/TCP across hosts); nats: through the JetStream object store. auto: ucx where ucxx is installed.
    transport: Literal["auto", "ucx", "nats"] = "auto"
    bucket_mb: float = Field(default=64, ge=1 / 64, le=4096)  # bucket size: one transfer and one checksum each
    pause_timeout_s: float = Field(default=30.0, gt=0)
    load_timeout_s: float = Field(default=60.0, gt=0)
    load_attempts: int = Field(default=2, ge=1)  # per instance and version; a live instance failing all of them
    # is kept out of routing (and keeps trying by itself) while the others serve the new version
    # A pause lasts as long as its control message says (a pause or load names its lease: paramsync asks for the
    # rest of its sync), never longer than this: then the rollouter resumes by itself, whoever paused it.
    max_pause_s: float = Field(default=180.0, gt=0)
    keep_versions: int = Field(default=2, ge=1)  # versions a ucx trainer holds in memory for late loaders
    chunk_kb: int = Field(default=512, ge=16)  # object store chunk size (transport nats)

    @model_validator(mode="after")
    def _pause_fits(self) -> ParamSyncConfig:
        if self.max_pause_s < self.pause_timeout_s + self.load_timeout_s:
            raise ValueError(f"max_pause_s: {self.max_pause_s:g} s is shorter than one pause and load "
                             f"(pause_timeout_s + load_timeout_s = {self.pause_timeout_s + self.load_timeout_s:g} s): "
                             "every sync would be cut short")
        return self


class BalanceSection(Section):
    """FlexMARL's hierarchical load balancing of generation requests over rollouter instances (docs/balancing.md)."""

    # least_loaded: the coordinator's rollout manager sends each request to the instance of its model with the
    # lowest load, on that instance's own subject; random: to the model's queue group (NATS picks an instance)
    dispatch: Literal["least_loaded", "random"] = "least_loaded"
    # inter-agent balancing: move instances from the least to the most loaded model when their queue lengths
    # (requests waiting for an answer) differ by more than delta
    migrate: bool = True
    delta: int = Field(default=5, ge=0)  # FlexMARL's threshold
    poll_s: float = Field(default=1.0, gt=0)  # how often the manager compares the models' queue lengths
    window: int = Field(default=4, ge=1)  # the queue lengths compared are the means of the last `window` polls
    cooldown_s: float = Field(default=5.0, ge=0)  # after a migration, the next waits this long (loads settle)
    # each rollouter looks at its load this often and reports it when it changed (and when it joins or leaves
    # routing); an unchanged load is reported again every keepalive_s (its heartbeat): a thousand idle instances
    # cost the coordinator a few hundred reports a second, not thousands
    report_interval_s: float = Field(default=0.5, gt=0)
    keepalive_s: float = Field(default=5.0, gt=0)
    misses: int = Field(default=4, ge=1)  # heartbeats missed in a row (misses x keepalive_s) before it is removed
    # the most heartbeats a second the whole fleet sends the coordinator: with more instances than keepalive_s x
    # this, every instance's keepalive stretches to instances / heartbeats_per_s (1,024 instances: 10.24 s)
    heartbeats_per_s: float = Field(default=100.0, gt=0)

    def keepalive_for(self, instances: int) -> float:
        """The keepalive of each of ``instances`` rollouter instances: ``keepalive_s``, or longer for a fleet
        whose heartbeats would exceed ``heartbeats_per_s``."""
        return max(self.keepalive_s, instances / self.heartbeats_per_s)

    def heartbeat_for(self, instances: int) -> float:
        """The longest an instance of a fleet of ``instances`` stays silent while alive: its unchanged load's
        report comes this often."""
        return max(self.report_interval_s, self.keepalive_for(instances))


class RolloutPoolSection(Section):
    """Rollouter instances of no model of their own (docs/balancing.md): `chorus up` starts ``pool`` of them on the
    model the workflow's agents ask most of, and the rollout manager moves them where the load is."""

    pool: int = Field(default=0, ge=0)
