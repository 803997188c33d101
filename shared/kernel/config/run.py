"""The run itself and how its processes reach each other and report: run, nats, peers, logging."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from shared.kernel.config.base import Section
from shared.kernel.subjects import check_token


class RunSection(Section):
    id: str = "run"  # names every subject, stream and bucket of the run; `chorus up` appends a timestamp
    dir: Path = Path("runs")  # run outputs go to <dir>/<id> (metrics, logs, checkpoints); caches to <dir>/_cache
    seed: int = 0  # seeds model initialisation and the task stream
    # `chorus up` restarts a service that exits unexpectedly, after restart_delay_s; one that exits more than
    # max_restarts times within restart_window_s stops the run (a crash loop, not a passing fault).
    max_restarts: int = Field(default=5, ge=0)
    restart_window_s: float = Field(default=300.0, gt=0)
    restart_delay_s: float = Field(default=1.0, ge=0)
    # A service's whole stop on SIGTERM (drain the work in hand, then close): what is not done by then is left, as
    # a crash would leave it, and the process exits. Below every deployment's grace before SIGKILL: `chorus up`
    # 20 s, compose, systemd and Kubernetes 45 s.
    stop_grace_s: float = Field(default=15.0, ge=1.0, le=40.0)

    @field_validator("id")
    @classmethod
    def _token(cls, v: str) -> str:
        return check_token(v, "run.id")


class NatsSection(Section):
    # None: `chorus up` starts an embedded nats-server. Several servers of a cluster: comma-separated; the
    # client also learns the cluster's other servers from the one it reaches, and reconnects to a survivor.
    url: str | None = None
    max_payload_mb: int = Field(default=8, ge=1, le=64)
    connect_timeout_s: float = 5.0  # the whole budget for reaching a server at start (all attempts): then exit 69
    # A client pings its server this often; two pings unanswered make the connection stale and the client moves to
    # another server of the URL. It is how a client notices a server cut off by the network (no error ever comes
    # on a connection whose packets are dropped): nats-py's own default of 120 s left it stuck for four minutes.
    ping_interval_s: float = Field(default=10.0, gt=0)
    # A server cut off from the rest of its cluster keeps answering pings but can no longer serve JetStream: every
    # service asks its server for JetStream's account info this often, and after three failures in a row moves to
    # another server of the cluster (one it learnt of, or of the URL). 0: never (a single server has nowhere to go).
    jetstream_check_s: float = Field(default=5.0, ge=0)
    # Copies of every stream, KV bucket and object store Chorus creates: 3 on a three-node cluster survives the
    # loss of any one node; 1 on a single server (more needs a cluster with at least that many nodes).
    replicas: int = Field(default=1, ge=1, le=5)
    events_max_mb: int = Field(default=256, ge=1)  # the events stream keeps the newest events up to this size
    # Where JetStream puts the copies: servers whose `server_tags` hold every one of these tags (docs/security.md).
    placement_tags: list[str] = Field(default_factory=list)
    # A run's streams drop messages older than this (0: kept until `chorus clean`); the KV bucket and the object
    # store keep theirs (they are the run's state), and go with `chorus clean <run>`.
    max_age_s: float = Field(default=0.0, ge=0.0)
    # Credentials and TLS (docs/security.md). `{service}` in user, password_file, creds, nkey_seed, tls_cert and
    # tls_key becomes the kind of the connecting party (coordinator, rollouter, mq, trainer, paramsync, actions,
    # supervisor, observer, admin), so one config gives every kind its own least-privilege identity. A password
    # is read from CHORUS_NATS_PASSWORD_<KIND> when that is set, else from password_file, else password.
    user: str | None = None
    password: SecretStr | None = None
    password_file: str | None = None
    token: SecretStr | None = None
    nkey_seed: str | None = None  # an nkey seed file (SU...)
    creds: str | None = None  # a JWT credentials file (.creds), for operator-mode servers
    tls_ca: str | None = None  # CA bundle that signed the servers' certificates (tls:// URLs use TLS anyway)
    tls_cert: str | None = None  # client certificate, for servers that verify clients
    tls_key: str | None = None
    # The embedded server of `chorus up` (no url): one generated password per client kind, each service given only
    # its own, the observer's written to <run dir>/nats/observer.password (docs/security.md). false: an open server
    # on loopback, where any local process may publish on the run's subjects and write its KV.
    embedded_auth: bool = True
    # The embedded server fsyncs every JetStream write before it acknowledges it (`sync_interval: always`), so an
    # acknowledged sample survives a power cut, not only a crash; by default it fsyncs every 2 minutes. A server of
    # your own takes `jetstream { sync_interval: always }` in its config (deploy/nats/*.conf). Its cost:
    # docs/operations.md (loadtests/bench_pipeline.py --sync both).
    sync_always: bool = False

    @property
    def servers(self) -> list[str]:
        """The server URLs of ``url``."""
        return [u.strip() for u in (self.url or "").split(",") if u.strip()]

    @model_validator(mode="after")
    def _one_identity(self) -> NatsSection:
        given = [k for k in ("user", "token", "nkey_seed", "creds") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[0]}: give one of user, token, nkey_seed and creds, not {' and '.join(given)}")
        if self.token is not None and (self.password is not None or self.password_file is not None):
            raise ValueError("token: a token replaces user and password; leave password and password_file out")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert: a client certificate needs both tls_cert and tls_key")
        return self


class PeersSection(Section):
    """How a service tells a dead or frozen peer from a slow one while it waits on it."""

    probe_interval_s: float = Field(default=1.0, gt=0)  # a peer with requests outstanding is probed this often
    probe_timeout_s: float = Field(default=2.0, gt=0)  # a probe unanswered this long is a miss
    misses: int = Field(default=3, ge=1)  # consecutive misses make a frozen peer dead; no responders at once
    accept_timeout_s: float = Field(default=5.0, gt=0)  # a request not accepted by any instance this long is resent


class WandbSection(Section):
    project: str = "chorus"
    entity: str | None = None
    # auto: online when WANDB_API_KEY is set and the server answers (WANDB_MODE, if set, wins), else offline
    # files under runs/<id>/wandb for a later `wandb sync`
    mode: Literal["auto", "online", "offline"] = "auto"


class MlflowSection(Section):
    # None: MLFLOW_TRACKING_URI, or a file store runs/<id>/mlruns; an http(s) server that does not answer
    # falls back to that file store too
    tracking_uri: str | None = None
    experiment: str = "chorus"


TRACKING_PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}  # backend: (module, extra)


Backend = Literal["tensorboard", "wandb", "mlflow"]


class LoggingSection(Section):
    # Where each metrics.jsonl record also goes (docs/results.md): TensorBoard event files under
    # runs/<id>/tensorboard/<model>/, Weights & Biases, MLflow. [] for none.
    backends: list[Backend] = Field(default_factory=lambda: list[Backend](["tensorboard"]))
    wandb: WandbSection = Field(default_factory=WandbSection)
    mlflow: MlflowSection = Field(default_factory=MlflowSection)
    # One rollout of every Nth task (and of every held-out evaluation task) to runs/<id>/samples.jsonl: the
    # prompt tails, responses, rewards and answers of its turns, read with `chorus samples`. 0 = off. The file
    # rotates at 8 MB (samples.1.jsonl keeps the one before).
    samples_every: int = Field(10, ge=0)

    @field_validator("backends")
    @classmethod
    def _installed(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"{v} names a backend twice")
        for backend in v:
            if backend in TRACKING_PACKAGES:
                module, extra = TRACKING_PACKAGES[backend]
                if importlib.util.find_spec(module) is None:
                    raise ValueError(f"{backend} is listed but the package {module!r} is not installed: "
                                     f"pip install 'chorus[{extra}]', or remove {backend} from logging.backends")
        return v
