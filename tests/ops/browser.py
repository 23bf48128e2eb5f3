"""Headless Chromium (Debian's package) driven over the DevTools protocol, for O3's test.

`Browser` starts its own Chromium with a throwaway profile on a free debugging
port, talks to its first page over a websocket, and stops the process it
started (by its pid) when closed.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect


def chromium_path() -> str | None:
    return shutil.which("chromium")


def chromium_args(profile: Path) -> list[str]:
    args = ["--headless=new", "--disable-gpu", "--no-first-run", f"--user-data-dir={profile}"]
    if os.geteuid() == 0:
        args.append("--no-sandbox")  # Chromium refuses to run as root with its own sandbox
    return args


class Browser:
    def __init__(self, profile: Path, width: int = 412, height: int = 915) -> None:
        exe = chromium_path()
        assert exe, "chromium is not installed: run scripts/setup-browser.sh"
        profile.mkdir(parents=True, exist_ok=True)
        self._stack = contextlib.ExitStack()
        self.proc = subprocess.Popen(
            [
                exe,
                *chromium_args(profile),
                "--remote-debugging-port=0",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._stack.callback(self._stop)
        try:
            self._connect(profile)
        except BaseException:
            self._stack.close()
            raise

    def _connect(self, profile: Path) -> None:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            assert time.monotonic() < deadline, "chromium did not open its debugging port"
            assert self.proc.poll() is None, "chromium exited"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = [
            t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"
        ]
        self.ws: ClientConnection = self._stack.enter_context(
            connect(pages[0]["webSocketDebuggerUrl"], max_size=64 << 20)
        )
        self._ids = itertools.count(1)
        self.call("Page.enable")
        self.call("Network.enable")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == msg_id:
                assert "error" not in msg, msg
                result: dict[str, Any] = msg.get("result", {})
                return result

    def eval(self, expression: str) -> Any:
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in r, r
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            time.sleep(0.1)

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for(f"location.href.startsWith({json.dumps(url)}) && "
                      "document.readyState === 'complete'")  # fmt: skip

    def screenshot(self, path: Path) -> Path:
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def cookies(self) -> list[dict[str, Any]]:
        return list(self.call("Network.getCookies")["cookies"])

    def close(self) -> None:
        self._stack.close()

    def _stop(self) -> None:
        """Stop the Chromium this object started (by its own pid)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def dump_dom(url: str, profile: Path) -> str:
    """`chromium --headless --dump-dom URL`: the page as a browser without a session sees it."""
    exe = chromium_path()
    assert exe
    r = subprocess.run(
        [exe, *chromium_args(profile), "--dump-dom", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout
