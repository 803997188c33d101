"""What every config section shares: the strict base model, the error type, and paths read as the config file
means them."""

from __future__ import annotations

import re
from contextvars import ContextVar
from pathlib import Path

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration problem, with the file and the dotted path of the bad key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


FUNCTION_SPEC = re.compile(r"^(?P<path>.+\.py):(?P<name>[A-Za-z_][A-Za-z0-9_]*)$")
# The directory of the config file being loaded: a relative workflow.function is looked up there first.
CONFIG_DIR: ContextVar[Path | None] = ContextVar("chorus_config_dir", default=None)


def resolve_path(path: Path) -> Path:
    """A relative path as the config file means it: beside the config file (its directory while it loads), else
    in the working directory when it exists only there, made absolute, since services read a copy of the config
    elsewhere; an absolute path as it is. A path found nowhere is made config-relative: the check before a run
    starts names it."""
    path = Path(path).expanduser()
    if path.is_absolute():
        return path
    config_dir = CONFIG_DIR.get()
    if config_dir is None:
        return path.resolve()
    beside = (config_dir / path).resolve()
    if not beside.exists() and path.exists():
        return path.resolve()
    return beside


def resolve_function(spec: str) -> str:
    """``path.py:name`` with a relative path made absolute when the file is found next to the config or in the
    working directory (services read a copy of the config elsewhere); anything else as it is (its check, and a
    missing file when the coordinator loads it, report it)."""
    m = FUNCTION_SPEC.match(spec)
    if m is None:
        return spec
    path = Path(m["path"]).expanduser()
    if path.is_absolute():
        return spec
    config_dir = CONFIG_DIR.get()
    for base in ([config_dir] if config_dir is not None else []) + [Path.cwd()]:
        if (base / path).is_file():
            return f"{(base / path).resolve()}:{m['name']}"
    return spec
