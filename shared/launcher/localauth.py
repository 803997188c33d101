"""Credentials of the embedded nats-server of ``chorus up``: one generated password per client kind, so that only
the run's own services can publish on its subjects and write its KV keys, each within its kind's permissions
(``deploy/nats/auth.conf``, the same generated authorization config a cluster uses).

The server reads every password from its environment; each service gets only its own kind's
(:attr:`shared.launcher.supervisor.Supervisor.passwords`); ``chorus up`` connects as ``supervisor``. The read-only
``observer``'s password is written into the run directory (``<run dir>/nats/observer.password``, mode 0600), where
``chorus status``, ``chorus monitor`` and any subscriber find it; no other password is written anywhere. A new start
(``--resume`` too) generates new ones. ``nats.embedded_auth: false`` turns this off (an open server on loopback).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr

from shared.kernel.config import ChorusConfig, NatsSection
from shared.kernel.credentials import KINDS, PLACEHOLDER, password_env
from shared.launcher.natsauth import auth_conf

OBSERVER = "observer"


def new_password() -> str:
    """160 random bits, as letters and digits that start with a letter: nats-server parses the value of a variable
    it reads from its environment as a config value, so one starting with digits could be read as a number or a
    date."""
    return "c" + secrets.token_hex(20)


def password_file(run_dir: Path) -> Path:
    """Where a kind's password is looked for (``{service}`` is the kind); only the observer's is written."""
    return run_dir / "nats" / f"{PLACEHOLDER}.password"


@dataclass(frozen=True)
class LocalAuth:
    passwords: dict[str, str]  # kind -> password

    @classmethod
    def generate(cls) -> LocalAuth:
        """A new password per kind (one already in CHORUS_NATS_PASSWORD_<KIND> is kept: it would win on the client)."""
        return cls({kind: os.environ.get(password_env(kind)) or new_password() for kind in KINDS})

    @staticmethod
    def conf() -> str:
        """The server's authorization config: users per kind, passwords from its environment."""
        return auth_conf()

    def server_env(self) -> dict[str, str]:
        return {password_env(kind): pw for kind, pw in self.passwords.items()}

    def apply(self, cfg: ChorusConfig, run_dir: Path) -> None:
        """Every party of the run connects as its kind's user; the observer's password goes to the run directory."""
        cfg.nats.user, cfg.nats.password, cfg.nats.token = PLACEHOLDER, None, None
        cfg.nats.nkey_seed = cfg.nats.creds = None
        pattern = password_file(run_dir)
        cfg.nats.password_file = str(pattern)
        observer = Path(str(pattern).replace(PLACEHOLDER, OBSERVER))
        observer.parent.mkdir(parents=True, exist_ok=True)
        _write_secret(observer, self.passwords[OBSERVER] + "\n", None, 0o600)

    def as_kind(self, nats: NatsSection, kind: str) -> NatsSection:
        """``nats`` with ``kind``'s password in it (for a connection made in this process)."""
        return nats.model_copy(update={"password": SecretStr(self.passwords[kind]), "password_file": None})


def write_generated(out: Path, *, open_server: bool = False, owner: int | None = None) -> LocalAuth:
    """Credentials for a deployment that makes them at start (the compose stack's one-shot ``credentials``):
    ``out/server/auth.conf`` with the passwords written in (no users at all with ``open_server``) and
    ``out/<kind>/password`` for every kind, each readable by ``owner`` (a uid) only. A kind's directory is its own
    volume in docker-compose.yml, mounted by that kind's containers only."""
    auth = LocalAuth({kind: new_password() for kind in KINDS})
    server = out / "server"
    server.mkdir(parents=True, exist_ok=True)
    conf = "# an open server: `chorus nats-auth --generate --auth none`\n" if open_server else auth_conf(auth.passwords)
    _write_secret(server / "auth.conf", conf, None, 0o600)
    for kind, password in auth.passwords.items():
        (out / kind).mkdir(parents=True, exist_ok=True)
        _write_secret(out / kind / "password", password + "\n", owner, 0o400)
    return auth


def _write_secret(path: Path, text: str, owner: int | None, mode: int) -> None:
    path.unlink(missing_ok=True)  # a file of the last start may be read-only
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    if owner is not None:
        os.chown(path, owner, owner)
    os.chmod(path, mode)
