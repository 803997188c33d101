"""The ``chorus`` command: serve one service, run a whole config locally, plot, status and monitor."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Group, RenderableType
from rich.live import Live
from rich.table import Table

from shared.kernel.config import ChorusConfig, ConfigError, load_config
from shared.kernel.logs import setup_logging
from shared.kernel.subjects import SERVICES, Names
from shared.launcher.progress import make_console
from shared.launcher.views import (
    act_table,
    agent_table,
    balance_table,
    eval_record_table,
    pool_table,
    report_tables,
)

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Chorus: asynchronous multi-agent, multi-model LLM RL on NATS JetStream.")
console = make_console()
err = make_console(stderr=True)

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="run config YAML")]
NatsOpt = Annotated[str | None, typer.Option("--nats", help="NATS URL (overrides nats.url)")]
RunOpt = Annotated[str | None, typer.Option("--run", help="run id (default: run.id of the config)")]
ServiceArg = Annotated[str, typer.Argument(help=f"one of {', '.join(SERVICES)}")]
ModelOpt = Annotated[str | None, typer.Option("--model", help="model (per-model services)")]
InstanceOpt = Annotated[str, typer.Option("--instance", help="instance id")]


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's project.version)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("chorus")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed: pip install -e .)"


def _print_version(value: bool) -> None:
    if value:
        console.print(f"chorus {package_version()}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="print the version and exit")] = False,
) -> None:
    """Chorus: asynchronous multi-agent, multi-model LLM RL on NATS JetStream."""


SHIPPED_CONFIGS = Path(__file__).resolve().parents[2] / "configs"  # the configs/ of a source checkout


def find_config(config: Path) -> Path:
    """A config given as a path, or by the name of a shipped one: ``tiny-chain`` is ``configs/tiny-chain.yaml``
    (in the working directory, else in the checkout chorus runs from). A name found nowhere is returned as is:
    loading it says that the file does not exist, and which configs there are."""
    if config.exists() or config.suffix in (".yaml", ".yml") or len(config.parts) > 1:
        return config
    for folder in (Path("configs"), SHIPPED_CONFIGS):
        for suffix in (".yaml", ".yml"):
            candidate = folder / f"{config}{suffix}"
            if candidate.is_file():
                return candidate
    return config


def shipped_names() -> list[str]:
    folder = Path("configs") if Path("configs").is_dir() else SHIPPED_CONFIGS
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def _load(config: Path, run: str | None = None) -> ChorusConfig:
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        err.print(f"[red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None
    if run:
        cfg.run.id = run
    return cfg


def _url(cfg: ChorusConfig, nats: str | None) -> str:
    url = nats or cfg.nats.url
    if not url:
        err.print("[red]error:[/] no NATS URL: pass --nats nats://HOST:PORT or set nats.url in the config")
        raise typer.Exit(2)
    return url


@app.command(context_settings={"allow_extra_args": False})
def serve(
    service: ServiceArg,
    config: ConfigOpt,
    nats: NatsOpt = None,
    model: ModelOpt = None,
    instance: InstanceOpt = "0",
    exit_when_done: Annotated[bool, typer.Option(
        "--exit-when-done", envvar="CHORUS_EXIT_WHEN_DONE",
        help="exit 0 once every model of the run reached train.max_versions (containers, Jobs)")] = False,
    run_file: Annotated[Path | None, typer.Option(
        "--run-file", help="wait for this file (written by `chorus new-run`) and serve the run id in it")] = None,
) -> None:
    """Run one service in this process (bare metal, containers, systemd)."""
    if service not in SERVICES:
        err.print(f"[red]error:[/] unknown service {service!r}: choose one of {', '.join(SERVICES)}")
        raise typer.Exit(2)
    if run_file is not None:
        _run_id_from_file(run_file)
    argv = [sys.executable, "-m", f"services.{service}", "--config", str(config), "--instance", instance]
    if nats:
        argv += ["--nats", nats]
    if model:
        argv += ["--model", model]
    if exit_when_done:
        argv.append("--exit-when-done")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)  # one process: signals from systemd/docker reach the service itself


def _run_id_from_file(run_file: Path) -> None:
    """Wait for the run file of a deployment and make its run id the one every config load sees."""
    from shared.launcher.deploy import Interrupted, wait_run_file

    try:
        run_id = wait_run_file(run_file, on_wait=lambda: err.print(f"waiting for the run id in {run_file}",
                                                                   highlight=False))
    except Interrupted:
        raise typer.Exit(0) from None  # stopped before the run began: nothing to drain
    except ValueError as exc:
        err.print(f"[red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None
    os.environ["CHORUS_RUN__ID"] = run_id  # the exec'd service loads its config with it


@app.command("new-run")
def new_run(
    config: ConfigOpt,
    out: Annotated[Path | None, typer.Option("--out", help="write the run id to this file (atomically)")] = None,
) -> None:
    """Make a fresh run id, <run.id>-YYYYmmdd-HHMMSS-<4 hex>, print it and write it to --out: one per deployment
    (`docker compose up`), read by `chorus serve --run-file`."""
    from shared.launcher.deploy import new_run_id, write_run_file

    run_id = new_run_id(_load(config).run.id)
    if out is not None:
        write_run_file(out, run_id)
    console.print(run_id, highlight=False)


@app.command()
def health(
    service: ServiceArg,
    config: ConfigOpt,
    nats: NatsOpt = None,
    model: ModelOpt = None,
    instance: InstanceOpt = "0",
    run: RunOpt = None,
    run_file: Annotated[Path | None, typer.Option("--run-file", help="read the run id from this file")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds to wait for the answer")] = 3.0,
) -> None:
    """Exit 0 if this service instance answers its NATS micro-service ping, else 1 with the reason (a probe for
    containers, Kubernetes and scripts). Without --run/--run-file any run made from the config's run.id counts."""
    from shared.launcher.deploy import probe, read_run_file

    if service not in SERVICES:
        err.print(f"unhealthy: unknown service {service!r}: choose one of {', '.join(SERVICES)}", highlight=False)
        raise typer.Exit(2)
    cfg = _load(config, run)
    if run_file is not None and run is None:
        try:
            run = read_run_file(run_file)
        except (ValueError, OSError) as exc:
            err.print(f"unhealthy: {exc}", highlight=False)
            raise typer.Exit(1) from None
        if run is None:
            err.print(f"unhealthy: no run id in {run_file} yet", highlight=False)
            raise typer.Exit(1)
    url = _url(cfg, nats)
    setup_logging(json=False, level="CRITICAL")  # the one line below is the output, not reconnect chatter
    ok, reason = asyncio.run(probe(url, service, model=model, instance=instance, run=run,
                                    base=cfg.run.id, timeout_s=timeout,
                                    connect_timeout_s=min(timeout, cfg.nats.connect_timeout_s), nats_cfg=cfg.nats))
    (console if ok else err).print(("healthy: " if ok else "unhealthy: ") + reason, highlight=False, soft_wrap=True)
    raise typer.Exit(0 if ok else 1)


@app.command()
def up(
    config: Annotated[Path | None, typer.Argument(
        help="run config YAML, or the name of one in configs/ (tiny-chain, demo, ...); leave out with --resume")] = None,
    timeout_s: Annotated[float | None, typer.Option("--timeout-s", help="fail if not finished in time")] = None,
    resume: Annotated[Path | None, typer.Option(
        "--resume", help="continue the run in this directory (runs/<run-id>) after it was stopped or killed")] = None,
    run: Annotated[str | None, typer.Option(
        "--run", help="run id as given (default: run.id of the config with -YYYYmmdd-HHMMSS appended); an id that "
        "already exists on the NATS server is refused: continue it with --resume, or `chorus clean` it")] = None,
    dashboard: Annotated[bool, typer.Option(
        "--dashboard", help="serve the run's dashboard (chorus dashboard) on loopback while it runs")] = False,
    dashboard_port: Annotated[int | None, typer.Option(
        "--dashboard-port", help="with --dashboard: its port (default 8265, or the next free one)")] = None,
) -> None:
    """Run a whole config on this machine until every model reaches train.max_versions, or resume a run."""
    import uvloop

    from shared.kernel.bus import BrokerUnreachable
    from shared.launcher.supervisor import run_up

    if run is not None and resume is not None:
        err.print("[red]error:[/] --run names a new run; --resume continues the run of its directory: give one")
        raise typer.Exit(2)
    if run is not None:
        from shared.kernel.subjects import check_token

        try:
            check_token(run, "--run")
        except ValueError as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None
    if (config is None) == (resume is None):
        err.print("[red]error:[/] give either a config (chorus up CONFIG) or a run directory to continue "
                  "(chorus up --resume runs/<run-id>)")
        raise typer.Exit(2)
    setup_logging(json=False, level="ERROR")  # the progress view is the output; client reconnect chatter is not
    if config is not None:
        config = find_config(config)
    checked = config if config is not None else resume / "config.yaml" if resume is not None else None
    if checked is not None and checked.is_file():
        _exit_on_problems(_load(checked))  # before any service starts: what a restart cannot fix
    try:
        dash = None
        if dashboard or dashboard_port is not None:
            dash = ("127.0.0.1", dashboard_port if dashboard_port is not None else _free_dashboard_port("127.0.0.1"))
        code = uvloop.run(run_up(config, timeout_s=timeout_s, console=console, resume=resume, run_id=run,
                                 dashboard=dash))
    except ConfigError as exc:
        names = shipped_names()
        hint = f" (shipped configs: {', '.join(names)})" if names and config is not None and not config.exists() else ""
        err.print(f"[red]error:[/] {exc}{hint}", highlight=False)
        raise typer.Exit(2) from None
    except BrokerUnreachable as exc:  # nats.url names a server that does not answer
        err.print(f"[red]error:[/] {exc}", highlight=False)
        raise typer.Exit(1) from None
    raise typer.Exit(code)


def _exit_on_problems(cfg: ChorusConfig, shown: list[str] | None = None) -> int:
    """Print every problem :mod:`shared.launcher.precheck` finds and exit 2; the number of checks otherwise."""
    from shared.launcher.precheck import problems

    found = problems(cfg, shown)
    if found:
        err.print(f"[red]error:[/] the config has {len(found)} problem(s); nothing was started:", highlight=False)
        for p in found:
            err.print(f"  {p}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    return len(cfg.models)


@app.command()
def check(
    config: Annotated[Path, typer.Argument(help="run config YAML, or the name of one in configs/")],
) -> None:
    """The checks `chorus up` runs before it starts anything: the config is valid and every model directory, dataset,
    workflow and reward function and credentials file it names opens. Exit 0, or 2 naming each problem."""
    config = find_config(config)
    cfg = _load(config)
    setup_logging(json=False, level="ERROR")
    shown: list[str] = []
    _exit_on_problems(cfg, shown)
    for line in shown:
        console.print(line, highlight=False, markup=False)
    console.print(f"{config}: ok ({len(cfg.models)} model(s), task {cfg.task.name}, workflow {cfg.workflow.name}, "
                  f"{len(cfg.agents)} agent(s))", highlight=False)


@app.command()
def plot(
    run_dir: Annotated[Path, typer.Argument(help="a run directory (with metrics.jsonl) or a metrics.jsonl file")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="PNG path (default RUN_DIR/reward.png; the loss statistics go beside it, RUN_DIR/training.png or <OUT>-training.png)")] = None,
) -> None:
    """Plot reward, staleness and held-out scores per version (reward.png) and the loss's statistics
    (training.png) from a run's metrics.jsonl, and print the summary."""
    from shared.results.plotting import plot_run, plot_training

    metrics = run_dir if run_dir.is_file() else run_dir / "metrics.jsonl"
    if not metrics.is_file():
        err.print(f"[red]error:[/] {metrics} does not exist (the trainers write it in the run directory)")
        raise typer.Exit(2)
    try:
        png = plot_run(metrics, out)
    except ValueError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    console.print(f"wrote {png}")
    try:
        console.print(f"wrote {plot_training(metrics, png.with_name(png.stem + '-training.png') if out else None)}")
    except ValueError as exc:
        console.print(f"[yellow]no training plot: {exc}")
    for table in report_tables(metrics):
        console.print(table)


async def _status(cfg: ChorusConfig, url: str) -> RenderableType:
    from nats.js.errors import NotFoundError

    from shared.kernel.bus import connect, kv_get_int
    from shared.launcher.supervisor import ping_run

    names = Names(cfg.run.id)
    nc = await connect(url, "chorus-status", timeout_s=cfg.nats.connect_timeout_s, nats_cfg=cfg.nats, kind="observer")
    try:
        js = nc.jetstream(timeout=5.0)
        t = Table(title=f"run {cfg.run.id} at {url}")
        for col in ("model", "served version", "trained version", "traj msgs", "ready msgs"):
            t.add_column(col, justify="left" if col == "model" else "right")
        try:
            kv = await js.key_value(names.kv_bucket)
        except NotFoundError:
            kv = None
        for m in cfg.models:
            served = await kv_get_int(kv, Names.version_key(m), -1) if kv else -1
            trained = await kv_get_int(kv, Names.trained_key(m), -1) if kv else -1
            depths = []
            for stream in (names.traj_stream(m), names.ready_stream(m)):
                try:
                    depths.append(str((await js.stream_info(stream)).state.messages))
                except NotFoundError:
                    depths.append("-")
            t.add_row(m, _v(served), _v(trained), *depths)
        answers = await ping_run(nc, cfg.run.id, window_s=0.5)
        t.caption = f"{len(answers)} service instance(s) answered $SRV.PING: " + ", ".join(sorted(
            f"{a.get('name', '?')}[{(a.get('metadata') or {}).get('model') or '-'}/"
            f"{(a.get('metadata') or {}).get('instance', '?')}]" for a in answers)) if answers else \
            "no service of this run answered $SRV.PING"
        if kv is None:
            t.caption += f" (no KV bucket {names.kv_bucket}: is the run id right? `chorus up` appends a timestamp)"
        parts: list[RenderableType] = [t, await _run_state_line(cfg, kv)]
        parts += oom_lines(await _service_metrics(nc, names, answers, "trainer"))
        for extra in (agent_table(await _mq_metrics(nc, names, answers, list(cfg.models))),
                      balance_table(await _service_metrics(nc, names, answers, "coordinator")),
                      act_table(await _service_metrics(nc, names, answers, "actions")),
                      pool_table(await _service_metrics(
                          nc, names, [a for a in answers if not (a.get("metadata") or {}).get("model")], "trainer"))):
            if extra is not None:
                parts.append(extra)
        return t if len(parts) == 1 else Group(*parts)
    finally:
        await nc.close()


async def _run_state_line(cfg: ChorusConfig, kv: Any) -> str:
    """Whether the run has finished, from its KV bucket (the trainers' trained versions, the final evaluation)."""
    from shared.kernel.runstate import run_state

    if kv is None:
        return f"run {cfg.run.id}: not started on this server (no KV bucket)"
    state = await run_state(kv, cfg)
    if state.finished:
        return (f"[green]run {cfg.run.id} finished[/]: every model reached train.max_versions "
                f"({cfg.train.max_versions})" + (" and the final weights were evaluated" if cfg.eval.every else ""))
    if state.all_trained:
        return f"run {cfg.run.id} in progress: every model is trained; waiting for the final evaluation"
    left = ", ".join(f"{m} {v}/{cfg.train.max_versions}" for m, v in sorted(state.trained.items()))
    return f"run {cfg.run.id} in progress: trained versions {left}"


async def _mq_metrics(nc: Any, names: Names, answers: list[dict[str, Any]],
                      models: list[str]) -> dict[str, dict[str, Any]]:
    """Metrics of the mq of every model, by model, from its status endpoint: each configured model's first instance
    is asked whether or not it answered the ping in time (a busy mq answers late), and any other that did."""
    import nats

    from shared.kernel.codec import DecodeError, decode_json

    async def ask(model: str, instance: str) -> tuple[str, Any]:
        try:
            msg = await nc.request(names.status("mq", model, instance), b"", timeout=2.0)
            return model, decode_json(msg.data)
        except (nats.errors.Error, TimeoutError, DecodeError):
            return model, None  # gone since the ping: the table shows what did answer

    metas = [a.get("metadata") or {} for a in answers if a.get("name") == "chorus-mq"]
    targets = {(m, "0") for m in models} | {(str(m.get("model")), str(m.get("instance"))) for m in metas}
    replies = await asyncio.gather(*(ask(model, instance) for model, instance in sorted(targets)))
    return {model: r for model, r in replies if isinstance(r, dict)}


async def _service_metrics(nc: Any, names: Names, answers: list[dict[str, Any]],
                           service: str) -> dict[str, dict[str, Any]]:
    """Metrics of every instance of ``service`` that answered the ping, by instance (``<model>-<instance>`` for an
    instance of a model)."""
    import nats

    from shared.kernel.codec import DecodeError, decode_json

    async def ask(model: str | None, instance: str) -> tuple[str, Any]:
        key = f"{model}-{instance}" if model else instance
        try:
            msg = await nc.request(names.status(service, model, instance), b"", timeout=2.0)
            return key, decode_json(msg.data)
        except (nats.errors.Error, TimeoutError, DecodeError):
            return key, None

    metas = [a.get("metadata") or {} for a in answers if a.get("name") == f"chorus-{service}"]
    replies = await asyncio.gather(*(ask(m.get("model") or None, str(m.get("instance"))) for m in metas))
    return {i: r for i, r in replies if isinstance(r, dict)}


def oom_lines(metrics: dict[str, Any]) -> list[str]:
    """A line per trainer whose processes the kernel's OOM killer ended (its ``oom_kills`` counter)."""
    out = []
    for instance, m in sorted(metrics.items()):
        counters = m.get("counters") if isinstance(m.get("counters"), dict) else {}
        if counters.get("oom_kills"):
            out.append(f"[red]out of memory:[/] {counters['oom_kills']} process(es) of trainer {instance} "
                       f"({m.get('model') or 'pool'}) killed by the kernel's OOM killer; its events say what to change "
                       "(chorus monitor --raw events.trainer)")
    return out


def _v(v: int) -> str:
    return "-" if v < 0 else str(v)


def run_dir_config(target: Path | None, config: Path | None, command: str) -> Path:
    """The config a run-directory command reads: ``--config``, else ``TARGET/config.yaml`` of a run directory (what
    `chorus up` writes there), else TARGET itself as a config file."""
    if config is not None:
        if target is not None:
            err.print(f"[red]error:[/] chorus {command}: give a run directory or --config, not both")
            raise typer.Exit(2)
        return config
    if target is None:
        err.print(f"[red]error:[/] chorus {command} needs a run directory (runs/<run-id>) or --config CONFIG")
        raise typer.Exit(2)
    if target.is_dir():
        if not (target / "config.yaml").is_file():
            err.print(f"[red]error:[/] {target / 'config.yaml'} does not exist: `chorus up` writes the run's config "
                      "there; for a run started with `chorus serve`, pass its config with --config", highlight=False)
            raise typer.Exit(2)
        return target / "config.yaml"
    return find_config(target)


@app.command()
def status(
    target: Annotated[Path | None, typer.Argument(
        help="a run directory (runs/<run-id>) or a run config")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="run config YAML")] = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
) -> None:
    """Versions, stream depths, live services and mq table counts of a run: `chorus status runs/<run-id>` (its
    config.yaml), or --config; with the run's server gone, what the run directory holds."""
    cfg = _load(run_dir_config(target, config, "status"), run)
    url = _url(cfg, nats)
    setup_logging(json=False, level="ERROR")
    from nats.errors import Error as NatsError

    try:
        table = asyncio.run(asyncio.wait_for(_status(cfg, url), 30))
    except ConfigError as exc:  # a credentials file that is not there
        err.print(f"[red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None
    except (OSError, TimeoutError, NatsError) as exc:
        _offline_status(cfg, url, exc)
    console.print(table)


def _offline_status(cfg: ChorusConfig, url: str, exc: BaseException) -> NoReturn:
    """No bus: what the run directory holds. Exit 0 for a finished run (its server stopped with it), 1 otherwise."""
    from shared.launcher.runfiles import offline_view

    run_dir = cfg.run_dir
    done, view = offline_view(cfg, run_dir)
    if done is None:
        _bus_gone(url, exc)
    console.print(f"no NATS server at {url} (a run's embedded server stops with `chorus up`); from {run_dir}:",
                  highlight=False)
    console.print(view)
    raise typer.Exit(0 if done else 1)


def _bus_gone(url: str, exc: BaseException) -> NoReturn:
    from shared.kernel.bus import BrokerUnreachable

    why = str(exc) if isinstance(exc, BrokerUnreachable) else \
        f"cannot reach NATS at {url} (or it went away): {type(exc).__name__}: {exc}"
    err.print(f"[red]error:[/] {why}", highlight=False)
    raise typer.Exit(1) from None


MONITOR_LINE_S = 10.0  # how often `chorus monitor` prints a summary line when stdout is not a terminal


async def _monitor(cfg: ChorusConfig, url: str, duration_s: float | None) -> int:
    """Until the run has finished (0), the bus is gone for longer than nats.connect_timeout_s (1), or
    ``duration_s`` passed (0)."""
    from nats.errors import Error as NatsError
    from nats.js.errors import NotFoundError

    from shared.kernel.bus import connect
    from shared.kernel.codec import DecodeError, decode_json
    from shared.kernel.runstate import run_finished
    from shared.launcher.progress import MonitorState

    names = Names(cfg.run.id)
    state = MonitorState(agents={a: spec.model for a, spec in cfg.agents.items()})
    nc = await asyncio.wait_for(connect(url, "chorus-monitor", timeout_s=cfg.nats.connect_timeout_s,
                                        nats_cfg=cfg.nats, kind="observer"), 30)

    async def on_metrics(msg) -> None:  # noqa: ANN001 - nats Msg
        with contextlib.suppress(DecodeError):
            state.on_metrics(msg.subject, decode_json(msg.data))

    async def on_event(msg) -> None:  # noqa: ANN001
        with contextlib.suppress(DecodeError):
            state.on_event(msg.subject, decode_json(msg.data))

    await nc.subscribe(names.metrics_all(), cb=on_metrics)
    await nc.subscribe(names.events_all(), cb=on_event)
    end = None if duration_s is None else time.monotonic() + duration_s
    kv = None
    away_since: float | None = None
    next_line = 0.0
    live = Live(state.table(), console=console, refresh_per_second=2) if console.is_terminal else None
    try:
        with live if live is not None else contextlib.nullcontext():
            while end is None or time.monotonic() < end:
                await asyncio.sleep(0.5)
                now = time.monotonic()
                if live is not None:
                    live.update(state.table())
                elif now >= next_line:
                    next_line = now + MONITOR_LINE_S
                    console.print(state.line(), highlight=False)
                if not nc.is_connected:
                    away_since = away_since or now
                    if now - away_since > cfg.nats.connect_timeout_s:
                        err.print(f"[red]error:[/] lost the connection to NATS at {url} for more than "
                                  f"nats.connect_timeout_s ({cfg.nats.connect_timeout_s:g} s): the bus is gone",
                                  highlight=False)
                        return 1
                    continue
                away_since = None
                try:
                    if kv is None:
                        kv = await nc.jetstream(timeout=2.0).key_value(names.kv_bucket)
                    if await run_finished(kv, cfg):
                        if live is not None:
                            live.update(state.table())
                        console.print(f"run {cfg.run.id} finished: every model reached train.max_versions "
                                      f"({cfg.train.max_versions})", highlight=False)
                        return 0
                except NotFoundError:
                    pass  # the run has not created its bucket yet
                except (NatsError, TimeoutError):
                    pass  # the connection state above decides
        return 0
    finally:
        await nc.close()


async def _watch(cfg: ChorusConfig, url: str, subject: str, count: int | None, duration_s: float | None) -> int:
    from shared.kernel.bus import connect
    from shared.launcher.watch import watch

    nc = await asyncio.wait_for(connect(url, "chorus-monitor", timeout_s=cfg.nats.connect_timeout_s,
                                        nats_cfg=cfg.nats, kind="observer"), 30)
    prefix = Names(cfg.run.id).prefix
    try:
        seen = await watch(nc, prefix, subject.removeprefix(prefix + "."),
                           lambda text: console.print(text, highlight=False, markup=False, soft_wrap=True),
                           count=count, duration_s=duration_s)
    finally:
        await nc.close()
    return 0 if count is None or seen >= count else 1


@app.command()
def monitor(
    config: ConfigOpt, nats: NatsOpt = None, run: RunOpt = None,
    duration_s: Annotated[float | None, typer.Option("--duration-s", help="stop after this long")] = None,
    raw: Annotated[str | None, typer.Option(
        "--raw", help="print the messages of this subject of the run instead, decoded, one per line (wildcards: "
        "'metrics.>', 'events.*', 'traj.solver_lm')")] = None,
    count: Annotated[int | None, typer.Option("--count", help="with --raw: stop after this many messages")] = None,
) -> None:
    """Live tables until the run finishes or Ctrl-C: per model its version, reward, held-out pass@1, staleness and
    mq depth; per service instance what it does and any failure counters; the latest events (summary lines every
    10 s when stdout is not a terminal). With --raw, the messages of one subject."""
    from nats.errors import Error as NatsError

    cfg = _load(config, run)
    url = _url(cfg, nats)
    setup_logging(json=False, level="ERROR")
    try:
        code = asyncio.run(_monitor(cfg, url, duration_s) if raw is None else _watch(cfg, url, raw, count, duration_s))
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
    except (OSError, TimeoutError, NatsError) as exc:
        _bus_gone(url, exc)
    raise typer.Exit(code)


DASHBOARD_PORT = 8265  # chorus dashboard's default; taken: the next free one


async def _dashboard(cfg: ChorusConfig, url: str | None, host: str, port: int, run_dir: Path | None) -> int:
    import signal

    from shared.launcher.dashboard import Dashboard

    dash = Dashboard(cfg, url, host=host, port=port, run_dir=run_dir)
    try:
        await dash.start()
    except OSError as exc:
        err.print(f"[red]error:[/] cannot listen on {host}:{port}: {exc}", highlight=False)
        return 2
    where = run_dir if run_dir is not None else cfg.run_dir
    console.print(f"dashboard of run {cfg.run.id} at {dash.address} "
                  f"({'live from ' + url + ' and ' if url else ''}{where}); Ctrl-C stops it", highlight=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await dash.close()
    return 0


@app.command()
def dashboard(
    target: Annotated[Path | None, typer.Argument(
        help="a run directory (runs/<run-id>) or a run config")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="run config YAML")] = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
    port: Annotated[int | None, typer.Option("--port", help=f"port of the page (default {DASHBOARD_PORT}, or the "
                                                             "next free one; 0: any free port)")] = None,
    host: Annotated[str, typer.Option("--host", help="address to listen on (loopback by default: the page shows "
                                                     "what the agents said)")] = "127.0.0.1",
    offline: Annotated[bool, typer.Option("--offline", help="the run directory only: do not connect to NATS")] = False,
) -> None:
    """A page in the browser for a run: every model's curves, queues, throughput, scheduler, pool and the agents'
    trajectories; live from the bus while the run is (as the read-only observer), from the run directory after."""
    cfg = _load(run_dir_config(target, config, "dashboard"), run)
    url = None if offline else (nats or cfg.nats.url)
    run_dir = target if target is not None and target.is_dir() else None
    setup_logging(json=False, level="ERROR")
    raise typer.Exit(asyncio.run(_dashboard(cfg, url, host, _free_dashboard_port(host) if port is None else port,
                                            run_dir)))


def _free_dashboard_port(host: str) -> int:
    """DASHBOARD_PORT, or the next of the 50 after it that is free (0, any port, when none is)."""
    return next((p for p in range(DASHBOARD_PORT, DASHBOARD_PORT + 50) if _port_free(host, p)), 0)


def _port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="the run directory, runs/<run-id>")],
    model: Annotated[str, typer.Option("--model", "-m", help="the model to export (models.<name>)")],
    out: Annotated[Path, typer.Option("--out", "-o", help="new directory for the Hugging Face files")],
    version: Annotated[str | None, typer.Option(
        "--version", help="checkpoint version N, or best: the best held-out version (default: the newest)")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="the run's config (default: RUN_DIR/config.yaml, written by chorus up)")] = None,
) -> None:
    """Write a checkpoint in Hugging Face format (a LoRA model: its base and one PEFT directory per adapter)."""
    from shared.models.export import ExportError
    from shared.models.export import export as export_checkpoint

    if version is not None and version != "best" and not version.isdigit():
        err.print(f"[red]error:[/] --version {version!r}: expected a version number or best", highlight=False)
        raise typer.Exit(2)
    try:
        done = export_checkpoint(run_dir, model, out, version, config)
    except ExportError as exc:
        err.print(f"[red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None
    source = done.checkpoint or "the seeded start"
    console.print(f"exported {model} v{done.version}{' (best held-out)' if version == 'best' else ''} ({source}) to "
                  f"{out}", highlight=False, soft_wrap=True)
    for adapter, agents in done.adapters.items():
        console.print(f"  adapter {adapter} (agents {', '.join(agents)}): {out / 'adapters' / adapter}",
                      highlight=False, soft_wrap=True)
    if not done.tokenizer:
        console.print(f"  no tokenizer files (byte tokenizer of the tiny models: see {out / 'README.md'})",
                      highlight=False, soft_wrap=True)


async def _export_prometheus(url: str, subject: str, host: str, port: int, connect_timeout_s: float,
                             nats_cfg: Any = None) -> None:
    import signal

    from shared.kernel.bus import connect
    from shared.kernel.codec import DecodeError, decode_json
    from shared.results.promexport import Latest, serve_http

    latest = Latest()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    nc = await asyncio.wait_for(connect(url, "chorus-export-prometheus", timeout_s=connect_timeout_s,
                                        nats_cfg=nats_cfg, kind="observer" if nats_cfg is not None else None), 30)

    async def on_metrics(msg) -> None:  # noqa: ANN001 - nats Msg
        try:
            latest.update(msg.subject, decode_json(msg.data))
        except DecodeError as exc:
            latest.rejected += 1
            latest.last_error = f"{msg.subject}: {exc}"

    await nc.subscribe(subject, cb=on_metrics)
    await nc.flush()
    server = await serve_http(latest, host, port)
    bound = server.sockets[0].getsockname()
    console.print(f"serving {subject} from {url} on http://{bound[0]}:{bound[1]}/metrics", highlight=False,
                  soft_wrap=True)
    try:
        await stop.wait()
    finally:
        server.close()
        await server.wait_closed()
        await nc.drain()


@app.command("export-prometheus")
def export_prometheus(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="run config YAML (run id and NATS URL)")] = None,
    nats: NatsOpt = None, run: RunOpt = None,
    all_runs: Annotated[bool, typer.Option("--all-runs", help="every run on the server (a run label tells them "
                                                                "apart)")] = False,
    port: Annotated[int, typer.Option("--port", help="HTTP port (0: any free one)")] = 9477,
    host: Annotated[str, typer.Option("--host", help="HTTP address (0.0.0.0 for other hosts)")] = "127.0.0.1",
) -> None:
    """Serve every instance's latest metrics.> message in the Prometheus text format on /metrics, until SIGTERM."""
    cfg = _load(config, run) if config is not None else None
    url = nats or (cfg.nats.url if cfg else None)
    if not url:
        err.print("[red]error:[/] no NATS URL: pass --nats nats://HOST:PORT or a --config with nats.url")
        raise typer.Exit(2)
    run_id = run or (cfg.run.id if cfg else None)
    if not all_runs and not run_id:
        err.print("[red]error:[/] which run? pass --config runs/<run-id>/config.yaml, --run RUN_ID or --all-runs")
        raise typer.Exit(2)
    try:
        subject = Names.metrics_every_run() if all_runs else Names(str(run_id)).metrics_all()
    except ValueError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    setup_logging(json=False, level="ERROR")
    timeout = cfg.nats.connect_timeout_s if cfg else 5.0
    try:
        asyncio.run(_export_prometheus(url, subject, host, port, timeout, cfg.nats if cfg else None))
    except (OSError, TimeoutError) as exc:
        err.print(f"[red]error:[/] cannot reach NATS at {url} or serve on {host}:{port}: {type(exc).__name__}: {exc}")
        raise typer.Exit(1) from None


async def _clean(cfg: ChorusConfig, url: str, run: str) -> list[str]:
    from shared.kernel.bus import connect
    from shared.kernel.runbus import clean_run

    nc = await connect(url, "chorus-clean", timeout_s=cfg.nats.connect_timeout_s, nats_cfg=cfg.nats, kind="admin")
    try:
        return await clean_run(nc.jetstream(timeout=10.0), run)
    finally:
        await nc.close()


@app.command()
def clean(
    run: Annotated[str, typer.Argument(help="the run id whose streams and buckets to delete")],
    config: ConfigOpt, nats: NatsOpt = None,
) -> None:
    """Delete a run's streams, KV bucket and object store from the NATS server (its run directory stays)."""
    from nats.errors import Error as NatsError

    from shared.kernel.runbus import describe_stream
    from shared.kernel.subjects import check_token

    try:
        check_token(run, "run id")
    except ValueError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    cfg = _load(config)
    url = _url(cfg, nats)
    setup_logging(json=False, level="ERROR")
    try:
        removed = asyncio.run(asyncio.wait_for(_clean(cfg, url, run), 60))
    except ConfigError as exc:  # a credentials file that is not there
        err.print(f"[red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None
    except (OSError, TimeoutError, NatsError) as exc:
        err.print(f"[red]error:[/] cannot reach NATS at {url}: {type(exc).__name__}: {exc}")
        raise typer.Exit(1) from None
    if not removed:
        err.print(f"[red]error:[/] run {run} has no stream or bucket on the NATS server at {url}")
        raise typer.Exit(1)
    for stream in removed:
        console.print(f"removed {describe_stream(stream, run)}")
    console.print(f"run {run}: removed {len(removed)} stream(s) and bucket(s) from {url}")


@app.command("nats-auth")
def nats_auth(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="write here (default: print)")] = None,
    generate: Annotated[Path | None, typer.Option(
        "--generate", help="write DIR/server/auth.conf with a new password per kind written in, and "
        "DIR/<kind>/password for every kind (the compose stack's credentials)")] = None,
    auth: Annotated[str, typer.Option("--auth", help="with --generate: generated, or none for an open server")]
        = "generated",
    owner: Annotated[int | None, typer.Option("--owner", help="with --generate: uid that owns the password files")]
        = None,
) -> None:
    """The nats-server authorization config giving every Chorus client kind least-privilege permissions, derived
    from shared/kernel/subjects.py (the shipped copy is deploy/nats/auth.conf)."""
    from shared.launcher.natsauth import auth_conf

    if generate is not None:
        from shared.launcher.localauth import write_generated

        if auth not in ("generated", "none"):
            err.print(f"[red]error:[/] --auth {auth!r}: expected generated or none", highlight=False)
            raise typer.Exit(2)
        write_generated(generate, open_server=auth == "none", owner=owner)
        console.print(f"wrote {generate}/server/auth.conf and a password per client kind under {generate} ("
                      + ("an open server: no users" if auth == "none" else "a new password per kind") + ")",
                      highlight=False)
        return
    text = auth_conf()
    if out is None:
        sys.stdout.write(text)
        return
    out.write_text(text)
    console.print(f"wrote {out}")


@app.command()
def samples(
    run_dir: Annotated[Path, typer.Argument(help="a run directory, runs/<run-id> (with samples.jsonl)")],
    model: Annotated[str | None, typer.Option("--model", "-m", help="only episodes with a turn of this model")] = None,
    agent: Annotated[str | None, typer.Option("--agent", "-a", help="only episodes with a turn of this agent")] = None,
    last: Annotated[int, typer.Option("--last", "-n", help="how many of the newest episodes")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="the raw JSON lines")] = False,
) -> None:
    """What the agents said: the newest sampled episodes of a run (logging.samples_every), each turn's prompt tail,
    response, reward and answer."""
    from shared.launcher.samplescmd import show

    raise typer.Exit(show(console, err, run_dir, model=model, agent=agent, last=last, as_json=as_json))


@app.command("eval")
def eval_command(
    target: Annotated[Path, typer.Argument(help="a run config (path or shipped name) or a run directory")],
    version: Annotated[str, typer.Option("--version", help="a run's version N, best, last, or base")] = "last",
    split: Annotated[str, typer.Option("--split", help="heldout (task.heldout's tasks) or test (the dataset's "
                                                       "test split: gsm8k, humaneval)")] = "heldout",
    tasks: Annotated[int | None, typer.Option("--tasks", help="the first N tasks (default: eval.tasks / all)")] = None,
    offset: Annotated[int, typer.Option("--offset", help="--split test: skip the first K tasks (split a test set "
                                                         "over processes)")] = 0,
    samples: Annotated[int | None, typer.Option("--samples", help="n rollouts per task (pass@k, maj@k)")] = None,
    temperature: Annotated[float | None, typer.Option("--temperature", help="0 = greedy")] = None,
    pass_k: Annotated[list[int] | None, typer.Option("--pass-k", help="the k of pass@k (repeatable)")] = None,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens", help="per generation")] = None,
    batch: Annotated[int, typer.Option("--batch", help="tasks in flight at once")] = 32,
    out: Annotated[Path | None, typer.Option("--out", help="the JSON record (default: in the run directory, "
                                                           "or runs/eval/ for a config)")] = None,
) -> None:
    """Evaluate a model without training: pass@1, pass@k, maj@k and tokens per question of the config's workflow on
    a held-out or test split, in this process (Chorus's engine, no NATS); a table and a JSON record."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from shared.launcher.evaluate import (
        EvalError,
        eval_settings,
        eval_tasks,
        load_nets,
        run_eval,
        write_record,
    )

    run_dir = target if target.is_dir() else None
    cfg = _load(target / "config.yaml" if run_dir is not None else find_config(target))
    setup_logging(json=False, level="ERROR")
    try:
        cfg = eval_settings(cfg, samples=samples, temperature=temperature, pass_k=pass_k,
                            max_new_tokens=max_new_tokens)
        todo = eval_tasks(cfg, split, tasks, offset)
        nets, versions = load_nets(cfg, run_dir, "base" if run_dir is None else version)
    except (EvalError, ValueError) as exc:
        err.print(f"[red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None
    t0 = time.monotonic()
    with Progress(TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        job = bar.add_task("eval", total=len(todo), rate="")

        def progress(n: int, tokens: int) -> None:
            rate = tokens / max(time.monotonic() - t0, 1e-9)
            bar.update(job, completed=n, rate=f"{rate:.0f} tokens/s")

        record = asyncio.run(run_eval(cfg, todo, nets, versions, batch=batch, progress=progress))
    label = "base" if run_dir is None or version == "base" else "-".join(f"v{v}" for v in versions.values())
    record |= {"target": str(target), "split": split, "model_versions": versions, "label": label}
    if out is None:
        out = (run_dir / f"eval-{split}-{label}.json" if run_dir is not None
               else cfg.run.dir / "eval" / f"{cfg.run.id}-{split}-{label}.json")
    write_record(out, record)
    console.print(eval_record_table(record, len(todo), split, label))
    console.print(f"pass@1 {record['final']:.4f} on {len(todo)} tasks in {record['seconds']:.1f} s; wrote {out}",
                  highlight=False)


def main() -> None:
    """Console-script entry point (``chorus``)."""
    app()


if __name__ == "__main__":
    main()
