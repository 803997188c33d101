"""chorus dashboard's state (shared/launcher/dashboard.py) and chorus monitor's tables, without a browser or a bus:
decimation of a long run, deduplication of what the run directory and the bus both hold, staleness of a sampled
turn, the gauges each service kind contributes, the HTTP endpoints, and the monitor's fixed columns."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from rich.console import Console

from shared.launcher.dashboard import (
    MAX_POINTS,
    RECENT,
    DashState,
    Feed,
    GaugeRecorder,
    compact_gauge,
    decimate,
    load_run_dir,
    serve,
)
from shared.launcher.progress import MonitorState, problem_counters


def _state() -> DashState:
    return DashState(models=["a", "b"], agents={"solver": "a", "verifier": "b"}, max_versions=10_000, run="r")


def test_decimation_keeps_the_first_the_newest_and_at_most_the_limit() -> None:
    points = list(range(10_000))
    kept = decimate(points)
    assert len(kept) <= MAX_POINTS
    assert kept[0] == 0 and kept[-RECENT:] == points[-RECENT:]
    assert kept == sorted(kept)
    assert decimate(points[:100]) == points[:100]


def test_a_run_of_ten_thousand_versions_loads_as_at_most_max_points_per_series(tmp_path: Path) -> None:
    lines = [json.dumps({"model": m, "version": v, "reward_mean": v / 10_000, "time": 1000.0 + v,
                         "staleness_mean": 0.5, "staleness_max": 1, "samples": 64})
             for v in range(1, 10_001) for m in ("a", "b")]
    lines += [json.dumps({"kind": "eval", "version": v, "final": 0.1, "pass1": {"solver": 0.2}, "time": 1000.0 + v})
              for v in range(0, 10_001, 1000)]
    lines.append("{torn line")
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    state = _state()
    load_run_dir(state, tmp_path)
    snap = json.loads(json.dumps(state.snapshot()))
    assert all(0.8 * MAX_POINTS <= len(rows) <= MAX_POINTS for rows in snap["steps"].values()), \
        {m: len(rows) for m, rows in snap["steps"].items()}
    version = snap["step_fields"].index("version")
    assert snap["steps"]["a"][0][version] == 1 and snap["steps"]["a"][-1][version] == 10_000
    assert len(snap["evals"]) == 11
    assert len(json.dumps(snap)) < 500_000  # what a page downloads does not grow with the run


def test_a_record_from_the_run_directory_and_the_bus_counts_once() -> None:
    state = _state()
    step = {"kind": "step", "model": "a", "version": 3, "reward_mean": 0.5, "time": 10.0}
    assert state.on_record(step) and not state.on_record(step)
    drop = {"kind": "drop", "model": "a", "reason": "stale", "count": 2, "sample_ids": ["x", "y"]}
    assert state.on_record(drop) and not state.on_event("trainer", drop)[:-1]
    assert state.drops == {"a": {"stale": 2}}
    ep = {"task_id": "t", "rollout": 0, "time": 11.0, "turns": [{"agent": "solver", "model": "a", "version": 1}]}
    assert state.on_episode(ep) and not state.on_episode(ep)
    assert state.on_record({"kind": "critic_step", "version": 1, "value_loss": 0.3})
    assert state.on_record({"kind": "unknown"}) == [] and state.on_record("not a dict") == []


def test_a_turns_staleness_is_the_models_versions_trained_past_it_when_the_episode_was_recorded() -> None:
    state = _state()
    for v in range(1, 6):
        state.on_step({"model": "a", "version": v, "time": 100.0 + v})
    ep = {"task_id": "t", "rollout": 0, "time": 103.5, "turns": [
        {"agent": "solver", "model": "a", "version": 1, "advantage": 0.7, "reward": 1.0},
        {"agent": "verifier", "model": "b", "version": 0}]}
    (update,) = state.on_episode(ep)
    solver, verifier = update["episode"]["turns"]
    assert solver["staleness"] == 2 and solver["advantage"] == 0.7  # v3 was the newest at 103.5
    assert verifier["staleness"] == 0  # no version of b trained yet


def test_each_service_kind_gives_the_gauges_the_page_draws() -> None:
    now = time.time()
    assert compact_gauge({"service": "mq", "instance": "0", "model": "a", "time": now, "depth": 40, "held": 8}) \
        | {"time": 0} == {"service": "mq", "instance": "0", "model": "a", "time": 0, "depth": 40, "held": 8}
    ro = compact_gauge({"service": "rollouter", "instance": "1", "model": "a", "time": now, "tokens_per_s": 2000.0,
                        "sync_s": 0.01, "counters": {"loads": 3}})
    assert ro is not None and ro["tokens_per_s"] == 2000.0 and ro["sync_s"] == 0.01 and ro["loads"] == 3
    act = compact_gauge({"service": "actions", "instance": "0", "time": now, "busy_cores": 1, "cores": 2,
                         "queued_kinds": {"code": 3}})
    assert act is not None and act["queued_kinds"] == {"code": 3}
    pool = compact_gauge({"service": "trainer", "instance": "0", "model": "pool", "time": now,
                          "pool": {"slots": [{"holder": "a"}, {"holder": None}]}})
    assert pool is not None and pool["slots"] == ["a", None]
    assert compact_gauge({"service": "something else"}) is None


def test_the_gauge_recorder_writes_one_line_per_instance_per_interval(tmp_path: Path) -> None:
    rec = GaugeRecorder(tmp_path, every_s=5.0)
    for t in (100.0, 101.0, 104.0, 105.5):
        rec.on_metrics({"service": "mq", "instance": "0", "model": "a", "time": t, "depth": int(t)})
    rec.on_metrics({"service": "mq", "instance": "0", "model": "b", "time": 101.0, "depth": 1})
    rec.on_metrics("garbage")
    rec.flush()
    lines = [json.loads(x) for x in (tmp_path / "gauges.jsonl").read_text().splitlines()]
    assert [(g["model"], g["depth"]) for g in lines] == [("a", 100), ("a", 105), ("b", 1)]
    state = _state()
    load_run_dir(state, tmp_path)
    assert sorted(state.gauges) == ["mq.a-0", "mq.b-0"]
    # a pool's slots changing hands is kept at once, for its timeline
    rec = GaugeRecorder(tmp_path / "pool", every_s=5.0)
    (tmp_path / "pool").mkdir()
    for t, holders in ((100.0, ["a", None]), (100.5, ["a", None]), (101.0, ["b", None]), (101.5, ["b", "a"])):
        rec.on_metrics({"service": "trainer", "instance": "0", "time": t, "pool": {"slots": [{"holder": h}
                                                                                            for h in holders]}})
    rec.flush()
    kept = [json.loads(x)["slots"] for x in (tmp_path / "pool" / "gauges.jsonl").read_text().splitlines()]
    assert kept == [["a", None], ["b", None], ["b", "a"]]
    state = _state()
    for t, holders in ((1.0, ["a"]), (1.1, ["a"]), (1.2, ["b"])):
        state.on_gauge({"service": "trainer", "instance": "0", "time": t, "slots": holders})
    assert [p["slots"] for p in state.gauges["trainer.0"]] == [["a"], ["b"]]


def test_the_feed_counts_bad_messages_and_takes_every_line_of_a_samples_message() -> None:
    feed = Feed(_state())
    lines = "\n".join(json.dumps({"task_id": f"t{i}", "rollout": 0, "time": float(i), "turns": []}) for i in range(3))
    feed.on_message("chorus.r.samples", lines.encode(), "chorus.r")
    assert len(feed.state.episodes) == 3
    feed.on_message("chorus.r.metrics.mq.a-0", b"\xff not json", "chorus.r")
    assert feed.bad_messages == 1
    feed.on_message("chorus.r.events.trainer", json.dumps({"kind": "step", "model": "a", "version": 1}).encode(),
                    "chorus.r")
    assert [u["t"] for u in feed.pending].count("step") == 1


async def test_the_server_answers_the_page_its_state_and_its_stream_and_nothing_outside_its_files() -> None:
    feed = Feed(_state())
    server = await serve(feed, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def get(path: str, method: str = "GET") -> tuple[str, bytes]:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = await asyncio.wait_for(r.read(), 10)
        w.close()
        head, _, body = data.partition(b"\r\n\r\n")
        return head.split(b"\r\n")[0].decode(), body

    try:
        status, body = await get("/")
        assert status.endswith("200 OK") and b"<canvas" in body and b"https://" not in body  # nothing from a CDN
        status, body = await get("/api/state")
        assert json.loads(body)["models"] == ["a", "b"]
        assert (await get("/../../etc/passwd"))[0].endswith("404 Not Found")
        assert (await get("/api/state", "POST"))[0].endswith("405 Method Not Allowed")
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /api/stream HTTP/1.1\r\n\r\n")
        await asyncio.wait_for(r.readuntil(b"retry: 2000\n\n"), 10)
        feed.add(feed.state.on_step({"model": "a", "version": 1, "time": 1.0}))
        feed.push()
        line = await asyncio.wait_for(r.readuntil(b"\n\n"), 10)
        assert json.loads(line.removeprefix(b"data: "))[0]["t"] == "step"
        w.close()
    finally:
        server.close()


def test_the_monitor_shows_fixed_columns_and_no_routine_counter_as_a_problem() -> None:
    state = MonitorState(agents={"solver": "a"})
    now = time.time()
    state.on_metrics("chorus.r.metrics.coordinator.0", {
        "service": "coordinator", "instance": "0", "time": now, "uptime_s": 3,
        "counters": {"gen_no_responders": 40, "gen_unrouted": 8, "tasks_done": 5}, "in_flight": 2, "admitting": True,
        "pacing": {"capacity": {"a": 16.0}, "pending": {"a": 64}, "held_by": ["a"]}})
    state.on_metrics("chorus.r.metrics.mq.a-0", {"service": "mq", "instance": "0", "model": "a", "time": now,
                                                 "depth": 40, "held": 8, "counters": {"publish_errors": 2}})
    state.on_event("chorus.r.events.trainer", {"kind": "step", "model": "a", "version": 7, "reward_mean": 0.25,
                                               "staleness_mean": 0.5, "staleness_max": 1, "time": now})
    state.on_event("chorus.r.events.coordinator", {"kind": "eval", "version": 7, "final": 0.4,
                                                   "pass1": {"solver": 0.45}, "time": now})
    console = Console(width=120, record=True)
    console.print(state.table())
    text = console.export_text()
    assert "{" not in text and "..." not in text  # no raw dicts, nothing cut mid-value
    assert "gen_no_responders" not in text and "publish_errors 2" in text
    assert "solver 0.450" in text and "0.400 (v7)" in text and "0.250" in text
    assert "latest events" in text and "trainer step (a): version=7" in text and "coordinator eval" in text
    assert len(text.splitlines()) < 40  # one screen
    assert problem_counters({"gen_no_responders": 3, "load_failures": 1, "errors_seen": 0}) == {"load_failures": 1}
