"""Loading a run config: YAML, ``CHORUS_*`` environment overrides over it, and errors that name the bad key's
path (and the environment variable that set it)."""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_settings import SettingsError

from shared.kernel.config.base import CONFIG_DIR, ConfigError
from shared.kernel.config.root import ChorusConfig

ENV_PREFIX = "CHORUS_"


def env_variable(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """The ``CHORUS_*`` environment variable that set the key at ``loc`` (or a section holding it, as JSON), if
    one is set: an error in it is the variable's, not the YAML file's."""
    present = {k.upper(): k for k in os.environ if k.upper().startswith(ENV_PREFIX)}
    parts = [str(p).upper() for p in loc]
    for n in range(len(parts), 0, -1):
        name = ENV_PREFIX + "__".join(parts[:n])
        if name in present:
            return present[name]
    return None


def _unwrap(annotation: Any) -> Any:
    """``X | None`` -> ``X``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner[0] if len(inner) == 1 else annotation
    return annotation


def known_keys(loc: tuple[int | str, ...] | list[int | str]) -> list[str]:
    """The keys the config section at ``loc`` (keys, model or agent names, list indices) accepts; [] where the
    keys are free names (models, agents)."""
    annotation: Any = ChorusConfig
    for part in loc:
        annotation = _unwrap(annotation)
        if typing.get_origin(annotation) in (dict, list):
            annotation = typing.get_args(annotation)[-1]  # ``part`` is a model or agent name, or a list index
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel) and str(part) in annotation.model_fields:
            annotation = annotation.model_fields[str(part)].annotation
        else:
            return []
    annotation = _unwrap(annotation)
    return list(annotation.model_fields) if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []


def _format_error(exc: ValidationError, source: str) -> str:
    errors = exc.errors()
    found = [env_variable(err["loc"]) if source != "<kv>" and err["loc"] else None for err in errors]
    lines = ["invalid config from the environment:" if all(found) else f"invalid config {source}:"]
    for err, var in zip(errors, found, strict=True):
        path = ".".join(str(p) for p in err["loc"])
        # the environment overrides the file: name the variable that was read
        env = "" if var is None else f" (environment variable {var}={os.environ.get(var)!r})"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "value_error":
            if not path:
                lines.append(f"  {msg}")  # a check across sections names its keys itself
                continue
            key = re.match(r"^(\w+): ", msg)
            if key:  # a section's check names its key first: give its whole path
                lines.append(f"  {path}.{key.group(1)}{env}: {msg[key.end():]}")
                continue
        path = path or "<root>"
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(err["loc"][-1]), known_keys(err["loc"][:-1]), n=1, cutoff=0.6)
            where = ".".join([*(str(p) for p in err["loc"][:-1]), close[0]]) if close else ""
            msg = (f"unknown key, did you mean {where}?" if close else
                   "unknown key (check the spelling against configs/ and docs/config.md)")
        elif err["type"] == "missing":
            msg = "required key is missing"
        got = err.get("input")
        hint = "" if err["type"] in ("extra_forbidden", "missing") or isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"  {path}{env}: {msg}{hint}")
    return "\n".join(lines)


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> ChorusConfig:
    """Load a YAML run config, apply ``CHORUS_*`` environment overrides, validate it."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: expected a mapping at the top, got {type(loaded).__name__}")
        data = loaded
    data = deep_merge(data, overrides)
    token = CONFIG_DIR.set(Path(path).resolve().parent if path is not None else None)
    try:
        return ChorusConfig(**data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, source)) from None
    except SettingsError as exc:  # a CHORUS_<SECTION> variable that is not valid JSON
        field = re.search(r'field "(\w+)"', str(exc))
        var = env_variable([field.group(1)]) if field else None
        where = f"environment variable {var}={os.environ.get(var)!r}" if var else "the environment"
        raise ConfigError(f"invalid config from {where}: {exc.__cause__ or exc} (a whole section is JSON, e.g. "
                          f"{ENV_PREFIX}NATS='{{\"url\": \"nats://host:4222\"}}'; one key is "
                          f"{ENV_PREFIX}NATS__URL=nats://host:4222)") from None
    except ValueError as exc:
        raise ConfigError(f"invalid config {source}: {exc}") from None
    finally:
        CONFIG_DIR.reset(token)


def config_from_yaml_text(text: str) -> ChorusConfig:
    """Rebuild a config from :meth:`ChorusConfig.dump_yaml` output (e.g. read from the run's KV)."""
    data = yaml.safe_load(text)
    try:
        return ChorusConfig(**data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, "<kv>")) from None


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` over it, nested dicts merged key by key (neither is changed)."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out
