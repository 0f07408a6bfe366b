"""A headless Chromium driven over the DevTools protocol, with nothing but the standard
library: the browser reads commands on file descriptor 3 and writes replies and events on
4 (``--remote-debugging-pipe``), each message JSON ending in a NUL byte.

``benchmarks/report_browser.py`` opens ``ampgraph inspect``'s HTML reports with it; the
browser is Debian's ``chromium`` package (``apt-get install chromium``).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--hide-scrollbars", "--mute-audio",
         "--remote-debugging-pipe")


def find_browser() -> str | None:
    """The path of a Chromium on this machine (``$AMPGRAPH_CHROMIUM`` first), or None."""
    env = os.environ.get("AMPGRAPH_CHROMIUM")
    if env:
        return env if Path(env).exists() else None
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


class BrowserError(RuntimeError):
    """The browser failed, answered with an error or did not answer in time."""


class Page:
    """One headless Chromium with one page, at ``width`` x ``height`` CSS pixels.

    Every console message, uncaught exception, log entry and network request of the page
    is kept (``console``, ``exceptions``, ``requests``).

    Example:
        >>> with Page() as page:
        ...     page.open(Path("report.html"))
        ...     page.eval("document.title")
    """

    def __init__(self, width: int = 1400, height: int = 1000, browser: str | None = None,
                 timeout: float = 60.0) -> None:
        self.width, self.height, self.timeout = width, height, timeout
        self.browser = browser or find_browser()
        if self.browser is None:
            raise BrowserError("no Chromium found (apt-get install chromium)")
        self.console: list[dict[str, Any]] = []
        self.exceptions: list[str] = []
        self.requests: list[str] = []
        self._events: list[dict[str, Any]] = []
        self._next = 0
        self._buf = b""
        self._session = ""

    # -------------------------------------------------------------- process
    def __enter__(self) -> Page:
        self._profile = tempfile.mkdtemp(prefix="ampgraph-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def fds() -> None:  # the browser reads fd 3 and writes fd 4
            r, w = os.dup(to_browser_r), os.dup(from_browser_w)  # never 3 or 4 themselves
            for fd, to in ((r, 3), (w, 4)):
                os.dup2(fd, to)
                os.set_inheritable(to, True)

        self._proc = subprocess.Popen(
            [self.browser, *FLAGS, f"--user-data-dir={self._profile}",
             f"--window-size={self.width},{self.height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=fds, close_fds=False)  # pipes are not inheritable; fds 3 and 4 are
        os.close(to_browser_r)
        os.close(from_browser_w)
        target = self._page_target()
        self._session = self.send("Target.attachToTarget", targetId=target,
                                  flatten=True, session=False)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                  deviceScaleFactor=1, mobile=False)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.send("Browser.close", session=False)
        except BrowserError:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        os.close(self._to_browser)
        os.close(self._from_browser)
        shutil.rmtree(self._profile, ignore_errors=True)

    def _page_target(self) -> str:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            pages = [t for t in self.send("Target.getTargets", session=False)["targetInfos"]
                     if t["type"] == "page"]
            if pages:
                return pages[0]["targetId"]
            time.sleep(0.1)
        raise BrowserError("the browser opened no page")

    # -------------------------------------------------------------- protocol
    def send(self, method: str, session: bool = True, **params: Any) -> dict[str, Any]:
        """Send one command and wait for its reply (events meanwhile are recorded)."""
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params}
        if session and self._session:
            msg["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._event(reply)

    def _read(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buf:
            if time.monotonic() > deadline or self._proc.poll() is not None:
                raise BrowserError("the browser stopped answering")
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise BrowserError("the browser closed its pipe")
            self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        return json.loads(raw)

    def _event(self, msg: dict[str, Any]) -> None:
        method, params = msg.get("method", ""), msg.get("params", {})
        self._events.append(msg)
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", "")))
                            for a in params.get("args", []))
            self.console.append({"level": params.get("type", ""), "text": text})
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            self.console.append({"level": entry.get("level", ""), "text": entry.get("text", "")})
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.exceptions.append(details.get("exception", {}).get("description")
                                   or details.get("text", "exception"))
        elif method == "Network.requestWillBeSent":
            self.requests.append(params.get("request", {}).get("url", ""))

    def _wait_for(self, method: str) -> None:
        if any(e.get("method") == method for e in self._events):
            return
        while True:
            msg = self._read()
            self._event(msg)
            if msg.get("method") == method:
                return

    # -------------------------------------------------------------- page
    def open(self, path: Path) -> None:
        """Load a local file and wait for its load event."""
        self._events.clear()
        self.send("Page.navigate", url=path.resolve().as_uri())
        self._wait_for("Page.loadEventFired")

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        out = self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                        awaitPromise=True)
        if "exceptionDetails" in out:
            raise BrowserError(f"{expression!r} raised: {out['exceptionDetails']}")
        return out.get("result", {}).get("value")

    def screenshot(self, path: Path, full_page: bool = False) -> None:
        """A PNG of the viewport (or of the whole page)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot",
                                                    **params)["data"]))

    def errors(self) -> list[str]:
        """Console errors and uncaught exceptions so far."""
        return [c["text"] for c in self.console if c["level"] in ("error", "assert")] + \
            list(self.exceptions)

    def external_requests(self) -> list[str]:
        """Requests the page made for anything but itself (file:, data: and about: are
        the page's own)."""
        return [u for u in self.requests if not u.startswith(("file:", "data:", "about:"))]
