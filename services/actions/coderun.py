"""Run untrusted code and its assert tests in a forked child of the action worker.

The child gets its own process group, no stdin, a capped output and file size, a CPU-time backstop and the
worker's address-space limit; it dies with the worker. It reports the code and every test as a JSON line on a
pipe, so a timeout or a crash still keeps the credit of the tests that finished. Nothing the code does
(``sys.exit``, ``os._exit``, an infinite loop, a memory bomb, writing to fd 1) reaches the worker's protocol.
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import json
import math
import os
import resource
import secrets
import select
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

STDOUT_LIMIT = 4096  # bytes of the code's output kept in the result
ERROR_LIMIT = 500  # characters of one error message
FILE_LIMIT = 16 * 1024 * 1024  # largest file the code may write (in its scratch directory)
PR_SET_PDEATHSIG = 1
RESULT_FD = 3


def parse_tests(tests: str) -> tuple[list[ast.stmt], int]:
    """The top-level statements of ``tests`` and how many are ``assert`` (each one a test)."""
    try:
        body = ast.parse(tests, "<tests>").body
    except SyntaxError as exc:
        raise ValueError(f"run_code 'tests' do not parse: {exc.msg} (line {exc.lineno})") from None
    total = sum(isinstance(s, ast.Assert) for s in body)
    if total == 0:
        raise ValueError("run_code 'tests' have no top-level assert statement: each assert is one test")
    return body, total


def _describe(exc: BaseException, where: str = "") -> str:
    try:
        detail = str(exc)
    except Exception:  # the code's own exception class may fail to print
        detail = ""
    text = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
    if where:
        text = f"{text} in `{where}`"
    return text[:ERROR_LIMIT]


def _send(obj: dict[str, Any], nonce: str) -> None:
    data = (json.dumps({**obj, "nonce": nonce}) + "\n").encode()
    while data:
        data = data[os.write(RESULT_FD, data):]


def _child_setup(scratch: str, res_w: int, out_w: int, cpu_s: float, parent: int) -> None:
    """Isolate the child: own process group, dies with the worker, fds 0-2 redirected, limits set."""
    os.setpgid(0, 0)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the CPU limit below still ends a runaway child
        pass
    if os.getppid() != parent:  # the worker died before prctl took effect
        os._exit(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_w, 1)
    os.dup2(out_w, 2)
    os.dup2(res_w, RESULT_FD, inheritable=False)  # programs the code starts do not get the result pipe
    # The worker's protocol pipes and anything else inherited stay out of the code's reach.
    os.closerange(RESULT_FD + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    sys.stdin = open(0, closefd=False)  # lives until os._exit
    sys.stdout = sys.stderr = open(1, "w", closefd=False, buffering=1)
    os.chdir(scratch)
    _lower(resource.RLIMIT_CPU, math.ceil(cpu_s) + 1)
    _lower(resource.RLIMIT_FSIZE, FILE_LIMIT)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # too big a file: an OSError in the code, not a kill


def _lower(kind: int, value: int) -> None:
    """Set a resource limit to ``value``, never above the hard limit already in place."""
    _, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))


def _flush() -> None:
    """Flush the code's buffered output before the final report, so the parent reads all of it."""
    try:
        sys.stdout.flush()
    except Exception:  # the code may have replaced or closed sys.stdout
        pass


def _child_run(code: str, tests: list[ast.stmt], nonce: str) -> None:
    """Exec the code, then each top-level test statement on its own, reporting every step."""
    ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(code, "<solution>", "exec", optimize=0), ns)  # running untrusted code is the point
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: the code must not end the run
        ns.clear()  # a memory bomb's objects go before the report is written
        _flush()
        _send({"event": "code", "error": _describe(exc)}, nonce)
        return
    _send({"event": "code", "error": None}, nonce)
    for stmt in tests:
        where = ast.unparse(stmt)[:200]
        try:
            exec(compile(ast.Module([stmt], []), "<tests>", "exec", optimize=0), ns)
            error = None
        except BaseException as exc:
            error = _describe(exc, where)
        if isinstance(stmt, ast.Assert):
            _send({"event": "test", "ok": error is None, "error": error}, nonce)
        elif error is not None:
            _send({"event": "setup", "error": error}, nonce)
    _flush()
    _send({"event": "done"}, nonce)


def _status(wait_status: int) -> str:
    if os.WIFSIGNALED(wait_status):
        sig = os.WTERMSIG(wait_status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        hint = " (CPU time limit)" if sig == signal.SIGXCPU else ""
        return f"the code process was killed by {name}{hint} before finishing"
    return f"the code process exited with status {os.WEXITSTATUS(wait_status)} before finishing"


def run_code(code: str, tests: str, timeout_s: float) -> dict[str, Any]:
    """Run ``code`` then each top-level assert of ``tests``; partial credit is tests_passed / tests_total."""
    body, total = parse_tests(tests)
    scratch = tempfile.mkdtemp(prefix="chorus-code-")
    res_r, res_w = os.pipe()
    out_r, out_w = os.pipe()
    parent = os.getpid()
    # Reports carry a secret of this run, so code that writes to the result pipe cannot forge passing tests.
    nonce = secrets.token_hex(16)
    pid = os.fork()
    if pid == 0:  # the child never returns into the worker
        try:
            os.close(res_r)
            os.close(out_r)
            _child_setup(scratch, res_w, out_w, timeout_s, parent)
            _child_run(code, body, nonce)
        except BaseException:  # whatever happened, the child must not outlive this block
            os._exit(70)
        os._exit(0)
    os.close(res_w)
    os.close(out_w)
    try:
        events, stdout, timed_out = _collect(res_r, out_r, timeout_s, nonce)
    finally:
        status = _reap(pid)
        os.close(res_r)
        os.close(out_r)
        shutil.rmtree(scratch, ignore_errors=True)
    return _result(events, stdout, timed_out, total, timeout_s, status)


def _collect(res_r: int, out_r: int, timeout_s: float, nonce: str) -> tuple[list[dict[str, Any]], bytes, bool]:
    """Read result lines and output until the child closes its result pipe or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    buf, out = b"", b""
    events: list[dict[str, Any]] = []
    open_fds = [res_r, out_r]
    finished = False
    while res_r in open_fds and not finished:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select(open_fds, [], [], left)
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.remove(fd)
            elif fd == res_r:
                *lines, buf = (buf + chunk).split(b"\n")
                events += _parse(lines, nonce)
                finished = any(_final(e) for e in events)
            elif len(out) <= STDOUT_LIMIT:
                out += chunk
    timed_out = res_r in open_fds and not finished
    while out_r in open_fds and select.select([out_r], [], [], 0)[0]:  # what is already written
        chunk = os.read(out_r, 65536)
        if not chunk:
            break
        if len(out) <= STDOUT_LIMIT:
            out += chunk
    return events, out, timed_out


def _parse(lines: list[bytes], nonce: str) -> list[dict[str, Any]]:
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("nonce") == nonce:
            events.append(event)
    return events


def _final(event: dict[str, Any]) -> bool:
    """The child's last report: all tests ran, or the code itself failed."""
    return event.get("event") == "done" or (event.get("event") == "code" and bool(event.get("error")))


def _reap(pid: int) -> int:
    """Kill the child's process group (it may have started others) and return the child's wait status."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _, status = os.waitpid(pid, 0)
    return status


def _result(events: list[dict[str, Any]], stdout: bytes, timed_out: bool, total: int, timeout_s: float,
            status: int) -> dict[str, Any]:
    tests = [e for e in events if e.get("event") == "test"]
    passed = sum(bool(e.get("ok")) for e in tests)
    finished = any(_final(e) for e in events)
    errors = [e["error"] for e in events if e.get("error")]
    if timed_out:
        errors.insert(0, f"timeout after {timeout_s:g}s")
    elif not finished:
        errors.insert(0, _status(status))
    text = stdout[:STDOUT_LIMIT].decode("utf-8", errors="replace")
    if len(stdout) > STDOUT_LIMIT:
        text += "\n...[output truncated]"
    error = errors[0] if errors else None
    return {
        "passed": error is None and passed == total,
        "tests_passed": passed,
        "tests_total": total,
        "reward": passed / total,
        "error": error,
        "stdout": text,
    }
