"""Two processes that start the same command together, many times over: how a race between them is
caught. Each process runs `CHILD`'s loop: at try k it waits for the same instant as the other (slot k
of `slot` seconds from a shared start), the second process a little later at each try (k % 40 steps
of `stagger` seconds, to sweep their offset across a short window), runs `body` (Python source over
`k`, `arg` and what `setup` defines) and prints "k outcome" (the body's value, or the error's type
and message). The tries are bounded: a process still running after `timeout` seconds is killed and
fails the test."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys, time
start, slot, stagger, tries, arg = (float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]),
                                    int(sys.argv[4]), sys.argv[5])
@SETUP@
def body(k):
@BODY@
for k in range(tries):
    at = start + slot * k + stagger * (k % 40)
    time.sleep(max(0.0, at - time.time() - 0.002))
    while time.time() < at:  # the last 2 ms spun: sleep alone wakes too unevenly to meet the other
        pass
    try:
        outcome = body(k)
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    print(k, str(outcome).replace(chr(10), " "), flush=True)
"""


def started_together(setup: str, body: str, args: tuple, tries: int, slot: float, stagger: float = 5e-5,
                     timeout: float = 300) -> dict[int, list[str]]:
    """{try: [the first process's outcome, the second's]} of `tries` tries of `body`, the two processes
    given `args[0]` and `args[1]`."""
    code = CHILD.replace("@SETUP@", setup).replace("@BODY@", "\n".join("    " + line for line in body.splitlines()))
    start = time.time() + 3.0  # both started and imported by then
    procs = [subprocess.Popen([sys.executable, "-c", code, str(start), str(slot), str(stagger * n), str(tries),
                               str(arg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
             for n, arg in enumerate(args)]
    outputs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, start + slot * tries + timeout - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"the tries did not end within {timeout} s")
        assert p.returncode == 0, err[-3000:]
        outputs.append(dict(line.split(" ", 1) for line in out.splitlines()))
    return {k: [o.get(str(k), "no outcome") for o in outputs] for k in range(tries)}
