"""Run untrusted code against assert tests in a sandbox, with every verdict made where the code cannot reach.

Each top-level ``assert`` of the tests is one test; other top-level statements are setup. A run has two processes:
the code's, which runs the code and then only answers requests, and the tests', which runs the tests. The tests
read the code's top-level names as handles: calling one sends the arguments to the code's process as plain data
and brings the answer back as plain data (or a handle, for an object that is not data), so the code never sees an
expected value, a test's frame or the reporting pipe, and an object of the code is never compared in the tests'
process by its own ``__eq__``. Partial credit is tests_passed / tests_total; a timeout or a crash keeps the
tests that finished.

The sandbox is a set of Linux namespaces with its own root, pids and network, and a uid of its own for each of
the two processes (``sandbox_init``, docs/sandbox.md). Where namespaces do not work, :func:`isolation` says why
(loudly, once) and the two processes are forked children of the worker: limits, but no isolation.
"""

from __future__ import annotations

import functools
import json
import marshal
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from services.actions.sandbox_init import ERROR_LIMIT, LINE_LIMIT, exit_text, run_pair, unisolated_child
from services.actions.verdicts import STDOUT_LIMIT, Plan, Report, plan_tests, result

RESULT_LIMIT = 8 << 20  # bytes of reports read from one run
UID_BASE = 1_600_000_000  # + the host pid of the sandbox's PID 1: a uid no other live sandbox has
REAP_S = 2.0  # how long PID 1 may take to empty its namespace before unshare's process group is killed
UNSHARE_FLAGS = ("--pid", "--fork", "--kill-child", "--net", "--mount", "--ipc", "--uts")
INIT_SOURCE = Path(__file__).with_name("sandbox_init.py").read_text()
log = structlog.get_logger("actions.coderun")


@dataclass(frozen=True)
class Limits:
    """What one run of code may use besides its wall time (the caller's ``timeout_s``)."""

    memory_mb: int = 512  # address space; never above the worker's own limit (actions.memory_mb)
    processes: int = 32  # processes and threads of the sandbox's uid
    scratch_mb: int = 64  # the tmpfs that is cwd, HOME and TMPDIR
    file_bytes: int = 16 << 20  # largest file the code may write
    open_files: int = 64


LIMITS = Limits()


def _collect(res_r: int, out_r: int, deadline: float, report: Report,
             stop_at_final: bool) -> tuple[bytes, bool]:
    """Read reports and output until the result pipe closes (unisolated: the last report) or the deadline."""
    buf, out = b"", b""
    open_fds = [res_r, out_r]
    while res_r in open_fds and not (stop_at_final and report.final):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for fd in select.select(open_fds, [], [], left)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.remove(fd)
            elif fd == res_r:
                *lines, buf = (buf + chunk).split(b"\n")
                for line in lines:
                    if report.size < RESULT_LIMIT:
                        report.feed(line)
                buf = buf if len(buf) < LINE_LIMIT else b""  # an overlong line is dropped
            elif len(out) <= STDOUT_LIMIT:
                out += chunk
    timed_out = res_r in open_fds and not (stop_at_final and report.final)
    while out_r in open_fds and select.select([out_r], [], [], 0)[0]:  # what is already written
        chunk = os.read(out_r, 65536)
        if not chunk:
            break
        if len(out) <= STDOUT_LIMIT:
            out += chunk
    return out, timed_out


def _status(wait_status: int) -> str:
    return f"the tests' process {exit_text(wait_status)} before finishing"


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("chorus-sandbox", os.MFD_CLOEXEC)
    while data:
        data = data[os.write(fd, data):]
    return fd


def _tests_config(plan: Plan) -> bytes:
    """What only the tests' process reads: the steps and the names it binds from the code."""
    return marshal.dumps({"steps": [list(s) for s in plan.steps], "bind": plan.bind})


# --- in namespaces -------------------------------------------------------------------------------------------
def _run_isolated(code: str, plan: Plan, timeout_s: float, limits: Limits) -> dict[str, Any]:
    """Run in fresh namespaces: PID 1 (sandbox_init) builds the root and forks the run, whose tests' process
    reports on the result pipe; the run is over when that pipe closes or at the deadline."""
    root = os.geteuid() == 0  # else a user namespace, where the runner drops its capabilities instead of uid 0
    prefix = os.path.realpath(sys.base_prefix)
    config = marshal.dumps({
        "code": code, "scratch_mb": limits.scratch_mb,
        "uid_base": UID_BASE if root else None,
        "limits": {"cpu_s": math.ceil(timeout_s) + 1, "memory_mb": limits.memory_mb,
                   "processes": limits.processes, "file_bytes": limits.file_bytes,
                   "open_files": limits.open_files},
        "env": {"PATH": f"{prefix}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
                "LANG": "C.UTF-8"},
    })
    cfg, tests = _memfd(config), _memfd(_tests_config(plan))
    (res_r, res_w), (out_r, out_w), (life_r, life_w) = os.pipe(), os.pipe(), os.pipe()
    inner = (cfg, tests, res_w, out_w, life_r)
    user = [] if root else ["--user", "--map-root-user"]
    try:
        proc = subprocess.Popen(
            [shutil.which("unshare") or "unshare", *UNSHARE_FLAGS, *user, os.path.realpath(sys.executable),
             "-I", "-S", "-c", INIT_SOURCE, *map(str, inner)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=inner,
            start_new_session=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd="/")
    except BaseException:
        for fd in (res_r, out_r, life_w):
            os.close(fd)
        raise
    finally:
        for fd in inner:
            os.close(fd)
    report = Report(plan)
    try:
        stdout, timed_out = _collect(res_r, out_r, time.monotonic() + timeout_s, report, stop_at_final=False)
    finally:
        os.close(life_w)  # PID 1 exits, and with it every process of the sandbox
        exit_text = _reap_sandbox(proc)
        os.close(res_r)
        os.close(out_r)
    return result(report, stdout, timed_out, exit_text, timeout_s)


def _reap_sandbox(proc: subprocess.Popen[bytes]) -> str:
    """Wait for unshare, which returns once PID 1, and so the whole namespace, is gone; say how the runner
    ended, from what PID 1 wrote on its stdout (the runner cannot write there)."""
    try:
        proc.wait(REAP_S)
    except subprocess.TimeoutExpired:  # backstop: unshare and PID 1 share this process group
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.stdout is not None
    text = proc.stdout.read(1 << 16).decode(errors="replace")
    proc.stdout.close()
    for line in reversed(text.splitlines()):
        try:
            said = json.loads(line)
        except ValueError:
            continue
        if isinstance(said, dict) and type(said.get("status")) is int:
            return _status(said["status"])
        if isinstance(said, dict) and said.get("lifeline"):
            return "the tests' process closed its result pipe before finishing"
        if isinstance(said, dict) and isinstance(said.get("error"), str):
            return said["error"][:ERROR_LIMIT]
    return f"the sandbox exited with status {proc.returncode}: {text.strip()[-300:] or 'no output'}"


@functools.cache
def isolation() -> tuple[str, str]:
    """How code actions run in this process: ``("namespaces", how)`` or ``("none", why not)``; tried once."""
    mode, reason = "none", ""
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        reason = "no unshare (util-linux) on this system"
    else:
        try:
            trial = _run_isolated("x = 6 * 7", plan_tests("assert x == 42"), 10.0, LIMITS)
            mode, reason = ("namespaces", "unshare " + " ".join(UNSHARE_FLAGS)) if trial["passed"] else (
                "none", f"a trial run in namespaces failed: {trial['error']}")
        except OSError as exc:
            reason = f"unshare could not start: {exc}"
    if mode == "none":
        log.warning(f"code actions run WITHOUT namespace isolation: {reason}")
    return mode, reason


# --- unisolated fallback: a forked child of the worker ------------------------------------------------------
def _run_forked(code: str, plan: Plan, timeout_s: float, limits: Limits) -> dict[str, Any]:
    scratch = tempfile.mkdtemp(prefix="chorus-code-")
    tests = _memfd(_tests_config(plan))
    (res_r, res_w), (out_r, out_w) = os.pipe(), os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child never returns into the worker
        try:
            os.close(res_r)
            os.close(out_r)
            unisolated_child(scratch, res_w, out_w, parent, math.ceil(timeout_s) + 1, limits.file_bytes)
            run_pair(code, tests, res_w, lambda which: None)
        except BaseException:
            os._exit(70)
        os._exit(0)
    os.close(res_w)
    os.close(out_w)
    os.close(tests)
    report = Report(plan)
    try:
        stdout, timed_out = _collect(res_r, out_r, time.monotonic() + timeout_s, report, stop_at_final=True)
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)  # the code may have started others
        except (ProcessLookupError, PermissionError):
            pass
        _, status = os.waitpid(pid, 0)
        os.close(res_r)
        os.close(out_r)
        shutil.rmtree(scratch, ignore_errors=True)
    return result(report, stdout, timed_out, _status(status), timeout_s)


def run_code(code: str, tests: str, timeout_s: float, limits: Limits = LIMITS,
             bind: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``code`` then each top-level assert of ``tests``; partial credit is tests_passed / tests_total.
    ``bind`` names the code's top-level names the tests see (default: each name they read and do not bind)."""
    plan = plan_tests(tests, bind)
    run = _run_isolated if isolation()[0] == "namespaces" else _run_forked
    return run(code, plan, timeout_s, limits)
