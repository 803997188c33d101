"""The tiny run on hosts of their own (network namespaces, as root): a fresh deployment per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.conftest import (  # noqa: F401 - the table of cases
    fault_table,
    pytest_configure,
    pytest_sessionfinish,
    pytest_terminal_summary,
)
from tests.faults.harness import fault_config
from tests.hosts.deployment import HostDeployment
from tests.hosts.netns import sweep_stale


def deploy(tmp_path: Path, run_id: str, max_versions: int, concurrency: int = 8) -> HostDeployment:
    """Hosts, TLS, /etc/chorus of each, the run's config (the fault config's short timeouts on the cluster;
    ``concurrency`` tasks in flight) and the three NATS nodes started; the services are started by the fault
    harness."""
    sweep_stale()  # what a killed earlier run left
    dep = HostDeployment(tmp_path, run_id).up()
    dep.write_config(fault_config(tmp_path, run_id, max_versions=max_versions, replicas=3, concurrency=concurrency))
    dep.start_nats()
    return dep


@pytest.fixture
def hosts(tmp_path: Path, run_id: str, request: pytest.FixtureRequest) -> Iterator[HostDeployment]:
    dep = deploy(tmp_path, run_id, getattr(request, "param", 40))
    try:
        yield dep
    finally:
        dep.close()
