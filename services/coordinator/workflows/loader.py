"""User workflows: an ``async def`` loaded from a file named by ``workflow.function`` (``path.py:name``)."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import cast

from services.coordinator.workflows.api import Workflow
from shared.kernel.config import ConfigError


def split_spec(spec: str) -> tuple[str, str]:
    """``"dir/file.py:fn"`` -> (``"dir/file.py"``, ``"fn"``)."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise ConfigError(f"workflow.function: expected 'path/to/file.py:function_name', got {spec!r}")
    return path, name


def resolve_file(path: str, base_dirs: list[Path]) -> Path:
    """The file at ``path``: as given when absolute, else the first of ``base_dirs``/path that exists."""
    p = Path(path).expanduser()
    candidates = [p] if p.is_absolute() else [d / p for d in base_dirs]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    looked = ", ".join(str(c) for c in candidates)
    raise ConfigError(f"workflow.function: file {path!r} not found (looked at {looked})")


def load_workflow_function(spec: str, base_dirs: list[Path] | None = None) -> Workflow:
    """Import the user's file by path (never from the package) and return its async workflow function."""
    path_s, name = split_spec(spec)
    path = resolve_file(path_s, base_dirs if base_dirs is not None else [Path.cwd()])
    # One module per file, named by its path, so two user files with the same name do not collide.
    module_name = f"chorus_workflow_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"workflow.function: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ConfigError(f"workflow.function: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(n for n, v in vars(module).items() if inspect.iscoroutinefunction(v))
        raise ConfigError(f"workflow.function: {path} has no function {name!r} (its async functions: {defined})")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"workflow.function: {name!r} in {path} must be an `async def (ctx, task)`, "
                          f"got {type(fn).__name__}")
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise ConfigError(f"workflow.function: {name!r} in {path} must take (ctx, task), got {inspect.signature(fn)}")
    return cast(Workflow, fn)
