"""`chorus up --dashboard` in a real headless Chromium against a live tiny run (two models, a held-out evaluation
every 25 versions, its embedded nats-server with a password per client kind), then `chorus dashboard RUN_DIR` on
the finished run with its server gone, in Chromium and in Firefox; and, from the same browser, the observer's credentials over the embedded
server's WebSocket listener, which may read the run's metrics but neither publish samples nor read the requests
of a model. Screenshots go to runs/test-artifacts/ (CHORUS_TEST_ARTIFACTS)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from shared.launcher.natsserver import free_port
from tests.conftest import ROOT
from tests.e2e.browser import ARTIFACTS, chromium, console_errors, screenshot
from tests.e2e.conftest import small_run_config
from tests.e2e.firefox import Firefox
from tests.waits import wait_until_sync

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

CHORUS = str(Path(sys.executable).parent / "chorus")
VERSIONS = 150  # long enough (a minute or more) for the live checks to end before the run does


class Proc:
    """A `chorus` command whose output lines are collected as they come."""

    def __init__(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHORUS_NATS")}
        self.proc = subprocess.Popen([CHORUS, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def find(self, pattern: str, what: str, timeout_s: float = 300) -> re.Match[str]:
        def hit() -> re.Match[str] | None:
            if self.proc.poll() is not None and not any(re.search(pattern, x) for x in self.lines):
                raise AssertionError(f"chorus exited ({self.proc.returncode}) before {what}:\n" + "\n".join(self.lines))
            return next((m for x in self.lines if (m := re.search(pattern, x))), None)

        return wait_until_sync(hit, what, timeout_s=timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def js(driver: Any, script: str) -> Any:
    return driver.execute_script(script)


def wait_js(driver: Any, script: str, what: str, timeout_s: float = 180) -> Any:
    return wait_until_sync(lambda: js(driver, script), what, timeout_s=timeout_s, interval_s=0.5)


POINTS = "return S.models.map(m => ((charts.reward.series.find(s => s.model === m) || {points: []}).points.length))"
HELDOUT = ("return charts.heldout.series.some(s => s.name === 'final answer' && "
           "s.points.some(p => p[0] > 0 && p[1] !== null))")
EPISODE = """return [...document.querySelectorAll('.episode')].filter(e =>
    e.querySelector('.turn[data-agent="solver"]') && e.querySelector('.turn[data-agent="verifier"]')).length"""

# NATS's text protocol over the WebSocket listener, from the page: CONNECT as the observer, subscribe to the run's
# metrics (allowed), publish a forged sample and subscribe to a model's generation requests (both refused).
OBSERVER_WS = r"""
const [url, pass, run, done] = arguments;
const ws = new WebSocket(url); ws.binaryType = "arraybuffer";
let text = ""; const dec = new TextDecoder();
ws.onmessage = (e) => { text += typeof e.data === "string" ? e.data : dec.decode(e.data); };
ws.onerror = () => { text += "\nWSERROR"; };
ws.onopen = () => {
  ws.send('CONNECT {"user":"observer","pass":"' + pass + '","verbose":false,"pedantic":false,"protocol":1}\r\n');
  ws.send('SUB chorus.' + run + '.metrics.> 1\r\n');
  ws.send('PUB chorus.' + run + '.traj.solver_lm 5\r\nforge\r\n');
  ws.send('SUB chorus.' + run + '.rollout.solver_lm.gen 2\r\nPING\r\n');
};
setTimeout(() => { ws.close(); done(text); }, 4000);
"""


def test_the_dashboard_shows_a_live_run_and_then_the_finished_one_from_its_run_directory(tmp_path: Path) -> None:
    config = small_run_config(tmp_path, "dash", sections={
        "task": {"max_operand": 9, "heldout": 16}, "eval": {"every": 25, "tasks": 16, "temperature": 0.0},
        "logging": {"samples_every": 2}}, max_versions=VERSIONS)
    port = free_port()
    up = Proc("up", str(config), "--timeout-s", "900", "--dashboard", "--dashboard-port", str(port))
    driver = chromium()
    offline: Proc | None = None
    try:
        up.find(rf"dashboard at http://127\.0\.0\.1:{port}/", "the dashboard's address")
        ws_url = up.find(r"WebSocket (ws://\S+);", "the WebSocket listener").group(1)
        run_id = up.find(r"^run (\S+) in ", "the run id").group(1)
        run_dir = tmp_path / "runs" / run_id
        driver.get(f"http://127.0.0.1:{port}/")
        # the curves of both models receive points, and a held-out point after training started
        wait_js(driver, f"const n = {POINTS.removeprefix('return ')}; return n.length === 2 && n.every(x => x > 2)",
                "reward points for both models")
        assert js(driver, "return document.getElementById('live').textContent") == "live"
        wait_js(driver, HELDOUT, "a held-out point after version 0")
        # the trajectory view lists an episode with every agent's turn, its reward, advantage, version, staleness
        wait_js(driver, EPISODE, "an episode with the solver's and the verifier's turns")
        turn = js(driver, "return document.querySelector('.turn[data-agent=\"verifier\"] .who').innerText")
        for word in ("version", "staleness", "reward", "advantage", "model verifier_lm"):
            assert word in turn, turn
        assert re.search(r"advantage -?\d", js(driver, "return document.getElementById('episodes').innerText")), \
            "no turn shows its advantage"
        shot = screenshot(driver, "dashboard-live.png")
        # a point of the reward curve links to the episodes of its version: one of the versions that have a sampled
        # episode of the curve's model (one task in logging.samples_every is sampled: not every version has one), the
        # newest of them (an older one's episodes may leave the page's latest MAX_EPISODES while a slow browser looks)
        version = js(driver, """const s = charts.reward.series[0];
            const shown = S.episodes.filter(e => keep(e, true));  // under the page's other filters (training only)
            const sampled = new Set(shown.flatMap(e => e.turns.filter(t => t.model === s.model).map(t => t.version)));
            const have = s.points.filter(p => sampled.has(p[0]));
            if (!have.length) return null;
            const p = have[have.length - 1];  // the newest: the page keeps the latest episodes, and a run goes on
            const r = charts.reward.canvas.getBoundingClientRect();
            charts.reward.canvas.dispatchEvent(new MouseEvent('click', {clientX: r.left + charts.reward.X(p[0]),
                clientY: r.top + charts.reward.Y(p[1]), bubbles: true}));
            return p[0];""")
        assert version is not None, "no version of the reward curve has a sampled episode"
        assert js(driver, "return filter.version") == version
        assert js(driver, "return document.getElementById('f-version').value") == str(version)
        shown = wait_js(driver, f"""const e = [...document.querySelectorAll('.episode')].map(e => e.innerText);
            return e.length && e.every(t => t.includes('version {version}\\n')) ? e : null""",
                        f"the episodes of version {version} alone")
        assert shown
        # a version with no sampled episode (past the run's end) says so and offers the nearest that have one
        js(driver, "const s = document.getElementById('f-version'); s.value = '100000'; s.dispatchEvent(new Event('input'));")
        said = wait_js(driver, "const e = document.querySelector('#episodes .empty'); return e && e.innerText",
                       "the page saying version 100000 has no sampled episode")
        assert "no sampled episode of version 100000" in said and "nearest versions that have one" in said, said
        nearest = js(driver, "return [...document.querySelectorAll('#episodes a.nearest')].map(a => +a.dataset.version)")
        assert len(nearest) == 1 and nearest[0] < 100000, nearest  # the newest version sampled: none above it
        js(driver, "document.querySelector('#episodes a.nearest').click()")
        wait_js(driver, f"""const e = [...document.querySelectorAll('.episode')].map(e => e.innerText);
            return e.length && e.every(t => t.includes('version {nearest[0]}\\n')) ? e : null""",
                f"the episodes of version {nearest[0]}, the nearest offered")
        # filter by agent and by reward
        js(driver, "const s = document.getElementById('f-version'); s.value = ''; s.dispatchEvent(new Event('input'));"
                   "const a = document.getElementById('f-agent'); a.value = 'verifier'; a.dispatchEvent(new Event('change'));")
        agents = wait_js(driver, "const t = [...document.querySelectorAll('.turn')].map(e => e.dataset.agent);"
                                 "return t.length && !t.includes('solver') ? t : null", "only the verifier's turns")
        assert set(agents) == {"verifier"}
        js(driver, "const r = document.getElementById('f-reward'); r.value = 'pos'; r.dispatchEvent(new Event('change'));")
        rewards = wait_js(driver, "const r = [...document.querySelectorAll('.turn .who')].map(e => e.innerText.match("
                                  "/reward (\\S+)/)[1]); return r.length && r.every(x => parseFloat(x) > 0) ? r : null",
                          "only the verifier's turns rewarded above 0")
        assert all(float(r) > 0 for r in rewards), rewards
        js(driver, "document.getElementById('f-reward').value = ''; document.getElementById('f-reward')"
                   ".dispatchEvent(new Event('change')); document.getElementById('trajectories').scrollIntoView();")
        screenshot(driver, "dashboard-trajectories.png")
        # the observer over the WebSocket listener: reads metrics, may not forge samples nor take requests
        password = (run_dir / "nats" / "observer.password").read_text().strip()
        text = driver.execute_async_script(OBSERVER_WS, ws_url, password, run_id)
        assert f"MSG chorus.{run_id}.metrics." in text, text[:2000]
        assert re.search(rf"Permissions Violation for Publish to \"?chorus\.{run_id}\.traj\.solver_lm", text), text[:2000]
        assert re.search(rf"Permissions Violation for Subscription to \"?chorus\.{run_id}\.rollout\.solver_lm\.gen",
                         text), text[:2000]
        assert console_errors(driver) == []
        assert up.proc.wait(900) == 0, "\n".join(up.lines)
        driver.get("about:blank")  # the live page retries its stream once chorus up is gone: not this page's errors
        console_errors(driver)
        # the finished run, its embedded server stopped: the run directory alone
        page = free_port()
        offline = Proc("dashboard", str(run_dir), "--port", str(page))
        offline.find(rf"dashboard of run {run_id} at http://127\.0\.0\.1:{page}/", "the finished run's dashboard")
        driver.get(f"http://127.0.0.1:{page}/")
        wait_js(driver, "return document.getElementById('live').textContent === 'run directory'",
                "the page says the bus is gone and it shows the run directory")
        assert js(driver, POINTS) == [VERSIONS, VERSIONS]
        assert js(driver, HELDOUT)
        assert js(driver, EPISODE) > 0
        assert js(driver, "return charts.tokens.series.length > 0 && charts.tokens.series.every(s => s.points.length)"), \
            "the rollouters' throughput recorded in gauges.jsonl"
        screenshot(driver, "dashboard-finished.png")
        assert console_errors(driver) == []
        assert shot.stat().st_size > 10_000
        # the same page in Firefox
        firefox = Firefox()
        try:
            firefox.get(f"http://127.0.0.1:{page}/")
            wait_until_sync(lambda: firefox.js(POINTS.removeprefix("return ")) == [VERSIONS, VERSIONS],
                            "Firefox draws both models' curves", interval_s=0.5)
            assert firefox.js(HELDOUT.removeprefix("return "))
            assert firefox.js(f"({EPISODE.removeprefix('return ')})") > 0
            firefox.screenshot(ARTIFACTS / "dashboard-finished-firefox.png")
            assert firefox.errors() == []
        finally:
            firefox.close()
    finally:
        driver.quit()
        up.stop()
        if offline is not None:
            offline.stop()
