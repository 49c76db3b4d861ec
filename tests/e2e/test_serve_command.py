"""`python -m andrea.serve RUN` as a user runs it: the command in a subprocess serves a tiny trained
run; its page, in a headless Chromium (Debian's package), streams a completion that is the API's own
for the same settings, and a click on a token draws each block's attention heat map, residual sizes
and logit lens from /andrea/trace, with no console error and no request beyond the server (a
screenshot is kept in test-artifacts/serve-page.png); requests that are the client's fault leave no
traceback in its log; Ctrl-C stops it. Usage errors are one line and exit 2, before any model is
read, and so is a missing serve extra.
"""

import contextlib
import io
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from chromium import Browser
from optional import require
from runs import tiny_run
from serving import call

from andrea.cli import run_cli
from andrea.serve import cli

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "test-artifacts" / "serve-page.png"
PROMPT = "def loads(s, *, cls=None):\n"


class Process:
    """The server command, its stderr read as it comes, and the URL it printed."""

    def __init__(self, argv):
        require("uvicorn")
        self.lines = []
        self.proc = subprocess.Popen([sys.executable, "-m", "andrea.serve", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        try:
            deadline = time.monotonic() + 60
            while not (found := re.search(r"at (http://\S+)/ \(the page", self.output())):
                assert self.proc.poll() is None and time.monotonic() < deadline, f"no server:\n{self.output()}"
                time.sleep(0.05)
            self.url = found[1]
            assert call(self.url, "/health")[0] == 200  # a client that comes early waits in the socket's backlog
        except BaseException:
            self.stop()
            raise

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def output(self):
        return "".join(self.lines)


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir):
    return tiny_run(tmp_path_factory.mktemp("serve-command"), data_dir)


@pytest.fixture(scope="module")
def server(run):
    process = Process([str(run), "--port", "0", "--name", "tiny"])
    yield process
    process.stop()


HEATMAPS = """[...document.querySelectorAll('#blocks canvas.heatmap')].map((c, b) => {
  const [label, cell, height] = [Number(c.dataset.label), Number(c.dataset.cell), Number(c.dataset.height)];
  const pixel = ([h, j]) => [...c.getContext('2d').getImageData(label + j * cell + cell / 2,
                                                                 h * height + height / 2, 1, 1).data.slice(0, 3)];
  return [Number(c.dataset.heads), c.height / Number(c.dataset.heads), CELLS[b].map(pixel)];
})"""
YELLOW = [253, 231, 37]  # the top of the page's colour scale: the largest probability of a map


def heatmap_pixels(browser, blocks):
    """Per block: (heads, row height, the colours of its most and least attended cells) as drawn."""
    cells = []
    for block in blocks:
        att = np.array(block["attention"])
        cells.append([np.unravel_index(att.argmax(), att.shape), np.unravel_index(att.argmin(), att.shape)])
    cells = [[[int(h), int(j)] for h, j in pair] for pair in cells]
    return browser.evaluate(f"(() => {{ const CELLS = {json.dumps(cells)}; return {HEATMAPS}; }})()")


def test_the_page_streams_a_completion_and_traces_a_clicked_token(server, run, tmp_path):
    settings = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0.8, "top_k": 50, "top_p": 1, "seed": 4}
    status, _, want = call(server.url, "/v1/completions", {**settings, "return_token_ids": True})
    assert status == 200 and want["choices"][0]["finish_reason"] == "length"
    browser = Browser(tmp_path / "profile")
    try:
        browser.send("Page.navigate", url=server.url + "/")
        browser.wait_for("document.readyState === 'complete' && document.getElementById('model').textContent"
                         ".startsWith('tiny, context 32')", what="the page and the model's name")
        browser.type("#prompt", PROMPT)
        browser.type("#max_tokens", "20")
        browser.type("#seed", "4")
        browser.click("#generate")
        browser.wait_for("!document.getElementById('trace').hidden && "
                         "document.getElementById('status').textContent.includes('traced')", what="stream and trace")
        shown = browser.evaluate("[...document.querySelectorAll('#tokens .tok.gen')].map(e => e.textContent)")
        assert len(shown) == 20 and "".join(shown) == want["choices"][0]["text"]
        prompt_length = len(want["choices"][0]["prompt_token_ids"])
        position = prompt_length + 7
        browser.click(f'.tok[data-pos="{position}"]')
        browser.wait_for(f"document.getElementById('status').textContent === 'position {position} traced'",
                         what="the clicked token's trace")
        assert browser.evaluate("document.querySelector('.tok.selected').dataset.pos") == str(position)
        ids = want["choices"][0]["prompt_token_ids"] + want["choices"][0]["token_ids"]
        status, _, trace = call(server.url, "/andrea/trace", {"ids": ids, "position": position})
        maps = heatmap_pixels(browser, trace["blocks"])
        assert len(maps) == len(trace["blocks"]) == 2
        for heads, row_height, (most, least) in maps:         # each map drawn from the trace's attention
            assert heads == 2 and row_height == 14
            assert most == YELLOW and sum(least) < sum(most)
        residual = browser.evaluate("document.querySelector('.residual').firstChild.textContent")
        assert residual == f"in {trace['blocks'][0]['residual'][0]:.3f}"
        lens = browser.evaluate("document.querySelector('.block .ranked li').firstChild.textContent")
        assert lens == json.dumps(trace["blocks"][0]["lens"][0][0], ensure_ascii=False)
        shot = browser.screenshot(SCREENSHOT)
        assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 10_000
        assert browser.problems() == []
        outside = [u for u in browser.requests() if not u.startswith((server.url + "/", "data:"))]
        assert outside == [] and server.url + "/v1/completions" in browser.requests()
    finally:
        browser.close()


def test_bad_requests_leave_no_traceback_in_the_commands_log(server):
    nested = b'{"prompt": "x", "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    for body, raw in [(None, nested), ({"prompt": "a\ud800"}, None), ({"stop": ["\udfff"]}, None),
                      ({"model": "\ud800"}, None), ({"\ud800": 1}, None), ({"temperature": [[[[1]]]]}, None)]:
        status, _, got = call(server.url, "/v1/completions", body, raw=raw)
        assert status in (400, 404) and set(got["error"]) == {"message", "type", "param", "code"}, (body, got)
    status, _, got = call(server.url, "/v1/completions", {"prompt": "def", "temperature": 5e-324, "max_tokens": 3})
    assert status == 200 and got["usage"]["completion_tokens"] == 3
    time.sleep(0.5)  # uvicorn writes a request's line after its answer
    assert server.output().count('"POST /v1/completions HTTP/1.1" 400') >= 5   # the log is the one read here
    assert "Traceback" not in server.output() and "ERROR" not in server.output(), server.output()


def test_ctrl_c_stops_the_command(server):
    server.proc.send_signal(signal.SIGINT)
    code = server.proc.wait(timeout=30)
    assert code == 130 and server.output().endswith("interrupted\n"), server.output()  # Ctrl-C's code, as every command
    assert "Traceback" not in server.output() and "Application shutdown complete" in server.output()


def serve_error(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        run_cli(cli.main, argv)
    return e.value.code, err.getvalue()


def test_usage_errors_are_one_line_before_the_model_is_read(run, tmp_path):
    for argv, words in [([str(tmp_path / "missing"), "--port", "0"], "does not exist"),
                        ([str(run), "--host", "0.0.0.0"], "--allow-remote"),
                        ([str(run), "--slots", "0"], "--slots must be at least 1"),
                        ([str(run), "--port", "70000"], "--port must be in 0..65535"),
                        ([str(run), "--device", "tpu"], "is not a device")]:
        code, err = serve_error(argv)
        assert code == 2 and words in err and err.count("\n") == 1, (argv, err)


def test_a_port_in_use_is_one_line(run):
    require("starlette")
    require("uvicorn")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with taken:
        code, err = serve_error([str(run), "--port", str(port)])
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("missing", ["starlette", "uvicorn"])
def test_without_the_serve_extra_the_command_says_which_to_install(run, monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed: importing it fails
    code, err = serve_error([str(run), "--port", "0"])
    assert code == 2 and err.count("\n") == 1, err
    assert f"needs the serve extra ({missing} is missing): pip install -e '.[serve]'" in err


def test_the_serving_benchmark_runs_and_counts_every_token(run, tmp_path):
    require("starlette")
    require("uvicorn")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_serve
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    out = tmp_path / "bench.json"
    with contextlib.redirect_stdout(io.StringIO()):
        bench_serve.main([str(run), "--clients", "1,2", "--requests", "1", "--max-tokens", "6", "--prompt-tokens", "8",
                          "--json", str(out)])
    figures = json.loads(out.read_text())
    assert [r["clients"] for r in figures["rows"]] == [1, 2] and figures["prompt_tokens"] == 8
    for row in figures["rows"]:
        assert row["requests"] == row["clients"] and 0 < row["tokens"] <= 6 * row["clients"]
        assert row["tokens_per_s"] > 0 and 0 < row["ttft_median_s"] <= row["ttft_max_s"] < row["wall_s"]
