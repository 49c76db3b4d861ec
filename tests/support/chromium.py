"""A headless Chromium for the page's test, driven over the Chrome DevTools Protocol.

Debian's `chromium` package (.ci/run installs it where it is missing; ANDREA_CHROMIUM names another
binary) is started with a DevTools port of its own and a fresh profile, and spoken to over one
WebSocket (the `websockets` package): evaluate JavaScript, click with real mouse events at an
element's centre, take a screenshot. Every event the page raises is kept, so a test can ask for its
console errors, uncaught exceptions and failed loads (`problems`) and for every URL it requested
(`requests`).
"""

import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.request

import pytest
from optional import require

NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str:
    """The browser's path, or a skip (outside CI) or a failure (in CI) that says how to install it."""
    found = os.environ.get("ANDREA_CHROMIUM") or next(filter(None, map(shutil.which, NAMES)), None)
    if found:
        return found
    why = "no chromium on PATH: apt-get install chromium (Debian's; .ci/run installs it), or set ANDREA_CHROMIUM"
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


class Browser:
    def __init__(self, profile, width=1280, height=1400):
        require("websockets")
        from websockets.sync.client import connect

        self.events, self._id, self._lines = [], 0, []
        self.proc = subprocess.Popen(
            [find_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
             "--remote-debugging-port=0", f"--user-data-dir={profile}", f"--window-size={width},{height}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        threading.Thread(target=self._drain, daemon=True).start()   # a full pipe would stall the browser
        port = self._devtools_port()
        pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        target = next(p for p in pages if p["type"] == "page")
        self._stack = contextlib.ExitStack()  # websockets 17 wants connect() as a context manager
        self.ws = self._stack.enter_context(connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=10))
        for domain in ("Runtime", "Log", "Page", "Network"):
            self.send(f"{domain}.enable")

    def _drain(self):
        for line in self.proc.stderr:
            self._lines.append(line)

    def _devtools_port(self, timeout=30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self._lines):
                if m := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line):
                    return int(m[1])
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.close()
        raise AssertionError("chromium did not start:\n" + "".join(self._lines[-30:]))

    def send(self, method, timeout=30, **params):
        """The result of one DevTools command; the events that arrive meanwhile are kept."""
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == self._id:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def evaluate(self, expression):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression, timeout=30, what=None):
        deadline = time.monotonic() + timeout
        while not self.evaluate(expression):
            assert time.monotonic() < deadline, f"{what or expression} did not happen within {timeout} s"
            time.sleep(0.05)

    def click(self, selector):
        """A left click with the mouse, at the centre of the first element `selector` finds."""
        x, y = self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                             "e.scrollIntoView(); const r = e.getBoundingClientRect(); "
                             "return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def type(self, selector, text):
        """Replace the text of an input or textarea as typing would."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).select()")
        self.send("Input.insertText", text=text)

    def screenshot(self, path):
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def problems(self) -> list[str]:
        """Console errors, uncaught exceptions and failed loads, so far."""
        self.send("Runtime.evaluate", expression="0")  # collects the events still in flight
        found = []
        for e in self.events:
            method, p = e.get("method"), e.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(f"exception: {p['exceptionDetails'].get('exception', {}).get('description')}")
            elif method == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
                found.append(f"console.{p['type']}: {[a.get('value', a.get('description')) for a in p['args']]}")
            elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
                found.append(f"log: {p['entry']['text']} {p['entry'].get('url', '')}")
        return found

    def requests(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def close(self):
        with_ws = getattr(self, "ws", None)
        if with_ws is not None:
            with contextlib.suppress(Exception):  # it may be gone already; the process is ended below anyway
                self.send("Browser.close", timeout=5)
            self._stack.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
