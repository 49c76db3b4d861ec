"""ANDREA: GPT-2-architecture language models trained with minitensor, on NumPy or CuPy.

The commands are the modules at this level, each `python -m andrea.<name>`: train, prepare,
sample, export, plot, experiment, bench, params, trace, eval; cli.py is the shell they share, errors.py the
one error they turn into a one-line message, config.py the YAML configuration every part reads.
What they are made of is grouped by concern:

    model/     ANDREA and its AdamW
    data/      tokenizer, corpus streaming, token shards, batches
    run/       a training run's surroundings: checks, run directory, checkpoints, MPI/NCCL, timing
    interop/   Hugging Face format, the PyTorch reference model and component timings

As a library:

    from andrea import ModelConfig, ANDREA, AdamW
    model = ANDREA(ModelConfig(context_length=128, d_model=128, n_layer=4, n_head=4), device="cpu")
    loss = model.forward(idx, targets); model.zero_grad(); model.backward()
    AdamW(model, lr=3e-3).step()

These three names are imported on first use, so `python -m andrea.train` (and bench, sample) runs
this file before anything loads NumPy. That is where an entry point's one setting that must
precede NumPy is made: OPENBLAS_THREAD_TIMEOUT=4 (OpenBLAS reads it once, when NumPy loads it),
so BLAS threads sleep right after each GEMM instead of spinning on the cores minitensor's own
threads need (measured: BENCHMARKS.md, "Process tuning"). Only when the process's main module is one of
the entry points, and a value already in the environment wins. Importing andrea as a library
sets nothing.
"""

import os
import sys

ENTRY_POINTS = ("andrea.train", "andrea.bench", "andrea.sample")
__all__ = ["ANDREA", "AdamW", "ModelConfig"]



def entry_point(orig_argv=None):
    """The module run by `python -m MODULE`, from the interpreter's own command line (this file runs
    before that module's __spec__ is in place); None for any other start."""
    argv = list(sys.orig_argv if orig_argv is None else orig_argv)
    return argv[argv.index("-m") + 1] if "-m" in argv[:-1] else None


if entry_point() in ENTRY_POINTS:
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")


def __getattr__(name):
    if name == "ANDREA":
        from andrea.model.transformer import ANDREA

        return ANDREA
    if name == "AdamW":
        from andrea.model.optim import AdamW

        return AdamW
    if name == "ModelConfig":
        from andrea.config import ModelConfig

        return ModelConfig
    raise AttributeError(f"module 'andrea' has no attribute {name!r}")
