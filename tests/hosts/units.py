"""deploy/systemd/ without systemd: a unit's ExecStart, EnvironmentFile and WorkingDirectory read from the shipped file
and turned into the command systemd would run, with install.sh's prefix (/opt/chorus, /etc/chorus) mapped to this
checkout's venv and the test's directories. Only what these units use: %i and %% specifiers, $$, ${VAR} from the
environment file, systemd's quoting (as POSIX shell words), and the environment file's KEY=VALUE lines."""

from __future__ import annotations

import configparser
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import ROOT

SYSTEMD = ROOT / "deploy" / "systemd"
PREFIX = "/opt/chorus"
ETC = "/etc/chorus"


def read_env_file(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip().strip('"')
    return out


def expand(word: str, instance: str, env: dict[str, str]) -> str:
    """systemd's specifiers and variables in one ExecStart word."""
    def one(m: re.Match[str]) -> str:
        token = m.group(0)
        if token == "$$":
            return "$"
        if token == "%%":
            return "%"
        if token == "%i":
            return instance
        return env.get(m.group(1), "")

    return re.sub(r"\$\$|\$\{(\w+)\}|%%|%i", one, word)


@dataclass(frozen=True)
class Unit:
    name: str  # chorus-trainer@, nats-server
    section: dict[str, str]

    @classmethod
    def read(cls, name: str) -> Unit:
        parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        parser.read_string((SYSTEMD / f"{name}.service").read_text())
        return cls(name, dict(parser["Service"]))

    def argv(self, instance: str, env: dict[str, str], prefix: Path, etc: Path) -> list[str]:
        """The command of ExecStart for ``instance``, install.sh's paths mapped: ``/opt/chorus/.venv/bin`` to this
        Python's bin, ``/opt/chorus`` to ``prefix``, ``/etc/chorus`` to ``etc``."""
        bin_dir = str(Path(sys.executable).parent)
        words = [expand(w, instance, env) for w in shlex.split(self.section["ExecStart"])]
        return [w.replace(f"{PREFIX}/.venv/bin", bin_dir).replace(PREFIX, str(prefix)).replace(ETC, str(etc))
                for w in words]

    def env(self, etc: Path) -> dict[str, str]:
        """The unit's EnvironmentFile (install.sh's /etc/chorus/chorus.env), read from ``etc``."""
        out: dict[str, str] = {}
        for spec in self.section.get("EnvironmentFile", "").split():
            path = Path(spec.lstrip("-").replace(ETC, str(etc)))
            if path.is_file():
                out.update(read_env_file(path.read_text()))
            elif not spec.startswith("-"):
                raise FileNotFoundError(f"{self.name}: EnvironmentFile {path} is missing")
        return out

    @property
    def restart_s(self) -> float:
        return float(self.section.get("RestartSec", "0").rstrip("s") or 0)
