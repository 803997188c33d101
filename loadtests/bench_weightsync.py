"""Weight synchronisation, measured: the ucx and nats transports against per-tensor messages and raw limits.

    python loadtests/bench_weightsync.py [--sets smollm2-135m,llama3.2-1b] [--reps 5] [--reps-large 3] [--quick]

For each parameter set (random tensors in the layout of a real model, so the tensor count is realistic:
SmolLM2-135M and a Llama-3.2-1B-like model, tied embeddings, bfloat16 by default) a sender process plays the
trainer and a receiver process plays one rollouter, both on this host against one real nats-server with
JetStream (file storage in a temp dir, max_payload 8 MiB as in the project default). Both run on uvloop, as
the services do, and are driven over pipes by this process; a pipe message is never inside a timed span.
Every method runs one warm-up sync (first touch of fresh buffers, UCX endpoint creation, consumer setup)
and reports the median of the measured ones:

- ``memcpy``: ``np.copyto`` of the sender's flat buffer into a warm buffer of the same size, one process.
- ``socket``: an asyncio loopback TCP socket; the receiver asks with one byte, the sender
  ``loop.sock_sendall``s the flat buffer, the receiver ``loop.sock_recv_into``s it into a warm buffer.
- ``ucx bucketed``: the real ``UcxSource`` (sender) and ``UcxSink`` (receiver); timed on the receiver from
  ``fetch()``'s start (header request, receives posted, pull request) until every bucket has landed. The
  row below it times ``load_into(verify=True)`` of what arrived into the receiver's preallocated tensors
  (XXH3 of every bucket, then one copy per tensor), and the next row the sum: the whole sync.
- ``nats object store``: the real ``NatsSource.publish`` (header and buffer put as 512 KB chunks, 32
  publishes in flight) in the sender, then the real ``NatsSink.fetch`` (pull consumer, pulls of at most 32
  MiB, into a reused buffer) in the receiver; put and get are timed where they run and added. Each object is
  deleted after its get.
- ``per-tensor nats``: the naive loop over the state dict: one NATS request per tensor carrying a 12-byte
  header (index, offset) and the tensor's raw bytes; the receiver copies them into its preallocated tensor
  and replies (one ack per parameter), the sender waits for each reply before the next. Tensors larger
  than the server's max payload go as pieces of at most max payload. Timed on the sender.

GB are 10^9 bytes. The flat buffer's ``flatten`` (copy + checksums, the trainer's cost before any
transport) is shown for reference. The summed RSS of all processes is sampled every 0.1 s and its peak
printed (``--verbose``: per phase, and every measured sync's seconds). The last line, for the last
(largest) set, is ``ratio ucx_vs_socket=<x> ucx_vs_per_tensor=<y>``: ucx bucketed GB/s (fetch) over socket
and over per-tensor GB/s. Absolute numbers depend on the machine and its load; the ratios are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from shared.kernel.config import ChorusConfig, load_config
from shared.kernel.subjects import Names
from shared.launcher.natsserver import NatsServer
from shared.models.weights import bucket_checksum, checksum, combine, flatten, load_into

# ucxx sets UCX_MEMTYPE_CACHE, which this UCX no longer knows; without this UCX warns on every start. ucxx is
# only imported later (by shared.models.weightsync, in the workers), and spawned workers inherit the environment.
os.environ["UCX_WARN_UNUSED_ENV_VARS"] = "n"

MODEL = "m"
PT_HDR = struct.Struct("<IQ")  # per-tensor message header: tensor index, byte offset of this piece
LARGE_BYTES = 10**9  # sets at least this big use --reps-large


@dataclass(frozen=True)
class Arch:
    """A Llama-style decoder's shipped tensors (tied embeddings: no lm_head), in Hugging Face order."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def shapes(self) -> dict[str, tuple[int, ...]]:
        q, kv, h = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (self.intermediate, h),
                    p + "mlp.up_proj.weight": (self.intermediate, h),
                    p + "mlp.down_proj.weight": (h, self.intermediate), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)}
        out["model.norm.weight"] = (h,)
        return out


ARCHS = {
    "tiny-7m": Arch(hidden=256, layers=4, intermediate=768, heads=4, kv_heads=2, head_dim=64, vocab=16384),
    "smollm2-135m": Arch(hidden=576, layers=30, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152),
    "llama3.2-1b": Arch(hidden=2048, layers=16, intermediate=8192, heads=32, kv_heads=8, head_dim=64, vocab=128256),
}
DEFAULT_SETS = ("smollm2-135m", "llama3.2-1b")
QUICK_SETS = ("tiny-7m", "smollm2-135m")


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's bytes as a writable uint8 numpy view (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def tensors_digest(named: dict[str, torch.Tensor]) -> str:
    return combine([bucket_checksum(memoryview(as_bytes(t))) for t in named.values()])


def free() -> None:
    gc.collect()


# --- the two worker processes --------------------------------------------------------------------------------


class Sender:
    """The trainer's side: the tensors, their flat buffer, the ucx and nats sources, the socket server."""

    def __init__(self, cfg: ChorusConfig, nc: Any) -> None:
        self.cfg, self.nc, self.names = cfg, nc, Names(cfg.run.id)
        self.named: dict[str, torch.Tensor] | None = None
        self.flat: bytearray | None = None
        self.header: Any = None
        self.ucx: Any = None
        self.nats_source: Any = None
        self.listener: socket.socket | None = None

    async def build(self, arch: dict[str, int], dtype: str, bucket_mb: float, reps: int) -> dict[str, Any]:
        self.named = self.flat = self.header = None
        free()
        torch.manual_seed(0)
        named = {name: torch.empty(shape, dtype=getattr(torch, dtype)).normal_(0, 0.02)
                 for name, shape in Arch(**arch).shapes().items()}
        bucket_bytes = int(bucket_mb * 1024 * 1024)
        header, flat = flatten(MODEL, 0, named, bucket_bytes=bucket_bytes)  # allocates and touches the buffer
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            header, flat = flatten(MODEL, 0, named, bucket_bytes=bucket_bytes, out=flat)
            times.append(time.perf_counter() - t0)
        self.named, self.flat, self.header = named, flat, header
        return {"params": sum(t.numel() for t in named.values()), "tensors": len(named),
                "tensor_bytes": sum(t.numel() * t.element_size() for t in named.values()),
                "nbytes": header.nbytes, "buckets": len(header.buckets), "bucket_bytes": header.bucket_bytes,
                "checksum": header.checksum, "digest": tensors_digest(named), "flatten": times,
                "largest": max(t.numel() * t.element_size() for t in named.values())}

    def body(self) -> memoryview:
        assert self.flat is not None
        return memoryview(self.flat)[: self.header.nbytes]

    async def memcpy(self, reps: int) -> list[float]:
        src = np.frombuffer(self.body(), dtype=np.uint8)
        dst = np.empty_like(src)
        times = []
        for _ in range(reps + 1):  # the first touches dst
            t0 = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t0)
        if not np.array_equal(dst[-4096:], src[-4096:]):
            raise AssertionError("memcpy copied wrong bytes")
        return times[1:]

    async def per_tensor(self, subject: str, reps: int) -> dict[str, Any]:
        assert self.named is not None
        piece = self.nc.max_payload - PT_HDR.size
        views = [memoryview(as_bytes(t)) for t in self.named.values()]
        times, messages = [], 0
        for _ in range(reps + 1):
            messages = 0
            t0 = time.perf_counter()
            for i, view in enumerate(views):
                for off in range(0, len(view), piece):
                    await self.nc.request(subject, PT_HDR.pack(i, off) + view[off:off + piece], timeout=60)
                    messages += 1
            times.append(time.perf_counter() - t0)
        return {"times": times[1:], "messages": messages, "piece": piece,
                "split": sum(1 for v in views if len(v) > piece)}

    async def drop_tensors(self) -> None:
        self.named = None
        free()

    async def ucx_publish(self, version: int) -> None:
        from shared.models.weightsync import UcxSource

        if self.ucx is None:  # one source for the process's life, as in the trainer
            self.ucx = UcxSource(self.cfg, self.names, MODEL, self.nc)
            await self.ucx.start()
        await self.ucx.publish(dataclasses.replace(self.header, version=version), self.flat)

    async def ucx_done(self) -> dict[str, int]:
        counters = dict(self.ucx.counters)
        self.ucx.held.clear()  # the versions of this set: their buffer goes with the set
        while self.ucx.spare() is not None:
            pass
        return counters

    async def socket_listen(self) -> int:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        s.setblocking(False)
        self.listener = s
        return int(s.getsockname()[1])

    async def socket_serve(self, reps: int) -> None:
        assert self.listener is not None
        loop = asyncio.get_running_loop()
        conn, _ = await loop.sock_accept(self.listener)
        conn.setblocking(False)
        view, go = self.body(), bytearray(1)
        try:
            for _ in range(reps):
                if await loop.sock_recv_into(conn, go) != 1:
                    raise ConnectionError("the receiver closed the socket")
                await loop.sock_sendall(conn, view)
        finally:
            conn.close()
            self.listener.close()
            self.listener = None

    async def nats_publish(self, version: int) -> dict[str, Any]:
        from shared.kernel.bus import ensure_run
        from shared.models.weightsync import NatsSource

        if self.nats_source is None:
            await ensure_run(self.nc.jetstream(), self.cfg)
            self.nats_source = NatsSource(self.cfg, self.names, MODEL, self.nc.jetstream())
        free()  # outside the timing: no garbage of the last put may add to this one's memory
        t0 = time.perf_counter()
        name = await self.nats_source.publish(dataclasses.replace(self.header, version=version), self.flat)
        return {"name": name, "put_s": time.perf_counter() - t0}

    async def nats_delete(self, name: str) -> None:
        store = await self.nc.jetstream().object_store(self.names.obj_bucket)
        await store.delete(name)

    async def nats_done(self) -> None:
        self.nats_source = None  # it keeps the last buffer as its spare
        free()

    async def close(self) -> None:
        if self.ucx is not None:
            await self.ucx.close()


class Receiver:
    """One rollouter instance: preallocated tensors, the ucx and nats sinks, the socket client."""

    def __init__(self, cfg: ChorusConfig, nc: Any) -> None:
        self.cfg, self.nc, self.names = cfg, nc, Names(cfg.run.id)
        self.named: dict[str, torch.Tensor] | None = None
        self.dst: list[np.ndarray] = []
        self.sub: Any = None
        self.ucx: Any = None
        self.nats_sink: Any = None

    async def build(self, arch: dict[str, int], dtype: str) -> None:
        self.named, self.dst = None, []
        free()
        self.named = {name: torch.zeros(shape, dtype=getattr(torch, dtype))  # zeros: touched, warm
                      for name, shape in Arch(**arch).shapes().items()}
        self.dst = [as_bytes(t) for t in self.named.values()]

    async def _on_piece(self, msg: Any) -> None:
        i, off = PT_HDR.unpack_from(msg.data)
        piece = np.frombuffer(msg.data, dtype=np.uint8, offset=PT_HDR.size)
        self.dst[i][off:off + len(piece)] = piece
        await msg.respond(b"")

    async def pt_start(self, subject: str) -> None:
        self.sub = await self.nc.subscribe(subject, cb=self._on_piece, pending_bytes_limit=256 * 1024 * 1024)
        await self.nc.flush()

    async def pt_stop(self) -> str:
        await self.sub.unsubscribe()
        assert self.named is not None
        return tensors_digest(self.named)

    async def drop_tensors(self) -> None:
        self.named, self.dst = None, []
        free()

    async def ucx_fetch(self, version: int, timeout_s: float) -> dict[str, float]:
        from shared.models.weightsync import UcxSink

        if self.ucx is None:
            self.ucx = UcxSink(self.names, MODEL, "0", self.nc)
        assert self.named is not None
        t0 = time.perf_counter()
        header, body = await self.ucx.fetch(version, object_name=None, timeout_s=timeout_s)
        t1 = time.perf_counter()
        load_into(self.named, header, body, verify=True)
        return {"fetch_s": t1 - t0, "load_s": time.perf_counter() - t1}

    async def socket_recv(self, port: int, nbytes: int, reps: int, expect: str, bucket_bytes: int) -> list[float]:
        loop = asyncio.get_running_loop()
        # The UCX staging buffer: warm, and as large as the body. Zeroed so the check below sees new bytes.
        view = memoryview(self.ucx.staging(nbytes))[:nbytes]
        np.frombuffer(view, dtype=np.uint8)[:] = 0
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        times = []
        try:
            await loop.sock_connect(s, ("127.0.0.1", port))
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                await loop.sock_sendall(s, b"g")
                got = 0
                while got < nbytes:
                    n = await loop.sock_recv_into(s, view[got:])
                    if n == 0:
                        raise ConnectionError(f"the sender closed the socket after {got} of {nbytes} bytes")
                    got += n
                times.append(time.perf_counter() - t0)
        finally:
            s.close()
        if checksum(view, bucket_bytes) != expect:
            raise AssertionError("socket: the received bytes do not match the sender's checksum")
        return times[1:]

    async def ucx_done(self) -> None:
        if self.ucx is not None:
            self.ucx.discard_staging()
        free()

    async def nats_fetch(self, version: int, name: str, timeout_s: float, expect: str | None) -> float:
        from shared.models.weightsync import NatsSink

        if self.nats_sink is None:
            self.nats_sink = NatsSink(self.names, MODEL, "0", self.nc.jetstream())
        t0 = time.perf_counter()
        header, body = await self.nats_sink.fetch(version, object_name=name, timeout_s=timeout_s)
        dt = time.perf_counter() - t0
        if expect is not None and (header.checksum != expect or checksum(body, header.bucket_bytes) != expect):
            raise AssertionError("nats: the fetched body does not match the sender's checksum")
        return dt

    async def nats_done(self) -> None:
        if self.nats_sink is not None:
            self.nats_sink.discard_staging()
        free()

    async def close(self) -> None:
        pass


def worker(role: str, conn: Any, url: str, cfg_kw: dict[str, Any]) -> None:
    """A worker process: executes the commands that arrive on ``conn`` in its event loop, one at a time."""
    import uvloop

    uvloop.run(_serve(role, conn, url, cfg_kw))


async def _serve(role: str, conn: Any, url: str, cfg_kw: dict[str, Any]) -> None:
    import nats

    cfg = load_config(None, **cfg_kw)
    nc = await nats.connect(url, name=f"bench-{role}")
    obj: Sender | Receiver = Sender(cfg, nc) if role == "sender" else Receiver(cfg, nc)
    loop = asyncio.get_running_loop()
    try:
        while True:
            # Wait for the next command in a thread: the loop keeps serving (the ucx source answers requests).
            cmd, kw = await loop.run_in_executor(None, conn.recv)
            if cmd == "exit":
                break
            try:
                result = await getattr(obj, cmd)(**kw)
            except Exception:
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("ok", result))
    finally:
        await obj.close()
        await nc.close()
        conn.close()


class Peer:
    """This process's handle on a worker."""

    def __init__(self, ctx: Any, role: str, url: str, cfg_kw: dict[str, Any]) -> None:
        self.role = role
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker, args=(role, child, url, cfg_kw), name=f"bench-{role}")
        self.proc.start()
        child.close()

    def send(self, cmd: str, **kw: Any) -> None:
        self.conn.send((cmd, kw))

    def result(self, timeout_s: float = 300.0) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.role}: no answer in {timeout_s}s")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"{self.role} failed:\n{value}")
        return value

    def call(self, cmd: str, **kw: Any) -> Any:
        self.send(cmd, **kw)
        return self.result()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit", {}))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


class MemoryWatch:
    """Samples the summed RSS of this process and its descendants (workers, nats-server) every 0.1 s."""

    def __init__(self) -> None:
        self.peak = 0
        self.peak_parts: dict[str, int] = {}
        self.phase = "start"  # what the run is doing: set by the orchestration
        self.peak_phase = ""
        self.by_phase: dict[str, tuple[int, dict[str, int]]] = {}  # phase -> (peak, its parts)
        self.labels: dict[int, str] = {os.getpid(): "main"}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> MemoryWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(0.1):
            parts: dict[str, int] = {}
            for p in [me, *me.children(recursive=True)]:
                try:
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                label = self.labels.get(p.pid, "other")
                parts[label] = parts.get(label, 0) + rss
            total, phase = sum(parts.values()), self.phase
            if total > self.by_phase.get(phase, (0, {}))[0]:
                self.by_phase[phase] = (total, parts)
            if total > self.peak:
                self.peak, self.peak_parts, self.peak_phase = total, parts, phase


# --- the orchestration ---------------------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def run_set(name: str, sender: Peer, receiver: Peer, args: argparse.Namespace, first_version: int,
            subject: str, watch: MemoryWatch) -> dict[str, Any]:
    arch = dataclasses.asdict(ARCHS[name])
    t_set = time.perf_counter()
    watch.phase = f"{name} build"
    receiver.send("build", arch=arch, dtype=args.dtype)
    info = sender.call("build", arch=arch, dtype=args.dtype, bucket_mb=args.bucket_mb, reps=3)
    receiver.result()
    nbytes = info["nbytes"]
    reps = args.reps_large if nbytes >= LARGE_BYTES else args.reps
    slow = max(1, min(reps, args.slow_reps))
    print(f"\n== {name}: {info['params'] / 1e6:.1f} M params, {args.dtype}, {nbytes / 1e9:.3f} GB in "
          f"{info['tensors']} tensors (largest {info['largest'] / 1e6:.0f} MB), {info['buckets']} buckets of "
          f"{info['bucket_bytes'] / 2**20:g} MiB; median of {reps} syncs ({slow} for nats and per-tensor) "
          "after 1 warm-up", flush=True)
    rows: dict[str, dict[str, Any]] = {}

    def row(key: str, samples: list[float], moved: int, note: str) -> None:
        seconds = med(samples)
        rows[key] = {"s": seconds, "gbps": moved / seconds / 1e9, "note": note, "min": min(samples),
                     "max": max(samples), "samples": samples}

    row("flatten (sender)", info["flatten"], nbytes, "reference: the trainer's copy + XXH3 per bucket")
    watch.phase = f"{name} per-tensor"
    receiver.call("pt_start", subject=subject)
    pt = sender.call("per_tensor", subject=subject, reps=slow)
    if receiver.call("pt_stop") != info["digest"]:
        raise AssertionError("per-tensor: the receiver's tensors differ from the sender's")
    sender.call("drop_tensors")  # the rest ships the flat buffer only
    split = f", {pt['split']} tensors over {pt['piece'] / 2**20:.0f} MiB split" if pt["split"] else ""
    row("per-tensor nats", pt["times"], info["tensor_bytes"],
        f"{pt['messages']} request/reply msgs (one per tensor{split}), sequential")

    watch.phase = f"{name} memcpy"
    row("memcpy", sender.call("memcpy", reps=reps), nbytes, "np.copyto into a warm buffer, one process")

    watch.phase = f"{name} ucx"
    ucx = []
    version = first_version
    for _ in range(reps + 1):
        sender.call("ucx_publish", version=version)
        ucx.append(receiver.call("ucx_fetch", version=version, timeout_s=args.timeout_s))
        version += 1
    counters = sender.call("ucx_done")
    if counters.get("pull_failures"):
        raise AssertionError(f"ucx: {counters}")
    ucx = ucx[1:]
    row("ucx bucketed", [u["fetch_s"] for u in ucx], nbytes,
        f"UcxSource -> UcxSink.fetch: meta + pull + {info['buckets']} buckets")
    row("  load_into(verify=True)", [u["load_s"] for u in ucx], nbytes,
        f"XXH3 of each bucket + copy into {info['tensors']} tensors")
    row("  ucx fetch + load", [u["fetch_s"] + u["load_s"] for u in ucx], nbytes, "the whole sync on the receiver")

    watch.phase = f"{name} socket"
    receiver.call("drop_tensors")
    port = sender.call("socket_listen")
    sender.send("socket_serve", reps=reps + 1)
    sock = receiver.call("socket_recv", port=port, nbytes=nbytes, reps=reps, expect=info["checksum"],
                         bucket_bytes=info["bucket_bytes"])
    sender.result()
    receiver.call("ucx_done")
    row("socket", sock, nbytes, "asyncio (uvloop) loopback TCP, sock_sendall -> sock_recv_into")

    watch.phase = f"{name} nats"
    puts, gets = [], []
    for i in range(slow + 1):
        put = sender.call("nats_publish", version=version)
        gets.append(receiver.call("nats_fetch", version=version, name=put["name"], timeout_s=args.timeout_s,
                                  expect=info["checksum"] if i == 0 else None))
        puts.append(put["put_s"])
        sender.call("nats_delete", name=put["name"])
        version += 1
    receiver.call("nats_done")
    sender.call("nats_done")
    puts, gets = puts[1:], gets[1:]
    row("nats object store", [p + g for p, g in zip(puts, gets, strict=True)], nbytes,
        f"put {med(puts):.3f} s + get {med(gets):.3f} s, {args.chunk_kb} KB chunks, file storage")

    order = ["memcpy", "socket", "ucx bucketed", "  load_into(verify=True)", "  ucx fetch + load",
             "nats object store", "per-tensor nats", "flatten (sender)"]
    print(f"{'method':<26} {'GB/s':>7} {'s/sync':>8} {'(min-max s)':>17}  notes")
    for key in order:
        r = rows[key]
        print(f"{key:<26} {r['gbps']:7.2f} {r['s']:8.4f} {r['min']:8.4f}-{r['max']:<8.4f}  {r['note']}")
        if args.verbose:
            print(f"{'':<26} samples: {', '.join(f'{x:.4f}' for x in r['samples'])}")
    u = rows["ucx bucketed"]["gbps"]
    ratios = {k: u / rows[m]["gbps"] for k, m in (("socket", "socket"), ("per_tensor", "per-tensor nats"),
                                                    ("nats", "nats object store"), ("memcpy", "memcpy"))}
    print("ucx bucketed (fetch) GB/s over: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
          + f"   [set took {time.perf_counter() - t_set:.0f} s]", flush=True)
    return {"rows": rows, "ratios": ratios, "next_version": version}


def main(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    t_start = time.perf_counter()
    run_id = f"benchws{os.getpid()}"
    results: dict[str, dict[str, Any]] = {}
    watch = MemoryWatch().start()
    with tempfile.TemporaryDirectory(prefix="chorus-wsync-", dir=args.work_dir) as tmp:
        cfg_kw = {"run": {"id": run_id, "dir": str(Path(tmp) / "runs")},
                  "models": {MODEL: {}}, "agents": {"solver": {"model": MODEL}, "verifier": {"model": MODEL}},
                  "paramsync": {"transport": "ucx", "bucket_mb": args.bucket_mb, "chunk_kb": args.chunk_kb,
                                "load_timeout_s": args.timeout_s}}
        cfg = load_config(None, **cfg_kw)  # fail here, not in a worker, on a bad option
        with NatsServer(Path(tmp) / "nats", max_payload_mb=cfg.nats.max_payload_mb) as server:
            assert server.proc is not None
            watch.labels[server.proc.pid] = "nats-server"
            ctx = mp.get_context("spawn")
            sender = Peer(ctx, "sender", server.url, cfg_kw)
            receiver = Peer(ctx, "receiver", server.url, cfg_kw)
            watch.labels[sender.proc.pid or 0] = "sender"
            watch.labels[receiver.proc.pid or 0] = "receiver"
            try:
                version = 1
                for name in args.sets:
                    r = run_set(name, sender, receiver, args, version, f"bench.{run_id}.pertensor", watch)
                    version = r["next_version"]
                    results[name] = r
            finally:
                sender.stop()
                receiver.stop()
    watch.stop()
    parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(watch.peak_parts.items(), key=lambda kv: -kv[1]))
    if args.verbose:
        print("\npeak RSS of all processes together, by phase:")
        for phase, (total, at) in watch.by_phase.items():
            print(f"  {phase:<26} {total / 1e9:5.1f} GB: " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in at.items()))
    print(f"\npeak RSS of all processes together: {watch.peak / 1e9:.1f} GB in {watch.peak_phase} ({parts}); "
          f"wall {time.perf_counter() - t_start:.0f} s")
    last = results[args.sets[-1]]["ratios"]
    print(f"ratio ucx_vs_socket={last['socket']:.2f} ucx_vs_per_tensor={last['per_tensor']:.2f}")
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default=",".join(DEFAULT_SETS),
                    help=f"comma-separated parameter sets, smallest first (of {','.join(ARCHS)}); "
                         "the final ratio line is for the last")
    ap.add_argument("--quick", action="store_true", help=f"smoke run: sets {','.join(QUICK_SETS)}, 2 syncs each")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--reps", type=int, default=5, help="measured syncs per method for sets under 1 GB")
    ap.add_argument("--reps-large", type=int, default=3, help="measured syncs per method for sets of 1 GB and more")
    ap.add_argument("--slow-reps", type=int, default=2, help="at most this many for nats and per-tensor")
    ap.add_argument("--bucket-mb", type=float, default=64.0, help="paramsync.bucket_mb")
    ap.add_argument("--chunk-kb", type=int, default=512, help="paramsync.chunk_kb (object store chunk size)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="paramsync.load_timeout_s: a fetch's limit")
    ap.add_argument("--verbose", action="store_true", help="print every measured sync's seconds")
    ap.add_argument("--work-dir", default=None, help="where the temp dir (nats store) goes; default: the system's")
    a = ap.parse_args()
    a.sets = list(QUICK_SETS) if a.quick else [s.strip() for s in a.sets.split(",") if s.strip()]
    if a.quick:
        a.reps = a.reps_large = a.slow_reps = 2
    unknown = [s for s in a.sets if s not in ARCHS]
    if not a.sets or unknown:
        ap.error(f"--sets: unknown {unknown}; choose from {','.join(ARCHS)}")
    if min(a.reps, a.reps_large, a.slow_reps) < 1:
        ap.error("--reps, --reps-large and --slow-reps must be at least 1")
    sys.exit(0 if main(a) else 1)
