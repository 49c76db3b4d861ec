"""Kernel selection: which fused GPU pieces a CupyOps is built to use, each self-checked and timed at start-up.

    select_kernels("auto" | "fused" | "generic", xp, sizes=None) -> (fused pieces, one line saying so)
    Choice(fused, line)    a choice made elsewhere (rank 0's, broadcast to every rank of a run):
                           get_ops(cupy, Choice(...)) builds the backend with exactly those pieces

`minitensor.backends.get_ops(cupy, kernels)` calls it once per choice, when the model's backend is
built, and hands the pieces to `CupyOps`; nothing reads the choice later. `auto` (the default on
a GPU) runs each fused piece's sample (its record's, minitensor.backends.fused_pieces(),
declared in minitensor/backends/kernels/: the piece forward and backward on small random float32
inputs, a few milliseconds; given the run's sizes, a sample that takes them runs at the run's head
size, so that ANDREA-120M compares the flash kernels' tensor-core path at 64) through a CupyOps
without the piece (the Ops code) and one with it (the fused kernel), and keeps only the pieces whose
outputs agree to float32 precision: max |fused - generic| <= RTOL * max(1, max |generic|) over every
output (TF32 precision for a piece whose products run on tensor cores: its record's rtol; a bfloat16
output, which the flash sample gives for a bf16 run's sizes, at BF16_RTOL). A piece
that disagrees, or whose kernel fails to build or run, is reported in the line and the Ops code
takes its place.

Given the run's sizes (a minitensor.backends.cuda.Sizes: the trainer's batch and context), `auto` then
times each piece that agreed at those sizes, its forward and backward through the backend with the
piece and without it, the other pieces that agreed in use both times (its record's `timed`; the flash
attention core against the core the backend takes without it, the dense one with the fused softmax
within its memory budget), the device synchronised around each run,
the median of TIMED_RUNS after one to warm up, and keeps the piece only where it is not slower (a
tie keeps the fused piece); the line gives both times for each. A timing that raises (out of memory
at the run's sizes, a launch error) falls back to the generic code for that piece, the line saying
why, rather than ending the model's construction. On the CuPy stand-in (no GPU: the kernels run in
a CPU emulation), times say nothing about a GPU and none are taken.

`fused` uses every piece unchecked and untimed, `generic` none; on NumPy there is nothing to choose.

Several processes of one run (data parallel) must run the same pieces: a near tie timed on each
rank alone could flip, and a different AdamW makes the weight replicas drift apart silently. So
rank 0 alone selects, and the others build their backend from its Choice
(andrea.run.kernels.agreed_kernels, over the run's transport: MPI, or nothing for one process).
"""

import dataclasses
import inspect
import statistics
import time

import numpy as np

from minitensor import precision
from minitensor.backends.kernels import fused_pieces
from minitensor.device import to_numpy

MODES = ("auto", "fused", "generic")
RTOL = 1e-4  # about 800 float32 epsilons: summation orders differ, formulas must not
# a bfloat16 output (a bf16 run's check): 8 u, u = 2^-8 bfloat16's unit roundoff. Each side is within a few
# roundings of the exact value relative to the output's largest (the flash kernels round P and dS for their
# products and each output once: tests/gpu/test_flash_bf16.py's bound; the Ops code rounds the same
# quantities in another order), so the two within twice that; a wrong fragment layout or index errs by the
# output's own size
BF16_RTOL = 2.0 ** -5
SEED = 1234
TIMED_RUNS = 3


@dataclasses.dataclass(frozen=True)
class Choice:
    """The fused pieces to use and the line that says why, decided elsewhere (rank 0's select_kernels,
    broadcast): a backend built from it runs exactly these, with no self-check of its own."""
    fused: tuple
    line: str

    def to_json(self):
        return {"fused": list(self.fused), "line": self.line}

    @classmethod
    def from_json(cls, value):
        return cls(tuple(value["fused"]), value["line"])


def compare(check, name, xp):
    """(agrees, detail) for one check: its outputs with the piece off and on, norm-wise."""
    from minitensor.backends.cupy_ops import CupyOps

    outputs = []
    for names in ((), (name,)):
        ops = CupyOps(xp, fused=names)
        outputs.append(list(check(ops, np.random.default_rng(SEED))))
    generic, fused = outputs
    piece = fused_pieces().get(name)
    rtol = piece.rtol if piece is not None and piece.rtol is not None else RTOL
    worst = 0.0  # the largest error over its output's tolerance
    for g, f in zip(generic, fused, strict=True):
        if g.shape != f.shape:
            return False, f"output of shape {f.shape}, generic {g.shape}"
        tolerance = BF16_RTOL if f.dtype.name == precision.BF16 else rtol
        g, f = (to_numpy(a).astype(np.float64) for a in (g, f))
        err = float(np.max(np.abs(f - g))) if g.size else 0.0
        if not np.isfinite(err):
            return False, "non-finite output"
        worst = max(worst, err / max(1.0, float(np.max(np.abs(g))) if g.size else 1.0) / tolerance)
    return worst <= 1.0, f"max error {worst:.2g} of its tolerance"


def choose(checks, xp):
    """(names that agree, {name: why not} for those that do not), running every check."""
    chosen, refused = [], {}
    for name, check in checks.items():
        try:
            ok, detail = compare(check, name, xp)
        except Exception as e:  # a kernel that fails to compile or launch is refused like a wrong one
            ok, detail = False, _first_line(e)
        if ok:
            chosen.append(name)
        else:
            refused[name] = detail
    return chosen, refused


def select_kernels(mode, xp, checks=None, sizes=None, timers=None):
    """(the fused pieces to use, the line that says which and why) for arrays of xp; checks (name ->
    sample(ops, rng), every piece's by default) is what `auto` runs; with sizes, timers (name ->
    timed(ops, sizes), every piece's record's by default) are what it times."""
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {', '.join(MODES)}, got {mode!r}")
    if xp is np:
        return (), "kernels: generic (NumPy)"
    if mode == "generic":
        return (), "kernels: generic (train.kernels=generic)"
    if mode == "fused":
        names = tuple(fused_pieces())
        return names, f"kernels: fused {', '.join(names)} (train.kernels=fused, not self-checked)"
    if checks is None:
        checks = {name: at_sizes(piece.sample, sizes) for name, piece in fused_pieces().items()}
    chosen, refused = choose(checks, xp)
    times = {}
    if sizes is not None and not getattr(xp, "STANDIN", False):
        chosen, times = keep_faster(chosen, refused, xp, sizes, timers)
    line = "kernels: fused " + (", ".join(n + (f" ({1e3 * times[n][0]:.3g} ms against {1e3 * times[n][1]:.3g})"
                                               if n in times else "") for n in chosen) or "none")
    if refused:
        line += "; generic for " + "; ".join(
            f"{n} ({why if why.startswith(('slower', 'timing failed')) else 'failed its self-check: ' + why})"
            for n, why in refused.items())
    if sizes is not None and getattr(xp, "STANDIN", False):
        line += " (not timed: the CuPy stand-in runs the kernels on the CPU)"
    return tuple(chosen), line


def at_sizes(sample, sizes):
    """The check of a piece at the run's sizes: its sample given them where it takes them (the
    attention's, for the run's head size), else as it is."""
    if sizes is None or "sizes" not in inspect.signature(sample).parameters:
        return sample
    return lambda ops, rng: sample(ops, rng, sizes=sizes)


def keep_faster(chosen, refused, xp, sizes, timers=None):
    """(the pieces of `chosen` not slower than the generic code at sizes, {name: (fused s, generic s)}),
    adding the slower ones, and those whose timing raised, to refused. A tie keeps the fused piece."""
    if timers is None:
        timers = {name: piece.timed for name, piece in fused_pieces().items() if piece.timed}
    times = {}
    for name in [n for n in chosen if n in timers]:
        try:
            times[name] = time_piece(timers[name], name, xp, sizes, others=[n for n in chosen if n != name])
        except Exception as e:  # out of memory, a launch error: this piece runs the generic code
            refused[name] = f"timing failed at the run's sizes, {_first_line(e)}"
            _free_pool(xp)  # what the failed run held, so that the next piece's timing has it
    slower = {n for n, (fused, generic) in times.items() if fused > generic}
    refused.update({n: f"slower: fused {1e3 * times[n][0]:.3g} ms, generic {1e3 * times[n][1]:.3g} ms"
                    for n in slower})
    return [n for n in chosen if n not in slower and n not in refused], times


def _first_line(e):
    """'Type: the first line of its message' (or 'Type' where it has none), for a line of the log."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def time_piece(timed, name, xp, sizes, others=()):
    """(seconds with the piece, seconds without) of one forward and backward at `sizes`, the other
    pieces `others` in use both times (without the flash core, the dense core runs with the fused
    softmax where that passed): the median of TIMED_RUNS runs each, after one to warm up (the kernels
    built, the memory pool grown), the device synchronised before and after each."""
    from minitensor.backends.cupy_ops import CupyOps

    seconds = []
    for names in ((*others, name), tuple(others)):
        run = timed(CupyOps(xp, fused=names), sizes)
        runs = []
        for i in range(TIMED_RUNS + 1):
            _synchronize(xp)
            start = time.perf_counter()
            run()
            _synchronize(xp)
            if i:
                runs.append(time.perf_counter() - start)
        seconds.append(statistics.median(runs))
        del run
    return tuple(seconds)


def _free_pool(xp):
    pool = getattr(xp, "get_default_memory_pool", None)
    if pool is not None:
        pool().free_all_blocks()


def _synchronize(xp):
    cuda_ = getattr(xp, "cuda", None)
    if cuda_ is not None:
        cuda_.get_current_stream().synchronize()
