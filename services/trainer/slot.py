"""A training pool's slot worker (``python -m services.trainer.slot FD CONFIG INDEX CORES``): a process pinned to its
slot's cores that builds the learners of the models it hosts and runs their calls, one at a time, for the pool
(:mod:`services.trainer.pool`) over the pipe ``FD``.

A call names the model, where its stored state is (Get: imported in place before the call, unless the slot already
holds it) and where to write the state after the call (Set). States are file-backed buffers mapped here and in no
other way: one copy in, one copy out (:mod:`services.trainer.swap`). Each learner keeps its frozen parts (a LoRA
model's base) between tenancies; only the trainable state moves. The process ends with the pool.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np


class Maps:
    """File-backed buffers, mapped once each (a state file only grows)."""

    def __init__(self) -> None:
        self.maps: dict[str, np.memmap] = {}

    def get(self, path: str, nbytes: int, create: bool) -> np.memmap:
        m = self.maps.get(path)
        if m is not None and len(m) >= nbytes and os.path.exists(path) and os.path.getsize(path) >= len(m):
            return m
        size = max(nbytes, 1)
        if create:
            with open(path, "ab") as f:
                if f.tell() < size:
                    f.truncate(size)
        size = max(size, os.path.getsize(path))
        m = np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))
        self.maps[path] = m
        return m


def serve(conn: Connection, spec: Path, index: int) -> int:
    import torch

    from services.trainer.swap import SwapMeta, export_state, import_state, state_bytes
    from shared.kernel.config import ChorusConfig
    from shared.models.weights import WeightsHeader

    cfg = ChorusConfig(**json.loads(spec.read_text()))
    learners: dict[str, Any] = {}
    maps = Maps()
    conn.send(("ready", os.getpid(), torch.get_num_threads()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return _close(learners)
        if msg[0] == "exit":
            return _close(learners)
        _, model, get, method, args, put, *rest = msg
        extra: dict[str, Any] = rest[0] if rest else {}
        info: dict[str, Any] = {}
        learner = learners.get(model)
        try:
            if learner is None:
                t0 = time.perf_counter()
                learner = _build(cfg, model, extra)
                learners[model] = learner
                info["build_s"] = time.perf_counter() - t0
            gang = hasattr(learner, "export_swap")
            if get is not None:
                path, nbytes, header, meta = get
                t0 = time.perf_counter()
                if gang:  # every rank reads its own shard of the gang's state
                    learner.import_swap(Path(path), meta)
                else:
                    body = maps.get(path, nbytes, create=False)
                    import_state(learner, WeightsHeader.unpack(header), body[:nbytes], SwapMeta.unpack(meta))
                info["get_s"] = time.perf_counter() - t0
                info["get_bytes"] = nbytes
            c0, w0 = time.process_time(), time.perf_counter()
            value = _dispatch(learner, method, pickle.loads(args))
            info["cpu_s"], info["call_s"] = time.process_time() - c0, time.perf_counter() - w0
            if put is not None:
                path, _resident = put
                t0 = time.perf_counter()
                if gang:
                    size, packed = learner.export_swap(Path(path))
                    info["set"] = (size, b"", packed)
                else:
                    out = maps.get(path, state_bytes(learner), create=True)
                    h, _, m = export_state(learner, out=out)
                    info["set"] = (h.nbytes, h.pack(), m.pack())
                info["set_s"] = time.perf_counter() - t0
            info.update(version=learner.version, accumulated=learner.accumulated)
            conn.send(("ok", pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), info))
        except Exception as exc:  # the learner's error goes back to the trainer, which counts and drops
            if learner is not None and hasattr(learner, "alive") and not learner.alive():
                # a rank of the gang is gone: the group is broken, and so is this slot (the pool starts it afresh,
                # gets the gang's stored state back and runs the call again)
                print(f"slot {index}: a rank of {model}'s group is gone ({learner.exit_codes()}): {exc}",
                      file=sys.stderr, flush=True)
                os._exit(3)
            conn.send(("error", type(exc).__name__, str(exc), info))


def _build(cfg: Any, model: str, extra: dict[str, Any]) -> Any:
    """``model``'s learner: the torch learner, or a DeepSpeed model's group (rank 0 here, the other ranks pinned
    to the cores of the gang's other slots)."""
    import torch

    from services.trainer.learner import Learner

    if cfg.models[model].trainer.backend == "deepspeed":
        from services.trainer.zero import TrainerGroup

        return TrainerGroup(cfg, model, threads=torch.get_num_threads(), cores=extra.get("ranks_cores"))
    return Learner(cfg, model)


def _close(learners: dict[str, Any]) -> int:
    for learner in learners.values():  # a gang's ranks leave with it
        if hasattr(learner, "export_swap"):
            with contextlib.suppress(Exception):
                learner.close()
    return 0


def _dispatch(learner: Any, method: str, args: tuple[Any, ...]) -> Any:
    if method == "describe":
        net = getattr(learner, "local", learner).net  # a gang's: rank 0's (ZeRO-3's partitioned sizes by ds_numel)
        sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in net.parameters()]
        return {"vocab_size": learner.vocab_size, "context": learner.context, "adapters": learner.adapters,
                "params": sum(n for n, _ in sizes), "trainable": sum(n for n, g in sizes if g)}
    if method == "noop":  # a Get or a Set alone
        return None
    if method not in {"micro_batch", "step", "named_tensors", "optimizer_state", "state_dict", "load_state_dict",
                      "save_checkpoint", "restore_latest"}:
        raise ValueError(f"a slot does not run {method!r}")
    value = getattr(learner, method)(*args)
    if method == "named_tensors":
        return {k: t.detach().cpu().clone() for k, t in value.items()}
    return value


def _exit_with_pool(parent: int) -> None:
    """The process ends when the pool's does (checked every half second, also in the middle of a call). Not
    PR_SET_PDEATHSIG: that fires when the pool *thread* that started this process ends, and any of the pool's
    threads may start a slot."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def main(argv: list[str]) -> int:
    fd, spec, index, cores = int(argv[0]), Path(argv[1]), int(argv[2]), argv[3]
    parent = int(os.environ.get("CHORUS_SLOT_PARENT", "0")) or os.getppid()
    if os.getppid() != parent:
        return 1  # the pool died before this slot could serve it
    threading.Thread(target=_exit_with_pool, args=(parent,), daemon=True, name="exit-with-pool").start()
    import torch

    if cores:
        wanted = {int(c) for c in cores.split(",")}
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setaffinity(0, wanted)
        torch.set_num_threads(len(wanted))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pool stops its slots itself (Ctrl-C reaches the group)
    return serve(Connection(fd), spec, index)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
