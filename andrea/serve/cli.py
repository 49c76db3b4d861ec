"""Serve a trained model over HTTP: `python -m andrea.serve RUN_OR_HF_DIR`.

    python -m andrea.serve out/andrea-tiny                     # http://127.0.0.1:8000/
    python -m andrea.serve RUN_OR_HF_DIR [--host H] [--port P] [--slots N] [--queue N] ...

RUN_OR_HF_DIR is what andrea.eval and andrea.trace take (a run directory, a ckpt-* directory or a
Hugging Face GPT-2 directory). The socket is bound before the model is read, so a port in use fails
at once (and a client that comes while it loads waits). It listens on 127.0.0.1 unless --host says
otherwise; it has no authentication, so another host needs --allow-remote, meant for a reverse proxy
in front (docs/serving.md). Ctrl-C stops it: the requests in flight get up to 5 seconds to finish,
then it exits 130 as every command does.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from pathlib import Path

from andrea.cli import ArgumentParser
from andrea.errors import UserError
from andrea.eval import load_any
from andrea.run import preflight
from andrea.serve.api import Limits, Served
from minitensor.memory import keep_freed_memory

GRACE_SECONDS = 5  # how long requests in flight may finish after Ctrl-C


def require_extra():
    """starlette and uvicorn, or a one-line error naming the extra."""
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise UserError(f"python -m andrea.serve needs the serve extra ({e.name} is missing): "
                        "pip install -e '.[serve]'") from None
    return uvicorn


def bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)  # clients that come while the model loads wait in the backlog, not refused
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e} (choose another --host or --port)") \
            from None
    return sock


def model_name(path) -> str:
    """The API's id for the model: its directory's name, with the run's for a ckpt-* directory."""
    path = Path(path).resolve()
    return f"{path.parent.name}/{path.name}" if path.name.startswith("ckpt-") else path.name


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def parse(argv):
    ap = ArgumentParser(prog="python -m andrea.serve", description=__doc__.splitlines()[0])
    ap.add_argument("model", metavar="RUN_OR_HF_DIR", help="a run directory, a ckpt-* directory or a GPT-2 directory")
    ap.add_argument("--host", default="127.0.0.1", help="the address to listen on (127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000, help="the port (8000; 0: any free one, printed)")
    ap.add_argument("--name", help="the model's id in the API (default: its directory's name)")
    ap.add_argument("--slots", type=int, default=4, help="requests generated at once, a token each in turn (4)")
    ap.add_argument("--queue", type=int, default=16, help="requests waiting beyond those; more get 429 (16)")
    ap.add_argument("--max-tokens-limit", type=int, default=Limits.max_tokens,
                    help=f"the largest max_tokens a request may ask ({Limits.max_tokens})")
    ap.add_argument("--max-choices", type=int, default=Limits.max_choices,
                    help=f"the most completions (n x prompts) in one request ({Limits.max_choices})")
    ap.add_argument("--max-request-bytes", type=int, default=Limits.max_request_bytes,
                    help=f"the largest request body ({Limits.max_request_bytes})")
    ap.add_argument("--allow-remote", action="store_true",
                    help="listen on a --host other than loopback (no authentication: see docs/serving.md)")
    ap.add_argument("--device", help="cpu, gpu or auto (default: $ANDREA_DEVICE, else cpu)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_args(argv)
    for flag in ("slots", "max_tokens_limit", "max_choices", "max_request_bytes"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.queue < 0:
        raise UserError(f"--queue must be >= 0, got {args.queue}")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    if not (is_loopback(args.host) or args.allow_remote):
        raise UserError(f"--host {args.host} would serve beyond this machine without authentication: put a reverse "
                        "proxy in front (docs/serving.md) and add --allow-remote, or keep --host 127.0.0.1")
    preflight.choose_device(args.device)  # an unknown name fails here, before the model is read
    if not Path(args.model).is_dir():
        raise UserError(f"{args.model} does not exist or is not a directory: give a run directory, a ckpt-* "
                        "directory or a Hugging Face GPT-2 directory")
    return args


def main(argv=None):
    keep_freed_memory()  # an entry point's choice: see minitensor/memory.py
    args = parse(argv)
    uvicorn = require_extra()
    from andrea.serve.app import create_app
    from andrea.serve.engine import Engine

    sock = bind(args.host, args.port)
    model, tokenizer, source, _ = load_any(args.model, preflight.choose_device(args.device, fallback="cpu"))
    limits = Limits(args.max_tokens_limit, args.max_choices, args.max_request_bytes)
    served = Served(model, tokenizer, args.name or model_name(args.model), limits)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/"
    print(f"serving {source} as `{served.name}` at {url} (the page; the API under {url}v1); Ctrl-C stops",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(create_app(served, Engine(args.slots, args.queue)), timeout_graceful_shutdown=GRACE_SECONDS,
                            log_level="info")
    uvicorn.Server(config).run(sockets=[sock])
    return 0
