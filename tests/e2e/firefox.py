"""Headless Firefox (Debian's ``firefox-esr``) driven over WebDriver BiDi, which Firefox speaks itself on
``--remote-debugging-port`` (no geckodriver, nothing downloaded): navigate, evaluate a script, collect the
console's errors, take a screenshot."""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from shared.launcher.natsserver import free_port


class Firefox:
    def __init__(self, width: int = 1400, height: int = 1200, start_timeout_s: float = 60.0) -> None:
        import websocket  # websocket-client, a dependency of selenium

        binary = shutil.which("firefox-esr") or shutil.which("firefox")
        if binary is None:
            raise AssertionError("firefox-esr is not installed: `make test-browser` installs it (apt, as root)")
        self.profile = tempfile.mkdtemp(prefix="chorus-firefox-")
        port = free_port()
        self.proc = subprocess.Popen([binary, "--headless", "--remote-debugging-port", str(port), "--profile",
                                      self.profile, "--no-remote", "--width", str(width), "--height", str(height)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                self.ws = websocket.create_connection(f"ws://127.0.0.1:{port}/session", timeout=60,
                                                      suppress_origin=True)
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise AssertionError(f"firefox did not open its WebDriver BiDi port within {start_timeout_s}s") \
                        from None
                time.sleep(0.2)
        self.n = 0
        self.log: list[dict[str, Any]] = []
        self.version = self.call("session.new", {"capabilities": {}})["capabilities"]["browserVersion"]
        self.call("session.subscribe", {"events": ["log.entryAdded"]})
        self.context = self.call("browsingContext.getTree", {})["contexts"][0]["context"]

    def call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.n:
                if msg.get("type") == "error":
                    raise RuntimeError(f"{method}: {msg.get('error')}: {msg.get('message')}")
                return msg["result"]
            if msg.get("method") == "log.entryAdded":
                self.log.append(msg["params"])

    def get(self, url: str) -> None:
        self.call("browsingContext.navigate", {"context": self.context, "url": url, "wait": "complete"})

    def js(self, expression: str) -> Any:
        """The JSON value of ``expression`` (it is wrapped in JSON.stringify)."""
        r = self.call("script.evaluate", {"expression": f"JSON.stringify({expression})",
                                          "target": {"context": self.context}, "awaitPromise": False})
        if r.get("type") == "exception":
            raise RuntimeError(f"{expression}: {r['exceptionDetails'].get('text')}")
        return json.loads(r["result"]["value"]) if r["result"].get("type") == "string" else None

    def errors(self) -> list[str]:
        self.js("1")  # collect the entries sent so far
        return [f"{e.get('type')}: {e.get('text')}" for e in self.log if e.get("level") == "error"]

    def screenshot(self, path: Path) -> Path:
        data = self.call("browsingContext.captureScreenshot", {"context": self.context})["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)
