"""Soak: a tiny two-model run at high concurrency for a long time, watching memory and streams for leaks.

    python loadtests/soak.py --minutes 30

Starts ``chorus up`` on ``configs/tiny-chain.yaml`` (embedded nats-server) with ``workflow.concurrency`` 64, no
version limit and the events stream capped at ``--events-max-mb`` (it keeps the newest records up to its cap, so
in a long run it grows to the cap and stays there), samples every ``--sample-s`` seconds the resident memory of every service process and of
nats-server, the size of every stream of the run and the number of JetStream consumers, then stops the run
with Ctrl-C as a user would. Prints, after the warm-up, each process's RSS growth (in % and % per hour) and
each stream's growth per hour, and writes ``soak.csv``, ``soak.png`` and ``report.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.kernel.bus import kv_get_int, run_consumers  # noqa: E402
from shared.kernel.subjects import Names  # noqa: E402
from shared.launcher.supervisor import descendants  # noqa: E402

CHORUS = str(Path(sys.executable).parent / "chorus")
RSS_LIMIT_PCT = 10.0


def process_key(pid: int) -> str | None:
    """``trainer-solver_lm-0`` for a service process, ``actions.worker-<pid>`` for a helper process of one,
    ``nats-server`` for the broker, None otherwise."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if any(a.endswith("nats-server") for a in argv[:1]):
        return "nats-server"
    if "-m" not in argv:
        return None
    module = argv[argv.index("-m") + 1]
    if not module.startswith("services."):
        return None
    if module.count(".") > 1:  # not a service's entry point: a worker process of one
        return f"{module.removeprefix('services.')}-{pid}"

    def opt(name: str) -> str | None:
        return argv[argv.index(name) + 1] if name in argv else None

    parts = [module.split(".")[1], opt("--model"), opt("--instance") or "0"]
    return "-".join(p for p in parts if p)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) in value per hour."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    den = sum((t - mx) ** 2 for t, _ in points)
    return 0.0 if den == 0 else sum((t - mx) * (v - my) for t, v in points) / den * 3600


async def soak(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CHORUS_WORKFLOW__CONCURRENCY": str(args.concurrency),
           "CHORUS_TRAIN__MAX_VERSIONS": "100000000", "CHORUS_TRAIN__CHECKPOINT_EVERY": "0",
           "CHORUS_NATS__EVENTS_MAX_MB": str(args.events_max_mb), "CHORUS_RUN__DIR": str(out / "runs")}
    log = open(out / "chorus-up.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([CHORUS, "up", args.config], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    rows: list[dict[str, float | str]] = []
    pids_seen: dict[str, set[int]] = {}
    try:
        run_dir = None
        for _ in range(600):
            found = sorted((out / "runs").glob("*/config.yaml"))
            if found:
                run_dir = found[-1].parent
                break
            await asyncio.sleep(0.2)
        if run_dir is None:
            raise RuntimeError(f"chorus up wrote no run directory; see {out / 'chorus-up.log'}")
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        names, models = Names(cfg["run"]["id"]), list(cfg["models"])
        nc = await nats.connect(cfg["nats"]["url"], max_reconnect_attempts=-1)
        js = nc.jetstream(timeout=10)
        t0 = time.monotonic()
        next_print = 0.0
        print(f"soak of run {names.run} for {args.minutes} min, sampling every {args.sample_s:g}s ({run_dir})")
        while time.monotonic() - t0 < args.minutes * 60:
            if proc.poll() is not None:
                raise RuntimeError(f"chorus up exited with {proc.returncode}; see {out / 'chorus-up.log'}")
            t = time.monotonic() - t0
            row: dict[str, float | str] = {"t": round(t, 1)}
            for pid in descendants(proc.pid):
                key = process_key(pid)
                mb = rss_mb(pid) if key else None
                if key and mb is not None:
                    row[f"rss:{key}"] = round(mb, 1)
                    pids_seen.setdefault(key, set()).add(pid)
            with contextlib.suppress(Exception):
                kv = await js.key_value(names.kv_bucket)
                for m in models:
                    row[f"version:{m}"] = await kv_get_int(kv, Names.trained_key(m))
                for stream in names.streams(models):
                    state = (await js.stream_info(stream)).state
                    row[f"msgs:{stream}"] = state.messages
                    row[f"mb:{stream}"] = round(state.bytes / 2**20, 3)
                row["consumers"] = sum((await run_consumers(js, names, models)).values())
            rows.append(row)
            if t >= next_print:
                next_print = t + 60
                versions = ", ".join(f"{m} v{row.get(f'version:{m}', '?')}" for m in models)
                print(f"  {t / 60:5.1f} min: {versions}; consumers {row.get('consumers', '?')}; "
                      f"services {sum(1 for k in row if k.startswith('rss:'))}", flush=True)
            await asyncio.sleep(args.sample_s)
        await nc.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return report(rows, args, out, pids_seen)


def report(rows: list[dict[str, float | str]], args: argparse.Namespace, out: Path,
           pids_seen: dict[str, set[int]]) -> int:
    keys = sorted({k for r in rows for k in r if k != "t"})
    with open(out / "soak.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["t", *keys])
        w.writeheader()
        w.writerows(rows)
    warm_s = min(args.warmup_min * 60, 0.2 * args.minutes * 60)
    after = [r for r in rows if float(r["t"]) >= warm_s]
    if len(after) < 2:
        print("too few samples after the warm-up for a verdict")
        return 1
    lines = [f"# Soak: {args.minutes} min, concurrency {args.concurrency}, warm-up {warm_s / 60:.1f} min", "",
             "| process | RSS after warm-up (MB) | RSS at end (MB) | growth | slope (%/h) | restarts |",
             "|---|---|---|---|---|---|"]
    worst = 0.0
    for key in sorted(k for k in keys if k.startswith("rss:")):
        pts = [(float(r["t"]), float(r[key])) for r in after if key in r]
        if len(pts) < 2:
            continue
        first, last = pts[0][1], pts[-1][1]
        growth = 100 * (last - first) / first
        worst = max(worst, growth)
        name = key[4:]
        lines.append(f"| {name} | {first:.0f} | {last:.0f} | {growth:+.1f}% | "
                     f"{100 * slope_per_hour(pts) / first:+.1f} | {len(pids_seen.get(name, ())) - 1} |")
    lines += ["", "| stream | msgs after warm-up | msgs at end | MB after warm-up | MB at end | MB per hour |",
              "|---|---|---|---|---|---|"]
    for key in sorted(k for k in keys if k.startswith("mb:")):
        stream = key[3:]
        mb = [(float(r["t"]), float(r[key])) for r in after if key in r]
        msgs = [float(r[f"msgs:{stream}"]) for r in after if f"msgs:{stream}" in r]
        if len(mb) < 2:
            continue
        lines.append(f"| {stream} | {msgs[0]:.0f} | {msgs[-1]:.0f} | {mb[0][1]:.2f} | {mb[-1][1]:.2f} | "
                     f"{slope_per_hour(mb):+.2f} |")
    consumers = [int(r["consumers"]) for r in after if "consumers" in r]
    versions = {k[8:]: (after[0].get(k), after[-1].get(k)) for k in keys if k.startswith("version:")}
    lines += ["", f"consumers after warm-up: min {min(consumers, default=0)}, max {max(consumers, default=0)}",
              "versions over the measured part: " + ", ".join(f"{m} {a} -> {b}" for m, (a, b) in versions.items()),
              f"largest RSS growth after warm-up: {worst:+.1f}% (limit {RSS_LIMIT_PCT:g}%)"]
    text = "\n".join(lines)
    print(text)
    (out / "report.md").write_text(text + "\n")
    plot(rows, keys, warm_s, out / "soak.png")
    print(f"wrote {out / 'soak.csv'}, {out / 'soak.png'}, {out / 'report.md'}")
    return 0 if worst <= RSS_LIMIT_PCT else 1


def plot(rows: list[dict[str, float | str]], keys: list[str], warm_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    for key in (k for k in keys if k.startswith("rss:")):
        pts = [(float(r["t"]) / 60, float(r[key])) for r in rows if key in r]
        ax1.plot(*zip(*pts, strict=True), label=key[4:])
    ax1.set_ylabel("RSS (MB)")
    ax1.legend(fontsize=7, ncol=3)
    for key in (k for k in keys if k.startswith("mb:")):
        pts = [(float(r["t"]) / 60, float(r[key])) for r in rows if key in r]
        ax2.plot(*zip(*pts, strict=True), label=key[3:])
    ax2.set_ylabel("stream size (MB)")
    ax2.set_xlabel("minutes")
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.axvline(warm_s / 60, color="grey", linestyle=":")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--config", default=str(ROOT / "configs" / "tiny-chain.yaml"))
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--sample-s", type=float, default=15.0)
    p.add_argument("--warmup-min", type=float, default=5.0, help="left out of the verdict (at most 20%% of the run)")
    p.add_argument("--events-max-mb", type=int, default=16,
                   help="cap of the events stream (nats.events_max_mb), small enough that the cap shows in a soak")
    p.add_argument("--out", default=str(ROOT / "runs" / "soak"))
    sys.exit(asyncio.run(soak(p.parse_args())))


if __name__ == "__main__":
    main()
