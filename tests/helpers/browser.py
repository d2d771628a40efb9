"""A headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
JSON messages ending in NUL on file descriptors 3 and 4), with no library: load a page, run
JavaScript, click where an element is, take a screenshot, and collect every console error,
uncaught exception and browser log error on the way.

The browser is Debian's ``chromium`` (``make browser`` installs it); :func:`find_chromium`
returns None when there is none, and the tests skip saying so.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
NO_CHROMIUM = "no chromium on PATH (Debian: apt-get install chromium, or run `make browser`)"


def browser_test_marks() -> tuple[str | None, list[Any]]:
    """(the Chromium path or None, the ``pytestmark`` list of a browser test module: skip,
    saying why, when there is no Chromium; one torch thread). Raises RuntimeError when there is
    none but ``LMLAB_REQUIRE_BROWSER`` is set (.ci/run: never skip there)."""
    import pytest

    chromium = find_chromium()
    if chromium is None and os.environ.get("LMLAB_REQUIRE_BROWSER"):
        raise RuntimeError(f"LMLAB_REQUIRE_BROWSER is set but there is {NO_CHROMIUM}")
    marks = [
        pytest.mark.skipif(chromium is None, reason=NO_CHROMIUM),
        pytest.mark.usefixtures("one_thread"),
    ]
    return chromium, marks


def find_chromium() -> str | None:
    """The path of an installed Chromium (``$LMLAB_CHROMIUM`` first), or None."""
    env = os.environ.get("LMLAB_CHROMIUM")
    if env:
        return env if shutil.which(env) else None
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium with one page. Use as a context manager; ``errors`` lists what
    the console, uncaught exceptions and the browser log reported at error level."""

    def __init__(self, binary: str, width: int = 1000, height: int = 900, timeout: float = 30.0):
        self.timeout = timeout
        self.errors: list[str] = []
        self._id = 0
        self._buf = b""
        self._events: list[dict[str, Any]] = []
        self._profile = tempfile.mkdtemp(prefix="lmlab-chromium-")
        cmd_r, self._cmd_w = os.pipe()  # we write commands, the browser reads fd 3
        self._res_r, res_w = os.pipe()  # the browser writes fd 4, we read

        def child_fds() -> None:
            a, b = os.dup(cmd_r), os.dup(res_w)  # above 4, so the dup2s cannot clash
            os.dup2(a, 3, inheritable=True)
            os.dup2(b, 4, inheritable=True)

        self.proc = subprocess.Popen(
            [
                binary,
                "--headless",
                "--remote-debugging-pipe",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--disable-dev-shm-usage",
                f"--user-data-dir={self._profile}",
                f"--window-size={width},{height}",
                "--hide-scrollbars",
                "about:blank",
            ],  # fmt: skip
            preexec_fn=child_fds,
            pass_fds=(3, 4),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(cmd_r)
        os.close(res_w)
        try:
            self._attach()
        except BaseException:
            self.close()
            raise

    def _attach(self) -> None:
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)[
            "sessionId"
        ]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=True)

    # -------------------------------------------------------------- protocol
    def _send(self, method: str, params: dict[str, Any], session: bool) -> int:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        return self._id

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._res_r], [], [], left)[0]:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self._res_r, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        msg: dict[str, Any] = json.loads(raw)
        if "method" in msg:
            self._note(msg)
        return msg

    def _note(self, event: dict[str, Any]) -> None:
        self._events.append(event)
        method, params = event["method"], event.get("params", {})
        if method == "Runtime.exceptionThrown":
            d = params["exceptionDetails"]
            self.errors.append(f"exception: {d.get('exception', {}).get('description', d)}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = [a.get("value", a.get("description")) for a in params.get("args", [])]
            self.errors.append(f"console.{params['type']}: {args}")
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            self.errors.append(f"log: {params['entry'].get('text')}")

    def call(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        """Send one command and return its result. Raises RuntimeError for a protocol error."""
        want = self._send(method, params, session)
        deadline = time.monotonic() + self.timeout
        while True:
            msg = self._read(deadline)
            if msg.get("id") == want:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg.get("result", {})
                return result

    def wait_event(self, method: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        for i, e in enumerate(self._events):
            if e["method"] == method:
                return self._events.pop(i)
        while True:
            msg = self._read(deadline)
            if msg.get("method") == method:
                self._events.remove(msg)
                return msg

    # -------------------------------------------------------------- page actions
    def open(self, path: Path, fragment: str = "") -> None:
        """Load a local file (``#fragment`` appended) and wait for its load event."""
        self._events.clear()
        url = path.resolve().as_uri() + (f"#{fragment}" if fragment else "")
        self.call("Page.navigate", session=True, url=url)
        self.wait_event("Page.loadEventFired")

    def eval(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page."""
        res = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def click(self, selector: str, dx: float = 0.5, dy: float = 0.5) -> None:
        """A real mouse click (move, press, release) at a point of the first element matching
        ``selector`` (``dx``, ``dy``: fractions of its box), scrolled into view first."""
        box = self.eval(
            f"(() => {{const e = document.querySelector({json.dumps(selector)});"
            "e.scrollIntoView({block: 'center', inline: 'center'});"
            "const r = e.getBoundingClientRect(); return [r.x, r.y, r.width, r.height];})()"
        )
        x, y = box[0] + dx * box[2], box[1] + dy * box[3]
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.call(
                "Input.dispatchMouseEvent", session=True, type=kind, x=x, y=y,
                button="left" if kind != "mouseMoved" else "none", clickCount=1,
            )  # fmt: skip

    def screenshot(self) -> bytes:
        """The viewport, scrolled to the top, as PNG bytes."""
        self.eval("window.scrollTo(0, 0)")
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        return base64.b64decode(data)

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, TimeoutError, OSError):
            self.call("Browser.close")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)
        os.close(self._res_r)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
