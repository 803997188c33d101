"""The inside of a run_code sandbox: PID 1 of its namespaces, the runner, and the harness that runs the code.

coderun starts it as ``unshare --pid --fork --kill-child --net --mount --ipc --uts python -I -S -c <this file>
CONFIG_FD TESTS_FD RESULT_FD OUTPUT_FD LIFELINE_FD``. As PID 1 it builds a root on a tmpfs (the host's system
directories and Python prefix read-only, a fresh /proc, three devices, a size-capped scratch tmpfs), chroots
into it and forks the runner, which takes its limits, a uid of its own and no new privileges before it runs
anything. PID 1 reports the runner's wait status on its own stdout and exits when the runner exits or the
lifeline closes; as PID 1 its exit kills every process left in the namespace.

Stdlib only and self-contained: it runs as a script, without site or package. Nothing that comes out of the
runner is trusted: coderun reads probe values with :func:`decode` (the other half of :func:`encode`, kept here
so the codec lives in one place) and computes every verdict outside. coderun's unisolated fallback imports
:func:`run_steps` and :func:`unisolated_child` from here.
"""

from __future__ import annotations

import _signal  # signal without its enums: this file runs at every sandbox start, where imports are its cost
import builtins
import ctypes
import marshal
import os
import resource
import select
import sys

TYPE_CHECKING = False  # typing is not imported at a sandbox's start: only mypy reads its cast
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, cast
else:
    def cast(_type, value):  # noqa: ANN001, ANN202
        return value

RESULT_FD = 3  # where the tests' process writes its JSON lines (never inherited by programs the code starts)
TESTS_UID_OFFSET = 1 << 22  # the tests' process runs as the code's uid + this (host pids stay below 2**22)
ERROR_LIMIT = 500  # characters of one error message
LINE_LIMIT = 1 << 20  # bytes of one encoded report; a bigger value is an error
MAX_DEPTH = 32  # nesting of a reported value
MAX_INT_BITS = 13_000  # ints print with at most 4300 digits (sys.int_info.default_max_str_digits)
NEW_ROOT = "/tmp"  # where the new root is staged, in this mount namespace only
HOST_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # bound (or linked) read-only
HOST_FILES = ("/etc/ld.so.cache",)
DEVICES = ("null", "zero", "urandom")
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECUREBITS, PR_CAPBSET_DROP, PR_CAP_AMBIENT = 1, 38, 28, 24, 47
PR_SET_DUMPABLE = 4
SECBITS_LOCKED_NOROOT = 0x2F  # noroot, no setuid fixup, keep-caps off: each with its lock
CAP_VERSION_3 = 0x20080522


class Unserialisable(Exception):
    """A value that is not plain builtin data (exact types only), or too big to report."""


def encode(value: object, depth: int = 0, channel: Channel | None = None) -> object:
    """``value`` as tagged JSON data; only exact builtin types pass, so no code of the value's class runs. With a
    ``channel``, anything else crosses as a handle of that channel (a Remote goes home as its own handle)."""
    kind = type(value)
    if depth > MAX_DEPTH:
        raise Unserialisable(f"value nested deeper than {MAX_DEPTH} levels")
    if kind is int and cast(int, value).bit_length() > MAX_INT_BITS:
        raise Unserialisable("int too large to report (over 4000 digits)")
    if value is None or kind is bool or kind is int or kind is str:
        return value
    if kind is float:
        return {"f": repr(value)}
    # casts, not isinstance: isinstance may read a hostile ``__class__``; the exact type was checked
    if kind is bytes:
        return {"b": cast(bytes, value).hex()}
    if kind is list:
        return [encode(v, depth + 1, channel) for v in cast(list, value)]
    if kind is dict:
        return {"d": [[encode(k, depth + 1, channel), encode(v, depth + 1, channel)]
                      for k, v in cast(dict, value).items()]}
    tags: dict[type, str] = {tuple: "t", set: "s", frozenset: "z"}
    tag = tags.get(kind)
    if tag is not None:
        items = cast("tuple[object, ...] | set[object] | frozenset[object]", value)
        return {tag: [encode(v, depth + 1, channel) for v in items]}
    if kind is Remote:
        return {"r": object.__getattribute__(value, "_chorus_id")}
    if channel is None:
        raise Unserialisable(f"unserialisable value of type {kind.__name__}")
    return {"h": channel.export(value)}


def decode(data: object, depth: int = 0, resolve: Callable[[str, object], object] | None = None) -> object:
    """The other side of :func:`encode`: untrusted tagged data rebuilt from builtin types only (and, with
    ``resolve``, handles: ``resolve("h", n)`` the sender's object n, ``resolve("r", n)`` the receiver's own)."""
    kind = type(data)
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deep")
    if data is None or kind is bool or kind is int or kind is str:
        return data
    if kind is list:
        return [decode(v, depth + 1, resolve) for v in cast(list, data)]
    if kind is dict and len(cast(dict, data)) == 1:
        ((tag, v),) = cast(dict, data).items()
        if type(v) is str and tag in ("f", "b"):
            return float(v) if tag == "f" else bytes.fromhex(v)
        if type(v) is list and tag == "d":
            return {decode(k, depth + 1, resolve): decode(x, depth + 1, resolve) for k, x in v}
        if type(v) is list and tag in ("t", "s", "z"):
            return {"t": tuple, "s": set, "z": frozenset}[tag](decode(x, depth + 1, resolve) for x in v)
        if type(v) is int and tag in ("h", "r") and resolve is not None:
            return resolve(tag, v)
    raise ValueError("malformed value")


def describe(exc: BaseException) -> str:
    if type(exc) is CodeError:
        return exc.text
    try:
        detail = str(exc)
    except Exception:  # the code's own exception class may fail to print
        detail = ""
    return (f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__)[:ERROR_LIMIT]


_ESCAPES = {i: f"\\u{i:04x}" for i in (*range(32), *range(0xD800, 0xE000))} | {34: '\\"', 92: "\\\\"}


def to_json(data: object) -> str:
    """JSON of what :func:`encode` makes (None, bool, int, str, lists, str-keyed dicts): the json module would
    cost every sandbox start ~7 ms of imports."""
    if data is None or data is True or data is False:
        return {None: "null", True: "true", False: "false"}[data]
    if type(data) is int:
        return int.__repr__(data)
    if type(data) is str:
        return '"' + data.translate(_ESCAPES) + '"'
    if type(data) is list:
        return "[" + ",".join([to_json(v) for v in data]) + "]"
    if type(data) is dict:
        return "{" + ",".join([to_json(k) + ":" + to_json(v) for k, v in data.items()]) + "}"
    raise Unserialisable(f"unserialisable value of type {type(data).__name__}")


def send(fd: int, report: dict[str, object]) -> None:
    """Write one report as a JSON line; a value too big to report becomes an error."""
    data = to_json(report).encode()
    if len(data) >= LINE_LIMIT:
        error = f"value too large to report (over {LINE_LIMIT} bytes)"
        data = to_json({**report, "value": None, "error": error}).encode()
    data += b"\n"
    while data:
        data = data[os.write(fd, data):]


# --- the channel between the code's process and the tests' process -------------------------------------------
class CodeError(Exception):
    """An error the other process answered with, of a type this side has no builtin for, or its process gone."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text[:ERROR_LIMIT]


# Exceptions rebuilt by name on this side (a ValueError of the code's is a ValueError for the tests); not
# BaseException's others: the code's SystemExit is a CodeError here, it cannot end the tests' process.
BUILTIN_ERRORS = {name: cls for name, cls in vars(builtins).items()
                  if isinstance(cls, type) and issubclass(cls, Exception)}


class _ScanContext:
    """What _json's C scanner reads: JSON as json.loads parses it, without importing json (and re) at every
    sandbox start; NaN and Infinity are refused (encode sends floats as repr strings)."""

    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int = float, int
    memo: dict[str, str] = {}

    @staticmethod
    def parse_constant(name: str) -> object:
        raise ValueError(f"JSON constant {name} is not sent here")


def parse_json(line: bytes) -> object:
    """One JSON value, the whole of ``line``; ValueError for anything else (it comes from the other process)."""
    import _json

    try:
        text = line.decode("utf-8")
        value, end = _json.make_scanner(cast("Any", _ScanContext()))(text, 0)
    except (ValueError, StopIteration, RecursionError) as exc:
        raise ValueError(f"malformed message: {type(exc).__name__}") from None
    if end != len(text):
        raise ValueError("malformed message: trailing data")
    return value


class Remote:
    """The other process's object, seen from this one: calls, attribute reads, ``len``, indexing, iteration and
    truth are asked of that process, and its answers come back as data or as more handles. Comparisons and
    arithmetic stay here: a handle equals only itself, so an object whose ``__eq__`` says yes to everything is
    equal to nothing it is compared with."""

    __slots__ = ("_chorus_channel", "_chorus_id")

    def __init__(self, channel: Channel, handle: int) -> None:
        object.__setattr__(self, "_chorus_channel", channel)
        object.__setattr__(self, "_chorus_id", handle)

    def _ask(self, op: str, **kw: object) -> object:
        channel = object.__getattribute__(self, "_chorus_channel")
        return channel.ask(op, object.__getattribute__(self, "_chorus_id"), **kw)

    def __call__(self, *args: object, **kwargs: object) -> object:
        channel = object.__getattribute__(self, "_chorus_channel")
        return channel.call(object.__getattribute__(self, "_chorus_id"), args, kwargs)

    def __getattr__(self, name: str) -> object:
        return self._ask("getattr", name=name)

    def __setattr__(self, name: str, value: object) -> None:
        self._ask("setattr", name=name, value=value)

    def __len__(self) -> int:
        return cast(int, self._ask("len"))

    def __bool__(self) -> bool:
        return cast(bool, self._ask("bool"))

    def __iter__(self) -> object:
        return self._ask("iter")

    def __next__(self) -> object:
        return self._ask("next")

    def __getitem__(self, key: object) -> object:
        return self._ask("getitem", key=key)

    def __setitem__(self, key: object, value: object) -> None:
        self._ask("setitem", key=key, value=value)

    def __contains__(self, item: object) -> bool:
        return cast(bool, self._ask("contains", key=item))

    def __str__(self) -> str:
        return cast(str, self._ask("str"))

    def __instancecheck__(self, instance: object) -> bool:  # isinstance(x, a class of the code's)
        return cast(bool, self._ask("isinstance", key=instance))

    def __repr__(self) -> str:
        return cast(str, self._ask("repr"))


CODE_SERVES = frozenset({"names", "call", "getattr", "setattr", "len", "bool", "iter", "next", "getitem",
                         "setitem", "contains", "str", "repr", "isinstance"})
# The code may call back what the tests handed it (a key function, an iterator), never read the tests' objects:
# no attribute of a test's function (its __globals__ hold the expected values) crosses to the code.
TESTS_SERVE = frozenset({"call", "len", "bool", "iter", "next", "getitem", "contains"})
MUTABLE = (list, dict, set)
UNARY: dict[str, Callable[[Any], object]] = {"len": len, "bool": bool, "iter": iter, "next": next, "str": str,
                                             "repr": repr}  # arguments whose changes by a call are copied back to the caller's object


class Channel:
    """One end of the pipes between the code's process and the tests' process. A request names an operation on
    an object of the other side (by handle; 0 is the code's namespace) and carries data; the answer is data, or
    an error by name. A value that is not plain builtin data crosses as a handle, never as itself. While one
    side waits for its answer it serves what the other side asks meanwhile (a key function called back)."""

    def __init__(self, rfd: int, wfd: int, serves: frozenset[str], namespace: dict[str, object] | None = None,
                 peer: int = 0) -> None:
        self.rfd, self.wfd, self.serves, self.namespace, self.peer = rfd, wfd, serves, namespace, peer
        self.exports: dict[int, object] = {}  # handle -> this side's object handed out (kept alive: ids stay unique)
        self.handles: dict[int, int] = {}  # id(object) -> its handle
        self.remotes: dict[int, Remote] = {}  # handle -> the one proxy of the other side's object
        self.buf = b""
        self.ended: str | None = None  # how the other process ended, once known

    # --- data <-> this side's objects
    def export(self, value: object) -> int:
        handle = self.handles.get(id(value))
        if handle is None:
            handle = self.handles[id(value)] = len(self.exports) + 1
            self.exports[handle] = value
        return handle

    def resolve(self, tag: str, handle: object) -> object:
        if type(handle) is not int:
            raise ValueError("malformed handle")
        if tag == "h":  # the other side's object
            remote = self.remotes.get(handle)
            if remote is None:
                remote = self.remotes[handle] = Remote(self, handle)
            return remote
        if handle not in self.exports:  # "r": one of ours, coming back
            raise ValueError("no such handle")
        return self.exports[handle]

    def enc(self, value: object) -> object:
        return encode(value, 0, self)

    def dec(self, data: object) -> object:
        return decode(data, 0, self.resolve)

    # --- the pipes
    def write(self, message: dict[str, object]) -> None:
        data = to_json(message).encode()
        if len(data) >= LINE_LIMIT:
            raise Unserialisable(f"value too large to send (over {LINE_LIMIT} bytes)")
        data += b"\n"
        try:
            while data:
                data = data[os.write(self.wfd, data):]
        except BrokenPipeError:
            raise CodeError(self.gone()) from None

    def read(self) -> dict[str, object]:
        while b"\n" not in self.buf:
            if len(self.buf) > LINE_LIMIT:
                raise CodeError(f"the code's process sent a message over {LINE_LIMIT} bytes")
            chunk = os.read(self.rfd, 65536)
            if not chunk:
                raise CodeError(self.gone())
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            message = parse_json(line)
        except ValueError as exc:
            raise CodeError(f"the code's process sent a {exc}") from None
        if type(message) is not dict:
            raise CodeError("the code's process sent a malformed message")
        return cast("dict[str, object]", message)

    def gone(self) -> str:
        """How the other process ended (the tests' side knows: the code's process is its child); the same answer
        every time it is asked."""
        if self.ended is None:
            self.ended = "the code's process closed its end before answering"
            for _ in range(50 if self.peer else 0):
                try:
                    pid, status = os.waitpid(self.peer, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid:
                    self.ended = "the code's process " + exit_text(status)
                    break
                select.select([], [], [], 0.01)
        return self.ended

    # --- asking
    def ask(self, op: str, handle: int, **kw: object) -> object:
        self.write({"op": op, "h": handle, **{k: self.enc(v) for k, v in kw.items()}})
        return self.dec(self.wait().get("value"))

    def call(self, handle: int, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        """Call the other side's object; a list, dict or set argument it changed is changed here the same way."""
        self.write({"op": "call", "h": handle, "args": [self.enc(a) for a in args],
                    "kwargs": [[k, self.enc(v)] for k, v in kwargs.items()]})
        answer = self.wait()
        out = answer.get("out")
        for key, data in out if type(out) is list else ():
            target = args[key] if type(key) is int and 0 <= key < len(args) else kwargs.get(key) if type(
                key) is str else None
            if type(target) in MUTABLE:
                _assign(target, self.dec(data))
        return self.dec(answer.get("value"))

    def wait(self) -> dict[str, object]:
        """The answer to this side's request, serving the other side's requests until it comes."""
        while True:
            message = self.read()
            if "op" in message:
                self.serve(message)
                continue
            if "error" in message:
                raise rebuilt(message["error"])
            if "value" not in message:
                raise CodeError("the code's process sent a malformed message")
            return message

    # --- answering
    def serve(self, message: dict[str, object]) -> None:
        answer: dict[str, object]
        try:
            answer = self._do(message)
        except BaseException as exc:  # the code's SystemExit too: it is that call's answer, not this process's end
            answer = {"error": [type(exc).__name__, _detail(exc)]}
        _flush()
        try:
            self.write(answer)
        except Unserialisable as exc:
            self.write({"error": ["ValueError", str(exc)]})

    def _do(self, message: dict[str, object]) -> dict[str, object]:
        op = message.get("op")
        if type(op) is not str or op not in self.serves:
            raise PermissionError(f"{op!r} is not answered here")
        if op == "names":  # the code's top-level names the tests read
            names, ns = message.get("names"), self.namespace or {}
            wanted = [n for n in cast(list, names) if type(n) is str] if type(names) is list else []
            return {"value": self.enc({n: ns[n] for n in wanted if n in ns})}
        obj: Any = self.resolve("r", message.get("h"))
        if op == "call":
            args, kwargs = message.get("args"), message.get("kwargs")
            if type(args) is not list or type(kwargs) is not list:
                raise ValueError("malformed call")
            values = [self.dec(a) for a in cast(list, args)]
            named = {cast(str, k): self.dec(v) for k, v in cast(list, kwargs)}
            result = obj(*values, **named)
            sent: dict[object, object] = dict(enumerate(cast(list, args))) | {k: v for k, v in cast(list, kwargs)}
            changed = [[k, self.enc(v)] for k, v in (*enumerate(values), *named.items()) if type(v) in MUTABLE]
            return {"value": self.enc(result), "out": [[k, d] for k, d in changed if d != sent[k]]}
        name, key = message.get("name"), self.dec(message.get("key"))
        if op in ("getattr", "setattr") and type(name) is not str:
            raise ValueError("malformed attribute name")
        value: object = None
        if op == "getattr":
            value = getattr(obj, cast(str, name))
        elif op == "setattr":
            setattr(obj, cast(str, name), self.dec(message.get("value")))
        elif op == "setitem":
            obj[key] = self.dec(message.get("value"))
        elif op == "getitem":
            value = obj[key]
        elif op == "contains":
            value = key in obj
        elif op == "isinstance":
            value = isinstance(key, obj)
        else:
            value = UNARY[op](obj)
        return {"value": self.enc(value)}

    def serve_forever(self) -> None:
        """The code's side after its code ran: answer the tests until they close their end."""
        while True:
            try:
                message = self.read()
            except CodeError:
                return
            if "op" in message:
                self.serve(message)


def _assign(target: object, value: object) -> None:
    """Make ``target`` (the caller's list, dict or set) hold what the call left in its copy."""
    if type(target) is list and type(value) is list:
        cast(list, target)[:] = cast(list, value)
    elif type(target) in (dict, set) and type(value) is type(target):
        cast("dict | set", target).clear()
        cast("Any", target).update(value)


def _detail(exc: BaseException) -> str:
    try:
        return str(exc)[:ERROR_LIMIT]
    except Exception:  # the code's own exception class may fail to print
        return ""


def rebuilt(error: object) -> Exception:
    """The other side's error, as an exception of this side: a builtin type by name, else a CodeError."""
    if type(error) is not list or len(cast(list, error)) != 2 or not all(type(x) is str for x in cast(list, error)):
        return CodeError("the code's process sent a malformed error")
    name, detail = cast(list, error)
    cls = BUILTIN_ERRORS.get(name)
    if cls is not None:
        try:
            return cls(detail) if detail else cls()
        except Exception:  # a builtin that wants other arguments (UnicodeDecodeError)
            pass
    return CodeError(f"{name}: {detail}" if detail else name)


def exit_text(status: int) -> str:
    """How a process ended, from its wait status."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        names = {9: "SIGKILL", 24: "SIGXCPU", 25: "SIGXFSZ", 6: "SIGABRT", 11: "SIGSEGV", 15: "SIGTERM"}
        hint = " (CPU time limit)" if sig == 24 else ""
        return f"was killed by {names.get(sig, f'signal {sig}')}{hint}"
    return f"exited with status {os.WEXITSTATUS(status)}"


# --- the two processes of a run ---------------------------------------------------------------------------------
def serve_code(code: str, channel: Channel) -> None:
    """The code's process: exec the code, say how that went, then answer the tests' requests."""
    ns: dict[str, object] = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(code, "<solution>", "exec", optimize=0), ns)  # running untrusted code is the point
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: the code must not end the run
        name, detail = type(exc).__name__, _detail(exc)
        ns.clear()  # a memory bomb's objects go before the answer is written
        _flush()
        channel.write({"error": [name, detail]})
        return
    _flush()
    channel.namespace = ns
    channel.write({"value": None})
    channel.serve_forever()


def run_tests(steps: list[list[str]], bind: dict[str, str], channel: Channel, fd: int) -> None:
    """The tests' process: wait for the code, bind the code's names the tests read, then run each step (a setup
    statement, or an assert that is one test) and report it on ``fd``. The verdicts are made here, where the code
    cannot reach: it only ever answered requests."""
    try:
        channel.wait()
    except BaseException as exc:
        _flush()
        send(fd, {"event": "code", "error": describe(exc)})
        return
    send(fd, {"event": "code", "error": None})
    ns: dict[str, object] = {"__name__": "__main__", "__builtins__": builtins}
    failed: str | None = None
    try:
        found = channel.ask("names", 0, names=sorted(set(bind.values())))
        for here, there in bind.items():
            if type(found) is dict and there in found:
                ns[here] = cast(dict, found)[there]
    except BaseException as exc:
        failed = describe(exc)
    for i, (kind, source) in enumerate(steps):
        report: dict[str, object] = {"event": kind, "i": i, "error": failed}
        if failed is None:
            try:
                exec(compile(source, "<tests>", "exec", optimize=0), ns)
            except BaseException as exc:
                report["error"] = describe(exc)
        if kind == "test" or report["error"]:
            send(fd, report)
    _flush()
    send(fd, {"event": "done"})


def _keep_fds(fds: list[int]) -> None:
    """Move ``fds`` to 3, 4, ... in order, not inherited by programs the code starts; close every other fd
    above 2."""
    import fcntl

    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, RESULT_FD + len(fds)) for fd in fds]  # above every target
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    for i, fd in enumerate(high):
        os.dup2(fd, RESULT_FD + i, inheritable=False)
    os.closerange(RESULT_FD + len(fds), limit)


def read_memfd(fd: int) -> dict:
    """The marshalled dict coderun wrote to the memfd ``fd`` (trusted: written before the code exists)."""
    os.lseek(fd, 0, os.SEEK_SET)
    with os.fdopen(fd, "rb") as f:
        return cast(dict, marshal.loads(f.read()))


def run_pair(code: str, tests_fd: int, result_fd: int, confine: Callable[[int], None]) -> None:
    """Fork the code's process off this one, which then runs the tests. Each gets its pipe ends and nothing else:
    only the tests' process holds ``result_fd``, and only it reads the tests (from the memfd ``tests_fd``), after
    the fork, so they were never in the code's memory. ``confine(which)`` (0: the code's, 1: the tests') takes that
    process's limits and identity before anything of the run executes there."""
    (code_r, tests_w), (tests_r, code_w) = os.pipe(), os.pipe()
    tests = os.getpid()
    pid = os.fork()
    if pid == 0:  # the code's process: never returns into the caller
        try:
            _keep_fds([code_r, code_w])
            confine(0)
            _LIBC.prctl(PR_SET_PDEATHSIG, _signal.SIGKILL)  # after confine: a change of uid clears it
            if os.getppid() != tests:  # the tests' process is already gone
                os._exit(1)
            serve_code(code, Channel(RESULT_FD, RESULT_FD + 1, CODE_SERVES))
        except BaseException:
            os._exit(70)
        os._exit(0)
    del code
    _keep_fds([result_fd, tests_r, tests_w, tests_fd])
    confine(1)
    _LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # not traceable, its memory unreadable, even by its own uid
    plan = read_memfd(RESULT_FD + 3)
    run_tests(plan["steps"], plan["bind"], Channel(RESULT_FD + 1, RESULT_FD + 2, TESTS_SERVE, peer=pid), RESULT_FD)


def _flush() -> None:
    """Flush this process's buffered output, so the outside reads all of it."""
    try:
        sys.stdout.flush()
    except Exception:  # the code may have replaced or closed sys.stdout
        pass


# --- PID 1 ------------------------------------------------------------------------------------------------
_LIBC = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def b(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    _check(_LIBC.mount(b(source), b(target), b(fstype), ctypes.c_ulong(flags), b(data)), f"mount {target}")


def _bind(fd: int, target: str, flags: int) -> None:
    """Bind what ``fd`` (O_PATH, opened before the staging tmpfs) names onto ``target`` with ``flags`` added."""
    source = f"/proc/self/fd/{fd}"
    try:  # not recursive: mounts below the source (whatever their flags) stay out of the sandbox
        _mount(source, target, None, MS_BIND)
    except OSError:  # in a user namespace, a tree with locked submounts binds only whole
        _mount(source, target, None, MS_BIND | MS_REC)
    # A remount must keep the flags the host mount has (they may be locked), on top of the ones it adds.
    have = os.statvfs(target).f_flag
    keep = have & (MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
    keep |= MS_RELATIME if have & 4096 else 0  # ST_RELATIME
    _mount(None, target, None, MS_BIND | MS_REMOUNT | flags | keep)


def build_root(scratch_mb: int, uid: int) -> None:
    """Stage the sandbox's root on a tmpfs at NEW_ROOT, then chroot into it with the scratch dir as cwd."""
    os.umask(0o022)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host
    ro = MS_RDONLY | MS_NOSUID | MS_NODEV
    links: list[tuple[str, str]] = []
    binds: list[tuple[str, int, int, bool]] = []  # path, O_PATH fd, flags added, is a directory

    def add(path: str, flags: int, is_dir: bool) -> None:
        binds.append((path, os.open(path, os.O_PATH | os.O_CLOEXEC), flags, is_dir))

    for path in HOST_DIRS:
        if os.path.islink(path):
            links.append((path, os.readlink(path)))
        elif os.path.isdir(path):
            add(path, ro, True)
    for path in (os.path.realpath(sys.base_prefix), os.path.dirname(os.path.realpath(sys.executable))):
        if not any(path == p or path.startswith(p + "/") for p, _, _, is_dir in binds if is_dir):
            add(path, ro, True)
    for path in HOST_FILES:
        if os.path.isfile(path):
            add(path, ro, False)
    for dev in DEVICES:
        add(f"/dev/{dev}", MS_NOSUID | MS_NOEXEC, False)

    _mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=755")
    for path, target in links:
        os.symlink(target, NEW_ROOT + path)
    for path, fd, flags, is_dir in binds:
        dest = NEW_ROOT + path
        if is_dir:
            os.makedirs(dest, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.close(os.open(dest, os.O_CREAT | os.O_WRONLY, 0o644))
        _bind(fd, dest, flags)
        os.close(fd)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{NEW_ROOT}/dev/{name}")
    os.mkdir(NEW_ROOT + "/proc")
    for options in ("hidepid=2", None):  # hidepid: the code sees only its own processes
        try:
            _mount("proc", NEW_ROOT + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, options)
            break
        except OSError:  # a user namespace may not mount proc: the code then has none
            continue
    os.mkdir(NEW_ROOT + "/tmp")
    _mount("tmpfs", NEW_ROOT + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={scratch_mb}m,nr_inodes=4096,mode=770,uid={uid},gid={uid}")
    _mount(None, NEW_ROOT, None, MS_BIND | MS_REMOUNT | ro)
    os.chroot(NEW_ROOT)
    os.chdir("/tmp")


def _lower(kind: int, value: int) -> None:
    """Set a resource limit to ``value``, never above the hard limit already in place."""
    _, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))


def _drop_capabilities() -> None:
    """In a user namespace the runner stays uid 0 there: it gives up every capability, for good."""
    _check(_LIBC.prctl(PR_SET_SECUREBITS, SECBITS_LOCKED_NOROOT, 0, 0, 0), "securebits")
    for cap in range(64):
        if _LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability the kernel knows
    _LIBC.prctl(PR_CAP_AMBIENT, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    header = (ctypes.c_uint32 * 2)(CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: twice, all zero
    _check(_LIBC.capset(header, data), "capset")


def _runner(cfg: dict, tests_fd: int, result_fd: int, output_fd: int, uid: int) -> None:
    """The run: stdio, a session and a clean environment, then the code's process and the tests' process
    (:func:`run_pair`), each taking its limits, a uid of its own and no new privileges before anything of the run
    executes in it."""
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    os.setsid()
    os.environ.clear()
    os.environ.update(cfg["env"])
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - lives until os._exit
    sys.stdout = sys.stderr = open(1, "w", closefd=False, buffering=1)  # noqa: SIM115
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_IGN)  # too big a file: an OSError in the code, not a kill
    limits = cfg["limits"]

    def confine(which: int) -> None:
        _lower(resource.RLIMIT_CPU, limits["cpu_s"])
        _lower(resource.RLIMIT_AS, limits["memory_mb"] << 20)
        _lower(resource.RLIMIT_NPROC, limits["processes"])
        _lower(resource.RLIMIT_FSIZE, limits["file_bytes"])
        _lower(resource.RLIMIT_NOFILE, limits["open_files"])
        _lower(resource.RLIMIT_CORE, 0)
        if uid:
            own = uid + which * TESTS_UID_OFFSET  # the tests' process is out of the code's reach
            os.setgroups([uid] if which else [])  # the tests may read the scratch dir the code wrote in
            os.setresgid(own, own, own)
            os.setresuid(own, own, own)
        else:
            _drop_capabilities()
        _check(_LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")

    run_pair(cfg["code"], tests_fd, result_fd, confine)


def unisolated_child(scratch: str, result_fd: int, output_fd: int, parent: int, cpu_s: int,
                     file_bytes: int) -> None:
    """coderun's fallback, in a forked child of the worker (then :func:`run_pair`): own process group, dies with
    the worker, fds 0-2 redirected, CPU and file limits; no isolation."""
    os.setpgid(0, 0)
    _LIBC.prctl(PR_SET_PDEATHSIG, _signal.SIGKILL)
    if os.getppid() != parent:  # the worker died before prctl took effect
        os._exit(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - lives until os._exit
    sys.stdout = sys.stderr = open(1, "w", closefd=False, buffering=1)  # noqa: SIM115
    os.chdir(scratch)
    _lower(resource.RLIMIT_CPU, cpu_s)
    _lower(resource.RLIMIT_FSIZE, file_bytes)
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_IGN)


def _wait(runner: int, lifeline: int) -> dict[str, object]:
    """Wait for the runner's exit (its wait status) or the lifeline's close, reaping orphans meanwhile."""
    try:
        pidfd: int | None = os.pidfd_open(runner)
    except (AttributeError, OSError):  # no pidfd: poll
        pidfd = None
    watch = [lifeline] if pidfd is None else [lifeline, pidfd]
    while True:
        ready, _, _ = select.select(watch, [], [], 0.01 if pidfd is None else 1.0)
        while True:  # orphans of the namespace come to PID 1
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == runner:
                return {"status": status}
            if pid == 0:
                break
        if lifeline in ready:
            return {"lifeline": True}


def _report(obj: dict[str, object]) -> None:
    os.write(1, to_json(obj).encode() + b"\n")


def main(argv: list[str]) -> int:
    config_fd, tests_fd, result_fd, output_fd, lifeline = (int(a) for a in argv[1:6])
    try:
        cfg = read_memfd(config_fd)  # the code and the limits: the tests stay in tests_fd for the tests' process
        # The host's pid of this PID 1 (read before /proc is replaced) makes a uid no other sandbox has now.
        uid = 0 if cfg["uid_base"] is None else cfg["uid_base"] + int(os.readlink("/proc/self"))
        build_root(cfg["scratch_mb"], uid)
    except Exception as exc:
        _report({"error": f"sandbox setup failed: {describe(exc)}"})
        return 1
    runner = os.fork()
    if runner == 0:
        try:
            os.close(lifeline)
            _runner(cfg, tests_fd, result_fd, output_fd, uid)
        except BaseException:  # whatever happened, the runner must not return into PID 1's loop
            os._exit(70)
        os._exit(0)
    os.close(tests_fd)
    os.close(result_fd)
    os.close(output_fd)
    _report(_wait(runner, lifeline))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
