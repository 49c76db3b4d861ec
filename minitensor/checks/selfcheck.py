"""The start-up self-check of the fused GPU kernels: which ones a CupyOps is built to use.

    select_kernels("auto" | "fused" | "generic", xp) -> (fused pieces, one line saying so)

`minitensor.backends.get_ops(cupy, kernels)` calls it once per choice, when the model's backend is
built, and hands the pieces to `CupyOps`; nothing reads the choice later. `auto` (the default on
a GPU) runs each fused piece's sample (its record's, minitensor.backends.fused_pieces(),
declared in minitensor/backends/kernels/: the piece forward and backward on small random float32
inputs, a few milliseconds) through a CupyOps without the piece (the Ops code) and one with it (the fused
kernel), and keeps only the pieces whose outputs agree to float32 precision: max |fused -
generic| <= RTOL * max(1, max |generic|) over every output (TF32 precision for a piece whose products
run on tensor cores: its record's rtol). A piece that disagrees, or whose
kernel fails to build or run, is reported in the line and the Ops code takes its place. `fused`
uses every piece unchecked, `generic` none; on NumPy there is nothing to choose.
"""

import numpy as np

from minitensor.backends import fused_pieces
from minitensor.device import to_numpy

MODES = ("auto", "fused", "generic")
RTOL = 1e-4  # about 800 float32 epsilons: summation orders differ, formulas must not
SEED = 1234


def compare(check, name, xp):
    """(agrees, detail) for one check: its outputs with the piece off and on, norm-wise."""
    from minitensor.backends.cupy_ops import CupyOps

    outputs = []
    for names in ((), (name,)):
        ops = CupyOps(xp, fused=names)
        outputs.append([to_numpy(a).astype(np.float64) for a in check(ops, np.random.default_rng(SEED))])
    generic, fused = outputs
    worst = 0.0
    for g, f in zip(generic, fused, strict=True):
        if g.shape != f.shape:
            return False, f"output of shape {f.shape}, generic {g.shape}"
        err = float(np.max(np.abs(f - g))) if g.size else 0.0
        if not np.isfinite(err):
            return False, "non-finite output"
        worst = max(worst, err / max(1.0, float(np.max(np.abs(g))) if g.size else 1.0))
    piece = fused_pieces().get(name)
    rtol = piece.rtol if piece is not None and piece.rtol is not None else RTOL
    return worst <= rtol, f"max error {worst:.1e}"


def choose(checks, xp):
    """(names that agree, {name: why not} for those that do not), running every check."""
    chosen, refused = [], {}
    for name, check in checks.items():
        try:
            ok, detail = compare(check, name, xp)
        except Exception as e:  # a kernel that fails to compile or launch is refused like a wrong one
            ok, detail = False, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        if ok:
            chosen.append(name)
        else:
            refused[name] = detail
    return chosen, refused


def select_kernels(mode, xp, checks=None):
    """(the fused pieces to use, the line that says which and why) for arrays of xp; checks (name ->
    sample(ops, rng), every piece's by default) is what `auto` runs."""
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
        checks = {name: piece.sample for name, piece in fused_pieces().items()}
    chosen, refused = choose(checks, xp)
    line = f"kernels: fused {', '.join(chosen) or 'none'}"
    if refused:
        line += "; generic for " + "; ".join(f"{n} (failed its self-check: {why})" for n, why in refused.items())
    return tuple(chosen), line
