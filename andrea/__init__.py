"""ANDREA: GPT-2-architecture language models trained with minitensor, on NumPy or CuPy.

The commands are the modules at this level, each `python -m andrea.<name>`: train, prepare,
sample, export, plot, experiment, bench, params, trace, eval, and the package serve; cli.py is the
shell they share, errors.py the one error they turn into a one-line message, config.py the YAML
configuration every part reads. What they are made of is grouped by concern:

    model/     ANDREA, its blocks and its sizes (its AdamW is minitensor's)
    data/      tokenizer, corpus streaming, token shards, batches
    run/       a training run's surroundings: checks, run directory, checkpoints, MPI/NCCL, timing
    interop/   Hugging Face format, the PyTorch reference model and component timings
    serve/     the HTTP server: OpenAI's completions API and a page that traces any token

As a library:

    from andrea import ModelConfig, ANDREA, AdamW
    model = ANDREA(ModelConfig(context_length=128, d_model=128, n_layer=4, n_head=4), device="cpu")
    loss = model.forward(idx, targets); model.zero_grad(); model.backward()
    AdamW(model, lr=3e-3).step()

These three names are imported on first use, so importing andrea loads nothing else. Importing it
sets nothing in the process either: the entry points (train, bench, sample) set what must precede
NumPy, OPENBLAS_THREAD_TIMEOUT=4, as their first statement, and glibc's malloc thresholds
(minitensor.memory); a script calls `tune_process()` before it imports NumPy for the same two.
"""

import os
import sys

__all__ = ["ANDREA", "AdamW", "ModelConfig", "tune_process"]

BLAS_THREAD_TIMEOUT = "4"  # the entry points' OPENBLAS_THREAD_TIMEOUT


def tune_process() -> dict:
    """The entry points' two process settings, for a script that uses andrea as a library: BLAS
    threads that sleep right after each GEMM instead of spinning on the cores minitensor's threads
    need (OPENBLAS_THREAD_TIMEOUT, which OpenBLAS reads once, when NumPy loads it: call this first),
    and malloc thresholds that keep freed memory for the next step's temporaries
    (minitensor.memory.keep_freed_memory). A value the user set is left alone. Returns what it set;
    warns when NumPy is loaded already, as the timeout cannot act then."""
    from minitensor.memory import keep_freed_memory

    done = {}
    if "OPENBLAS_THREAD_TIMEOUT" in os.environ:
        pass
    elif "numpy" in sys.modules:
        import warnings

        warnings.warn("andrea.tune_process() came after NumPy was imported: OPENBLAS_THREAD_TIMEOUT cannot act "
                      "any more; call it before `import numpy`", stacklevel=2)
    else:
        os.environ["OPENBLAS_THREAD_TIMEOUT"] = done["OPENBLAS_THREAD_TIMEOUT"] = BLAS_THREAD_TIMEOUT
    return {**done, **keep_freed_memory()}


def __getattr__(name):
    if name == "ANDREA":
        from andrea.model.transformer import ANDREA

        return ANDREA
    if name == "AdamW":
        from minitensor.optim import AdamW

        return AdamW
    if name == "ModelConfig":
        from andrea.config import ModelConfig

        return ModelConfig
    raise AttributeError(f"module 'andrea' has no attribute {name!r}")
