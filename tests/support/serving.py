"""andrea.serve for the tests: its application in a thread of the test process on a free port of
127.0.0.1 (`serving(run_dir, ...)`), with what it logs kept (`Running.log`), and plain HTTP calls to
it that return status, headers and JSON whatever the status (`call`)."""

import contextlib
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import NamedTuple

from optional import require


class Running(NamedTuple):
    url: str          # http://127.0.0.1:PORT
    served: object    # andrea.serve.api.Served
    engine: object    # andrea.serve.engine.Engine
    server: object    # uvicorn.Server
    log: list         # each record the server logged (uvicorn's, Starlette's, andrea.serve's), as text


class Kept(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record):
        self.lines.append(self.format(record))  # with its traceback, if it has one


@contextlib.contextmanager
def serving(run_dir, name="tiny", slots=4, queue=16, **limits):
    """The server of `run_dir` (its model loaded here), up until the block ends. Its log goes to the
    root logger (uvicorn's own configuration is not applied), where `log` keeps it."""
    uvicorn = require("uvicorn")
    require("starlette")
    from andrea.eval import load_any
    from andrea.serve.api import Limits, Served
    from andrea.serve.app import create_app
    from andrea.serve.engine import Engine

    model, tokenizer, _, _ = load_any(run_dir)
    served = Served(model, tokenizer, name, Limits(**limits))
    engine = Engine(slots, queue)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(create_app(served, engine), log_config=None, log_level="warning",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    kept = Kept()
    logging.getLogger().addHandler(kept)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        yield Running(f"http://127.0.0.1:{sock.getsockname()[1]}", served, engine, server, kept.lines)
    finally:
        server.should_exit = True
        thread.join(20)
        logging.getLogger().removeHandler(kept)
        assert not thread.is_alive(), "the server did not stop"


def call(url, path, body=None, method=None, raw=None, timeout=30):
    """(status, headers, JSON body or the text) of one request; body is sent as JSON, raw as bytes."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, headers, text = response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as e:
        status, headers, text = e.code, e.headers, e.read().decode()
    try:
        return status, headers, json.loads(text)
    except ValueError:
        return status, headers, text


def wait_until(condition, timeout=10.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout} s"
        time.sleep(0.02)
