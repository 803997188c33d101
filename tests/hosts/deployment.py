"""The tiny run deployed on hosts of their own (network namespaces on one bridge, tests/hosts/netns.py) as
deploy/systemd/install.sh and its files would deploy it: the three-node TLS NATS cluster of deploy/nats/ on three
hosts, every service from its shipped unit's ExecStart and /etc/chorus/chorus.env (tests/hosts/units.py), the
hardened actions unit in a private network of its own behind systemd-socket-proxyd, each service with its own
kind's password; a process that exits is restarted after its unit's RestartSec, as systemd's Restart=on-failure
would. It has the shape :class:`tests.faults.harness.FaultRun` drives (``sup``, ``start``, ``start_all``,
``stop_all``, ``logs``), plus partitions."""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from shared.kernel.credentials import KINDS, password_env
from shared.launcher.localauth import new_password
from shared.launcher.supervisor import Child, Supervisor
from tests.conftest import ROOT
from tests.hosts.netns import Network
from tests.hosts.units import Unit, read_env_file
from tests.natstls import make_tls

MODELS = ["solver_lm", "verifier_lm"]
NODES = ("nats-1", "nats-2", "nats-3")
# docs/deploy.md's three-node placement, its rollouters' second instances on a fourth host, the coordinator on a
# fifth (a host of its own, so that cutting it off cuts off nothing else)
PLACEMENT: dict[str, list[tuple[str, str]]] = {
    "h1": [("nats-server", "1"), ("actions", "0"), *((k, f"{m}-0") for m in MODELS for k in ("mq", "paramsync"))],
    "h2": [("nats-server", "2"), ("trainer", "solver_lm-0"), ("rollouter", "solver_lm-0")],
    "h3": [("nats-server", "3"), ("trainer", "verifier_lm-0"), ("rollouter", "verifier_lm-0")],
    "h4": [("rollouter", "solver_lm-1"), ("rollouter", "verifier_lm-1")],
    "h5": [("coordinator", "0")],
}
ALIASES = {"h1": ("nats-1",), "h2": ("nats-2",), "h3": ("nats-3",)}
LEDGER = "ledger"  # the test's own user on the cluster: every permission (it watches every sample and subject)
CLIENT_URL = ",".join(f"tls://{n}:4222" for n in NODES)
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PROXY = "proxy-0"  # chorus-actions-nats@0: the actions unit's door to NATS


def key_of(service: str, instance: str) -> str:
    """The fault harness's key: ``<kind>-<model>-<i>`` or ``<kind>-<i>``; a NATS node is ``nats-<i>``."""
    return f"nats-{instance}" if service == "nats-server" else f"{service}-{instance}"


@dataclass
class HostDeployment:
    tmp: Path
    run_id: str
    config_overrides: dict[str, Any] = field(default_factory=dict)
    net: Network = field(init=False)
    sup: Supervisor = field(init=False)
    passwords: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.net = Network({h: ALIASES.get(h, ()) for h in PLACEMENT})
        self.sup = Supervisor(self.tmp / "logs")
        self.nats = Supervisor(self.tmp / "logs")
        self.passwords = {kind: new_password() for kind in (*KINDS, LEDGER)}
        self.where = {key_of(s, i): (host, s, i) for host, units in PLACEMENT.items() for s, i in units}
        self.stopped: set[str] = set()  # keys stopped on purpose (not restarted)

    # --- set-up, as install.sh and the docs' three-node walkthrough do it -------------------------------------------
    def up(self) -> HostDeployment:
        self.net.up()
        h = self.net.hosts
        self.tls = make_tls(self.tmp / "tls", names=NODES, ips=(*(h[f"h{i}"].ip for i in (1, 2, 3)), "127.0.0.1"))
        for host in PLACEMENT:
            self._install(host)
        return self

    def etc(self, host: str) -> Path:
        return self.tmp / host / "etc" / "chorus"

    def _install(self, host: str) -> None:
        """/etc/chorus of ``host``: chorus.env, deploy/nats/ (with this host's certificate and store paths, and the
        test's ledger user in auth.conf), nats/node.conf linking to this node's file, as install.sh does."""
        etc = self.etc(host)
        (etc.parent.parent / "opt").mkdir(parents=True, exist_ok=True)
        shutil.copytree(ROOT / "deploy" / "nats", etc / "nats")
        tls_dir, state = self.tmp / host / "tls", self.tmp / host / "var" / "lib" / "nats"
        shutil.copytree(self.tls.cert.parent, tls_dir)
        for conf in (etc / "nats").glob("*.conf"):
            text = conf.read_text().replace("/etc/nats/tls/", f"{tls_dir}/").replace("/var/lib/nats/", f"{state}/")
            if conf.name == "auth.conf":  # the test's observer, with every permission, beside the shipped users
                text = text.replace("\n    ]\n  }\n}", f"\n      {{ user: {LEDGER}, password: "
                                    f"${password_env(LEDGER)} }}\n    ]\n  }}\n}}")
            conf.write_text(text)
        node = next((i for s, i in PLACEMENT[host] if s == "nats-server"), None)
        if node is not None:
            (etc / "nats" / "node.conf").symlink_to(f"nats-{node}.conf")
        env = read_env_file((ROOT / "deploy" / "systemd" / "chorus.env").read_text())
        env.update({"CHORUS_CONFIG": str(self.config), "CHORUS_NATS_URL": CLIENT_URL, "CHORUS_NATS_ADDR": "nats-1:4222",
                    "CHORUS_RUN__DIR": str(self.tmp / "runs"), "CHORUS_RUN__ID": self.run_id,
                    "XDG_CACHE_HOME": str(self.tmp / "runs" / "_xdg_cache"), "MPLCONFIGDIR": str(self.tmp / "mpl")})
        (etc / "chorus.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))

    @property
    def config(self) -> Path:
        return self.tmp / "run.yaml"

    def write_config(self, base: Path) -> Path:
        """``base`` (a tiny run config) on this cluster: the three servers' URLs, replicas 3 on the tagged nodes, each
        kind its own user, the test CA."""
        cfg = yaml.safe_load(base.read_text())
        cfg["nats"] = {"url": CLIENT_URL, "replicas": 3, "placement_tags": ["chorus"], "user": "{service}",
                       "tls_ca": str(self.tls.ca), "connect_timeout_s": 10.0, "ping_interval_s": 3.0,
                       "jetstream_check_s": 2.0}
        for section, values in self.config_overrides.items():
            cfg.setdefault(section, {}).update(values)
        self.config.write_text(yaml.safe_dump(cfg))
        return self.config

    # --- processes ---------------------------------------------------------------------------------------------------
    def _argv(self, key: str) -> list[str]:
        host, service, instance = self.where[key]
        etc, prefix = self.etc(host), self.tmp / host / "opt"
        unit = Unit.read("nats-server" if service == "nats-server" else f"chorus-{service}@")
        env = {"PATH": SYSTEM_PATH, "HOME": str(self.tmp / host), **unit.env(etc)}
        if service == "nats-server":
            env.update({password_env(k): pw for k, pw in self.passwords.items()})
        else:
            env[password_env(service)] = self.passwords[service]  # its own kind's, and no other
        argv = unit.argv(instance, env, prefix, etc)
        ns = self.net.hosts[host].ns
        if service == "actions":  # PrivateNetwork=yes: a loopback of its own, NATS through the socket proxy
            ns = self._actions_network(host, instance, env)
        envs = [f"{k}={v}" for k, v in env.items()]
        cwd = unit.section.get("WorkingDirectory", "/opt/chorus").replace("/opt/chorus", str(prefix))
        return ["ip", "netns", "exec", ns, "env", "-i", *envs, "sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", cwd,
                *argv]

    def _actions_network(self, host: str, instance: str, env: dict[str, str]) -> str:
        """chorus-actions-nats@.socket (127.0.0.1:4222 bound inside the actions unit's private network) and
        chorus-actions-nats@.service (systemd-socket-proxyd in the host's network, to CHORUS_NATS_ADDR)."""
        private = getattr(self, "_private", None) or self.net.private(host, "actions")
        self._private = private
        if PROXY not in self.sup.children or not self.sup.children[PROXY].alive():
            self._start_proxy(host, instance)
        return private

    def _start_proxy(self, host: str = "h1", instance: str = "0") -> Child:
        unit = Unit.read("chorus-actions-nats@")
        proxy = unit.argv(instance, unit.env(self.etc(host)), self.tmp / host / "opt", self.etc(host))
        argv = ["ip", "netns", "exec", self._private, sys.executable, str(Path(__file__).with_name("socketproxy.py")),
                "127.0.0.1:4222", self.net.hosts[host].ns, *proxy]
        return self.sup.start(PROXY, argv)

    def start(self, service: str, model: str | None = None, instance: str = "0") -> Child:
        return self.start_key(f"{service}-{model}-{instance}" if model else f"{service}-{instance}")

    def start_key(self, key: str) -> Child:
        self.stopped.discard(key)
        if key == PROXY:
            return self._start_proxy()
        return self.sup.start(key, self._argv(key))

    def start_nats(self) -> None:
        """The three NATS nodes, supervised apart from the services (a node is killed and started by the fault
        harness through :attr:`broker`)."""
        for key in ("nats-1", "nats-2", "nats-3"):
            self.nats.start(key, self._argv(key))

    @property
    def broker(self) -> HostBroker:
        return HostBroker([HostNode(self, f"nats-{i}") for i in (1, 2, 3)], self.observer_url)

    def cut(self, host: str, port: int | None = None) -> None:
        self.net.cut(host, port=port)

    def heal(self, host: str) -> None:
        self.net.heal(host)

    def start_all(self, models: list[str], **_: Any) -> None:
        """Every unit of the placement, the coordinator last (its NATS nodes are started by :meth:`start_nats`)."""
        assert models == MODELS, models
        keys = [k for k in self.where if not k.startswith("nats-")]
        for key in sorted(keys, key=lambda k: k.startswith("coordinator")):
            self.start_key(key)

    def kill(self, key: str, sig: int = signal.SIGKILL) -> None:
        child = self.sup.children[key]
        if child.alive():
            os.kill(child.popen.pid, sig)

    async def stop_all(self, timeout_s: float = 30.0) -> dict[str, int]:
        return await self.sup.stop_all(timeout_s)

    def logs(self, lines: int = 30) -> str:
        children = {**self.nats.children, **self.sup.children}
        return "\n".join(f"--- {k} ({self.where.get(k, ('h1',))[0]})\n{c.tail(lines)}" for k, c in children.items())

    def host_of(self, key: str) -> str:
        return self.where[key][0]

    # --- the test's view ---------------------------------------------------------------------------------------------
    @property
    def observer_url(self) -> str:
        """The three servers by address, from the machine's own namespace."""
        return ",".join(f"tls://{self.net.hosts[f'h{i}'].ip}:4222" for i in (1, 2, 3))

    def ledger_options(self) -> dict[str, Any]:
        return {"user": LEDGER, "password": self.passwords[LEDGER], "tls": ssl.create_default_context(
            cafile=str(self.tls.ca))}

    def close(self) -> None:
        for c in [*self.sup.children.values(), *self.nats.children.values()]:
            if c.alive():
                c.popen.kill()
                c.popen.wait()
        self.net.close()


@dataclass
class HostNode:
    """A NATS node of the deployment, as the fault harness's :class:`tests.faults.harness.Broker` nodes are used."""

    deployment: HostDeployment
    key: str

    @property
    def child(self) -> Child:
        return self.deployment.nats.children[self.key]

    def kill(self) -> None:
        if self.child.alive():
            self.child.popen.kill()
            self.child.popen.wait()

    def start(self) -> None:
        self.deployment.nats.start(self.key, self.deployment._argv(self.key))

    def signal(self, sig: int) -> None:
        if self.child.alive():
            self.child.popen.send_signal(sig)


@dataclass
class HostBroker:
    nodes: list[HostNode]
    url: str

    def stop(self) -> None:
        for n in self.nodes:
            if n.child.alive():
                n.child.popen.terminate()
                n.child.popen.wait(timeout=30)
