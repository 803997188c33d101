"""Experiment tracking: every metrics.jsonl record of a run also goes to TensorBoard, Weights & Biases or MLflow.

``logging.backends`` picks them (default: TensorBoard alone). Each writer is opened per model (the trainers)
or per record kind (``eval``, the coordinator) and takes the same scalars as the metrics.jsonl line: every
numeric field, nested dicts flattened with ``/``, at step = the record's version. The writers block (files,
HTTP): callers run :meth:`Trackers.log` in a thread, never on the event loop. wandb and mlflow are imported only
when listed; without a reachable server they write offline under the run directory.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from shared.kernel.config import ChorusConfig

EVAL_TRACKER = "eval"  # the coordinator's held-out evaluation records: runs/<id>/tensorboard/eval/
WANDB_URL = "https://api.wandb.ai"
PROBE_TIMEOUT_S = 2.0


def scalars(record: Mapping[str, Any], prefix: str = "", sep: str = "/") -> dict[str, float]:
    """The numeric fields of a record, nested dicts flattened with ``sep`` (``adapter_samples/sol``); booleans,
    strings, lists and None are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(scalars(value, f"{name}{sep}", sep))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return out


class Tracker(Protocol):
    def log(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files under ``runs/<id>/tensorboard/<name>/`` (one TensorBoard run per model)."""

    def __init__(self, directory: Path) -> None:
        # tensorboard's own writer (what torch's SummaryWriter wraps): no torch import where there is none
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.writer = EventFileWriter(str(directory))

    def log(self, values: dict[str, float], step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=v) for tag, v in values.items()])
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))
        self.writer.flush()  # a killed trainer loses nothing it logged

    def close(self) -> None:
        self.writer.close()


def reachable(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the host of ``url`` accepts a TCP connection within ``timeout_s``."""
    parsed = urlparse(url)
    if not parsed.hostname:
        return False
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def wandb_mode(configured: str) -> str:
    """online or offline: ``logging.wandb.mode``, or with auto (and no WANDB_MODE) online only when an API key
    is set and the server answers."""
    if configured != "auto":
        return configured
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if not os.environ.get("WANDB_API_KEY"):
        return "offline"
    return "online" if reachable(os.environ.get("WANDB_BASE_URL", WANDB_URL)) else "offline"


class WandbTracker:
    """One wandb run per model, grouped by the Chorus run; offline files under ``runs/<id>/wandb`` (``wandb sync``
    uploads them later)."""

    def __init__(self, cfg: ChorusConfig, name: str) -> None:
        import wandb

        w = cfg.logging.wandb
        directory = cfg.run_dir / "wandb"
        directory.mkdir(parents=True, exist_ok=True)
        self.mode = wandb_mode(w.mode)
        self.run = wandb.init(project=w.project, entity=w.entity, group=cfg.run.id, name=f"{cfg.run.id}/{name}",
                              id=f"{cfg.run.id}-{name}", resume="allow", dir=str(directory), mode=self.mode,
                              config=cfg.model_dump(mode="json"), reinit="create_new")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def mlflow_uri(cfg: ChorusConfig) -> str:
    """``logging.mlflow.tracking_uri`` (or MLFLOW_TRACKING_URI) when its server answers, else a file store under
    the run directory."""
    local = (cfg.run_dir / "mlruns").resolve().as_uri()
    uri = cfg.logging.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return local
    if urlparse(uri).scheme in ("http", "https") and not reachable(uri):
        return local
    return uri


class MlflowTracker:
    """One MLflow run per model in experiment ``logging.mlflow.experiment``, tagged with the Chorus run."""

    def __init__(self, cfg: ChorusConfig, name: str) -> None:
        from mlflow.tracking import MlflowClient

        self.uri = mlflow_uri(cfg)
        if self.uri.startswith("file:"):
            Path(urlparse(self.uri).path).mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.uri)
        experiment = self.client.get_experiment_by_name(cfg.logging.mlflow.experiment)
        exp_id = experiment.experiment_id if experiment is not None else \
            self.client.create_experiment(cfg.logging.mlflow.experiment)
        self.run_id = self.client.create_run(exp_id, run_name=f"{cfg.run.id}/{name}",
                                             tags={"chorus.run": cfg.run.id, "chorus.name": name}).info.run_id

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key=k, value=v, timestamp=now, step=step) for k, v in values.items() if math.isfinite(v)]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackers:
    """The run's configured backends for one model (or record kind); a backend that fails to log is counted
    (``errors``) and the others go on."""

    def __init__(self, cfg: ChorusConfig, name: str) -> None:
        self.backends: dict[str, Tracker] = {}
        for backend in cfg.logging.backends:
            if backend == "tensorboard":
                self.backends[backend] = TensorBoardTracker(cfg.run_dir / "tensorboard" / name)
            elif backend == "wandb":
                self.backends[backend] = WandbTracker(cfg, name)
            elif backend == "mlflow":
                self.backends[backend] = MlflowTracker(cfg, name)
        self.errors = 0
        self.last_error: str | None = None

    def log(self, record: Mapping[str, Any], step: int) -> None:
        """Blocking: the record's :func:`scalars` to every backend at ``step``."""
        values = scalars(record)
        for name, backend in self.backends.items():
            try:
                backend.log(values, step)
            except Exception as exc:  # noqa: BLE001 - a tracking service's failure must not stop training
                self.errors += 1
                self.last_error = f"{name}: {type(exc).__name__}: {exc}"

    def close(self) -> None:
        for backend in self.backends.values():
            try:
                backend.close()
            except Exception as exc:  # noqa: BLE001
                self.errors += 1
                self.last_error = f"close: {type(exc).__name__}: {exc}"
