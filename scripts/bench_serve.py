"""andrea.serve's speed as its clients see it: time to first token and tokens/s, for 1 and N clients at once.

    python scripts/bench_serve.py out/andrea-tiny [--clients 1,4] [--requests 3] [--max-tokens 128]
    python scripts/bench_serve.py --random 120m --tokenizer data/stdlib/tokenizer.json   # random weights

Starts `python -m andrea.serve MODEL --port 0` as a child process (--random NAME first writes a model of
that config with random weights and the given tokenizer as a Hugging Face directory: the same
arithmetic per token as the trained model), sends one request to warm it up, then for each client
count runs that many clients at once, each sending --requests streamed completions one after the
other: a prompt of --prompt-tokens tokens of this file's own text, andrea.sample's defaults
(temperature 0.8, top_k 50) and return_token_ids, so that every token is counted as its event
arrives. Reported per client count: time to first token (the request sent to the first event that
carries a token), each stream's tokens/s after its first token, and the completion tokens of all
clients over the wall time from the first request sent to the last event received. A completion may
end before --max-tokens at <|endoftext|>: only tokens received count. The clients share the
machine with the server, as they would on one host. --threads N sets OPENBLAS_NUM_THREADS and
ANDREA_NUM_THREADS for the server (default: every CPU, as the server's own default).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def random_model(name: str, tokenizer_path: str, directory: Path) -> Path:
    """A Hugging Face directory of config `name` with random weights (seed 0) and the tokenizer."""
    from andrea.config import load_config
    from andrea.data.tokenizer import load_tokenizer
    from andrea.model.transformer import ANDREA

    tokenizer = load_tokenizer(tokenizer_path)
    ANDREA(load_config(name).model, seed=0).save_pretrained(directory, tokenizer=tokenizer)
    return directory


class Server:
    def __init__(self, model, extra, threads=None):
        env = dict(os.environ, **({"OPENBLAS_NUM_THREADS": str(threads), "ANDREA_NUM_THREADS": str(threads)}
                                  if threads else {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "andrea.serve", str(model), "--port", "0", *extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        for line in self.proc.stderr:
            if found := re.search(r"at http://([\d.]+):(\d+)/ \(the page", line):
                self.host, self.port = found[1], int(found[2])
                break
        else:
            raise SystemExit(f"the server did not start (exit {self.proc.wait()})")
        threading.Thread(target=lambda: list(self.proc.stderr), daemon=True).start()  # its access log

    def post(self, path, body):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        return conn, conn.getresponse()

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def one_stream(server, body) -> dict:
    """A streamed completion: when it was sent, when each token arrived."""
    sent = time.perf_counter()
    conn, response = server.post("/v1/completions", body)
    if response.status != 200:
        raise SystemExit(f"HTTP {response.status}: {response.read().decode()}")
    arrivals = []
    for line in response:
        if line.startswith(b"data: {"):
            arrivals += [time.perf_counter()] * len(json.loads(line[6:])["choices"][0].get("token_ids", []))
    conn.close()
    return {"sent": sent, "arrivals": arrivals}


def run_clients(server, body, clients: int, requests: int) -> dict:
    def client(_):
        return [one_stream(server, body) for _ in range(requests)]

    with ThreadPoolExecutor(clients) as pool:
        streams = [s for per_client in pool.map(client, range(clients)) for s in per_client]
    streams = [s for s in streams if s["arrivals"]]
    first = [s["arrivals"][0] - s["sent"] for s in streams]
    rates = [(len(a) - 1) / (a[-1] - a[0]) for a in (s["arrivals"] for s in streams) if len(a) > 1]
    tokens = sum(len(s["arrivals"]) for s in streams)
    wall = max(s["arrivals"][-1] for s in streams) - min(s["sent"] for s in streams)
    return {"clients": clients, "requests": len(streams), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_median_s": statistics.median(first), "ttft_max_s": max(first),
            "stream_tokens_per_s_median": statistics.median(rates) if rates else None}


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return re.search(r"Model name:\s*(.+)", out)[1].strip()
    except (OSError, TypeError):
        return "unknown CPU"


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="what andrea.serve takes: a run, ckpt-* or GPT-2 directory")
    ap.add_argument("--random", metavar="CONFIG", help="a random-weight model of this config (tiny, small, 120m)")
    ap.add_argument("--tokenizer", help="the tokenizer.json for --random")
    ap.add_argument("--clients", default="1,4", help="client counts, comma-separated (1,4)")
    ap.add_argument("--requests", type=int, default=3, help="completions each client asks for in turn (3)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, help="the server's BLAS and andrea threads (default: every CPU)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    if (args.model is None) == (args.random is None) or (args.random and not args.tokenizer):
        ap.error("give MODEL, or --random CONFIG with --tokenizer PATH")
    return args


def main(argv=None):
    args = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or random_model(args.random, args.tokenizer, Path(tmp) / args.random)
        server = Server(model, ["--device", args.device, "--slots", str(max(map(int, args.clients.split(","))))],
                        args.threads)
        try:
            conn, response = server.post("/andrea/tokens", {"text": Path(__file__).read_text()})
            prompt = json.loads(response.read())["ids"][:args.prompt_tokens]
            body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.8, "top_k": 50, "seed": 0,
                    "stream": True, "return_token_ids": True}
            one_stream(server, dict(body, max_tokens=8))                     # warm-up
            rows = [run_clients(server, body, int(n), args.requests) for n in args.clients.split(",")]
        finally:
            server.stop()
    head = {"model": str(args.model or f"random {args.random}"), "cpu": cpu_name(), "device": args.device,
            "threads": args.threads or len(os.sched_getaffinity(0)),
            "load_average": os.getloadavg(), "prompt_tokens": len(prompt), "max_tokens": args.max_tokens}
    print(json.dumps(head))
    print("| clients | completions | tokens | wall s | tokens/s, all clients | tokens/s, one stream (median) | "
          "first token, median (max) |\n|---|---|---|---|---|---|---|")
    for r in rows:
        rate = r["stream_tokens_per_s_median"]
        print(f"| {r['clients']} | {r['requests']} | {r['tokens']} | {r['wall_s']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{rate:.0f} | {r['ttft_median_s'] * 1000:.0f} ms ({r['ttft_max_s'] * 1000:.0f} ms) |" if rate else "|")
    if args.json:
        Path(args.json).write_text(json.dumps({**head, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
