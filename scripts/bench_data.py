"""Data preparation measured phase by phase, beside the encoder's own ceiling on the same text.

    python scripts/bench_data.py --input /tmp/corpus-1g [--workers N] [--tokenizer-sample 100MB]

Runs `python -m andrea.prepare` on the corpus into a fresh temporary data directory (removed
afterwards unless --keep) and samples the child's resident memory (VmRSS, every 0.1 s), telling
the phases apart by the progress lines prepare prints: listing and planning, tokenizer reading,
tokenizer merging, encoding. Then, side by side on the same machine, the ceilings on the same text
(the corpus's first --ceiling-bytes, read into memory first): the fast encoder (tiktoken, as
`Tokenizer.encode_array`) on all N threads and on one, and Hugging Face `tokenizers`' own
`encode_batch` (what prepare used before). Prints one table and the machine's load average,
since a busy machine slows every figure. Linux only (/proc).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from andrea.data import stream
from andrea.data.inputs import resolve_inputs
from andrea.data.preparation import default_workers
from andrea.data.tokenizer import Tokenizer
from andrea.prepare import byte_count

PHASES = [("training a ", "tokenizer reading"), ("tokenizer: computing", "tokenizer merges"),
          ("encoding", "encoding")]


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_prepare(corpus: str, data_dir: Path, workers: int, sample: str) -> dict:
    """Run prepare in a child; return its meta.json, wall time and per-phase (seconds, peak RSS)."""
    cmd = [sys.executable, "-m", "andrea.prepare", "--input", corpus, "--data-dir", str(data_dir),
           "--workers", str(workers), "--tokenizer-sample", sample]
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    phase = {"name": "listing and planning", "since": t0}
    seen: dict[str, dict] = {"listing and planning": {"start": t0, "end": t0, "peak": 0}}

    def sample_rss():
        while child.poll() is None:
            p = seen[phase["name"]]
            p["peak"] = max(p["peak"], rss_bytes(child.pid))
            p["end"] = time.perf_counter()
            time.sleep(0.1)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    lines = []
    for line in child.stderr:
        lines.append(line)
        for prefix, name in PHASES:
            if line.startswith(prefix) and phase["name"] != name:
                now = time.perf_counter()
                seen[phase["name"]]["end"] = now
                seen.setdefault(name, {"start": now, "end": now, "peak": 0})
                phase["name"] = name
    child.wait()
    sampler.join()
    wall = time.perf_counter() - t0
    if child.returncode != 0:
        sys.exit(f"error: prepare failed ({child.returncode}):\n{''.join(lines[-5:])}")
    meta = json.loads((data_dir / "meta.json").read_text())
    return {"meta": meta, "wall": wall, "phases": seen}


def ceiling_texts(corpus: str, limit: int) -> list[str]:
    """The corpus's first `limit` bytes as the blocks prepare encodes (its blocking, in order)."""
    files = resolve_inputs([corpus])
    sizes = [p.stat().st_size for p in files]
    blocks = stream.plan_blocks(files, sizes, Path(os.path.commonpath([p.parent for p in files])), 0.01)
    reader = stream.BlockReader(files, sizes, blocks)
    texts, total = [], 0
    for j in range(len(blocks)):
        n, text, _ = reader.read(j)
        texts.append(text)
        total += n
        if total >= limit:
            break
    return texts


def encode_rate(fn, texts, workers: int) -> float:
    n = sum(len(t.encode("utf-8")) for t in texts)
    t0 = time.perf_counter()
    if workers == 1:
        for t in texts:
            fn(t)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(fn, texts, chunksize=4))
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python scripts/bench_data.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", required=True, help="the corpus (a directory, file or glob)")
    ap.add_argument("--workers", type=int, default=default_workers())
    ap.add_argument("--tokenizer-sample", default="100MB")
    ap.add_argument("--ceiling-bytes", type=byte_count, default=byte_count("100MB"),
                    help="how much of the corpus the ceilings encode (default 100MB; tokenizers' gets a tenth)")
    ap.add_argument("--keep", type=Path, help="prepare into this directory and keep it")
    args = ap.parse_args()

    load_before = os.getloadavg()
    tmp = None if args.keep else Path(tempfile.mkdtemp(prefix="andrea-bench-data-"))
    data_dir = args.keep or tmp / "data"
    try:
        run = run_prepare(args.input, data_dir, args.workers, args.tokenizer_sample)
        tok = Tokenizer.load(data_dir / "tokenizer.json")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    texts = ceiling_texts(args.input, args.ceiling_bytes)
    fast_all = encode_rate(tok.encode_array, texts, args.workers)
    fast_one = encode_rate(tok.encode_array, texts[: max(1, len(texts) // args.workers)], 1)
    hf_texts = texts[: max(1, len(texts) // 10)]
    hf_all = sum(len(t.encode()) for t in hf_texts) / _timed(lambda: tok._hf.encode_batch_fast(hf_texts))
    load_after = os.getloadavg()

    meta, phases = run["meta"], run["phases"]
    mb = meta["bytes"] / 1e6
    print(f"corpus {args.input}: {mb:.0f} MB, {meta['files']} files; {args.workers} threads; "
          f"{meta['train_tokens'] + meta['val_tokens']:,} tokens in {len(meta['shards']['train'])} + "
          f"{len(meta['shards']['val'])} shards")
    print(f"{'phase':<24}{'seconds':>9}{'MB/s':>9}{'peak RSS':>11}")
    for name, p in phases.items():
        secs = p["end"] - p["start"]
        rate = mb / secs if name in ("encoding", "whole prepare") and secs > 0 else None
        print(f"{name:<24}{secs:>9.1f}{(f'{rate:.1f}' if rate else ''):>9}{p['peak'] / 2**30:>8.2f} GiB")
    peak = max(p["peak"] for p in phases.values())
    print(f"{'whole prepare':<24}{run['wall']:>9.1f}{mb / run['wall']:>9.1f}{peak / 2**30:>8.2f} GiB")
    enc_rate = meta["bytes"] / meta["seconds"]["encode"]  # prepare's own clock for the phase
    print(f"ceilings on {sum(len(t.encode()) for t in texts) / 1e6:.0f} MB of the same text: tiktoken "
          f"{fast_all / 1e6:.1f} MB/s on {args.workers} threads, {fast_one / 1e6:.1f} MB/s on one; tokenizers "
          f"encode_batch {hf_all / 1e6:.1f} MB/s")
    print(f"encoding in prepare: {enc_rate / 1e6:.1f} MB/s = {100 * enc_rate / fast_all:.0f}% of the encoder's "
          f"all-thread ceiling; prepare's tokenizer phase {meta['seconds']['tokenizer']:.1f} s, encoding phase "
          f"{meta['seconds']['encode']:.1f} s (its own clock)")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} CPUs)")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
