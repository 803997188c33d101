"""Hosts on one machine: a network namespace per host, each with its own address on one bridge (the bridge in a
namespace of its own, so nothing of the machine's own network changes but one veth for the test's observer), names
in each host's /etc/hosts (`ip netns exec` binds /etc/netns/<ns>/hosts over it), and partitions made with iptables
inside a host's namespace, only ever naming addresses of hosts made here. Needs root."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

CHAIN = "CHORUS_CUT"  # a host's partition rules live in this chain; healing flushes it


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 10.213.0.0/16 that no route of this machine uses."""
    routes = sh("ip", "-4", "route", "show", "table", "all").stdout
    used = [ipaddress.ip_network(w, strict=False) for w in routes.split() if "/" in w and w[0].isdigit()]
    for third in secrets.SystemRandom().sample(range(1, 255), 254):
        net = ipaddress.ip_network(f"10.213.{third}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free /24 in 10.213.0.0/16 for the test's hosts")


def ensure_iptables() -> None:
    """iptables, installed from Debian's package where it is missing (a fresh machine; CI runs as root)."""
    if shutil.which("iptables"):
        return
    if not shutil.which("apt-get"):
        raise RuntimeError("the host deployment partitions hosts with iptables: install it (no apt-get here)")
    print("no iptables: installing Debian's iptables (apt-get)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "iptables"]):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()[-2000:]}")
    if not shutil.which("iptables"):
        raise RuntimeError("apt-get installed iptables, but no iptables is on PATH")


STALE = re.compile(r"^ch[0-9a-f]{4}-\S+")


STALE_AFTER_S = 600.0  # a namespace younger than this may be another deployment's, made a moment ago


def _age_s(ns: str) -> float:
    try:
        return time.time() - (Path("/var/run/netns") / ns).stat().st_mtime
    except OSError:
        return float("inf")


def sweep_stale() -> list[str]:
    """Namespaces, links and /etc/netns files a killed test run of this harness left (its name pattern, no process
    left in them, and made over :data:`STALE_AFTER_S` ago: another deployment on this machine may be starting);
    returns the namespaces removed."""
    removed, live = [], set()
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        if not STALE.match(ns):
            continue
        if _age_s(ns) > STALE_AFTER_S and not sh("ip", "netns", "pids", ns, check=False).stdout.strip():
            sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
            removed.append(ns)
        else:
            live.add(ns[:6])
    for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
        if re.fullmatch(r"ch[0-9a-f]{4}obsa", name) and name[:6] not in live:  # an observer link of no deployment
            sh("ip", "link", "del", name, check=False)
    return removed


@dataclass
class Host:
    name: str  # h1, h2, ...
    ns: str  # the network namespace
    ip: str
    aliases: tuple[str, ...] = ()  # other names of it in every host's /etc/hosts (nats-1, ...)

    def exec(self, *argv: str) -> list[str]:
        """``argv`` run inside this host: its network, its /etc/hosts."""
        return ["ip", "netns", "exec", self.ns, *argv]


@dataclass
class Network:
    """``hosts`` (name -> aliases) on one bridge; :meth:`close` removes every namespace, link and file it made."""

    names: dict[str, tuple[str, ...]]
    prefix: str = field(default_factory=lambda: "ch" + secrets.token_hex(2))
    hosts: dict[str, Host] = field(default_factory=dict)
    observer_ip: str = ""  # the test's own address on the bridge, in the machine's namespace

    def __post_init__(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("the host deployment makes network namespaces: run as root (CI does)")
        ensure_iptables()
        self.net = _free_subnet()
        self.switch = f"{self.prefix}-sw"
        self._made: list[str] = []

    def up(self) -> Network:
        addrs = list(self.net.hosts())
        sh("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        self._in(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        self._in(self.switch, "ip", "link", "set", "br0", "up")
        for i, (name, aliases) in enumerate(self.names.items(), start=1):
            ns = f"{self.prefix}-{name}"
            sh("ip", "netns", "add", ns)
            self._made.append(ns)
            self._link(f"{self.prefix}{name}", ns, f"{addrs[i]}/{self.net.prefixlen}")
            self._in(ns, "ip", "link", "set", "lo", "up")
            self._in(ns, "iptables", "-N", CHAIN)
            self._in(ns, "iptables", "-I", "INPUT", "-j", CHAIN)
            self._in(ns, "iptables", "-I", "OUTPUT", "-j", CHAIN)
            self.hosts[name] = Host(name, ns, str(addrs[i]), aliases)
        # the observer: a veth whose end stays in the machine's namespace (the test process)
        self.observer_ip = str(addrs[-1])
        self._link(f"{self.prefix}obs", None, f"{self.observer_ip}/{self.net.prefixlen}")
        lines = ["127.0.0.1 localhost"] + [f"{h.ip} {h.name} {' '.join(h.aliases)}".strip()
                                           for h in self.hosts.values()]
        for h in self.hosts.values():
            etc = Path("/etc/netns") / h.ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(lines) + "\n")
        return self

    def _in(self, ns: str, *argv: str) -> None:
        sh("ip", "netns", "exec", ns, *argv)

    def _link(self, name: str, ns: str | None, cidr: str) -> None:
        """A veth from the bridge to ``ns`` (None: the machine's own namespace) with address ``cidr``."""
        outer, inner = f"{name}b", f"{name}a"
        sh("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
        sh("ip", "link", "set", outer, "netns", self.switch)
        self._in(self.switch, "ip", "link", "set", outer, "master", "br0")
        self._in(self.switch, "ip", "link", "set", outer, "up")
        if ns is None:
            self._observer_link = inner
            sh("ip", "addr", "add", cidr, "dev", inner)
            sh("ip", "link", "set", inner, "up")
        else:
            sh("ip", "link", "set", inner, "netns", ns)
            self._in(ns, "ip", "link", "set", inner, "name", "eth0")
            self._in(ns, "ip", "addr", "add", cidr, "dev", "eth0")
            self._in(ns, "ip", "link", "set", "eth0", "up")

    def private(self, host: str, name: str) -> str:
        """A namespace with nothing but a loopback (systemd's PrivateNetwork=yes for a unit on ``host``)."""
        ns = f"{self.prefix}-{host}-{name}"
        sh("ip", "netns", "add", ns)
        self._made.append(ns)
        self._in(ns, "ip", "link", "set", "lo", "up")
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path("/etc/netns") / self.hosts[host].ns / "hosts", etc / "hosts")
        return ns

    # --- partitions ----------------------------------------------------------------------------------------------
    def cut(self, host: str, *, port: int | None = None) -> None:
        """Drop every packet between ``host`` and every other host (``port``: only TCP to or from that port);
        the observer keeps seeing it."""
        h = self.hosts[host]
        for other in self.hosts.values():
            if other is h:
                continue
            for direction, addr in (("-s", other.ip), ("-d", other.ip)):
                match = ["-p", "tcp", "-m", "multiport", "--ports", str(port)] if port else []
                self._in(h.ns, "iptables", "-A", CHAIN, direction, addr, *match, "-j", "DROP")

    def heal(self, host: str) -> None:
        self._in(self.hosts[host].ns, "iptables", "-F", CHAIN)

    def close(self) -> None:
        for ns in reversed(self._made):
            with contextlib.suppress(RuntimeError):
                for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), 9)
            sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        if getattr(self, "_observer_link", None):
            sh("ip", "link", "del", self._observer_link, check=False)
