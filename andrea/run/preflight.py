"""Checks made before the first training step, so that nothing fails after work is done.

    plan = preflight.check(cfg, out_dir, processes=1, init_from=None)  # UserError on what would fail later
    print(plan.describe())                  # what `python -m andrea.train --dry-run` prints

`python -m andrea.train` runs these checks on every rank before any work, with and without
`--dry-run`. What is checked, each a one-line `UserError` naming the flag or `--set` key to change:
- the device: `--device`/`train.device`, or `$ANDREA_DEVICE` when the config says `auto`; a GPU is
  probed (a kernel and a matmul run on it), so the plan names the device the run will get, and
  `train.precision=bf16` is refused on a CPU (minitensor.precision.for_arrays: NumPy has no bfloat16
  arithmetic);
- the shape of a step: `train.tokens_per_step` must divide into batch x seq_len x processes, and
  `model.vocab_size` must fit the token files' uint16 ids;
- `--init-from`: the directory's weights, as loading reads them (hf.read_state: every file's header,
  each tensor's name and shape against the config, every value finite);
- the paths: `--out` must be (or be creatable as: made and removed again) a directory; `data.data_dir`
  too, written only when it must be prepared (a complete one on a read-only mount is only read);
- the sample prompt: a run that ends with a sample needs a prompt that encodes to tokens;
- the schedule: `train.warmup_steps` beyond `train.max_steps` is a warning saying the peak rate
  the run reaches (it was silent; refusing it would break quick `--max-steps 10` runs);
- memory: parameters, gradients and the two AdamW moments (4 N floats; 2 N + 2 N / P with ZeRO-1 over
  P processes; each in float32, or float64 with train.dtype=float64; train.precision=bf16 adds the
  layers' bfloat16 copy of the weights, 2 bytes each) plus the activations kept from forward to
  backward at the configured micro-batch (bfloat16 under bf16),
  plus 10% for everything else (measured below), against what the machine has (`MemAvailable` and
  the cgroup limit on Linux, free GPU memory on a GPU, which `auto` counts as when a GPU works): an
  error when the estimate does not fit, a warning above 80%;
- the data, as the run's preparation checks it (andrea.data.preparation.check_preparation, reading only):
  the inputs (one matching nothing, or other than those the directory was prepared from), the
  directory's state, shards and tokenizer, the corpus and its two splits; when it is prepared, the
  tokenizer's size against model.vocab_size and a window of seq_len + 1 tokens in both splits
  (`check_data` repeats this after a first-run preparation).

Activation memory follows BENCHMARKS.md's measurement on ANDREA-120M: 12 d_model floats per
token and layer, plus V + 3 d_model floats per token outside the blocks (logits, final LayerNorm
and head inputs), plus attention probabilities where a layer keeps them (only when they take at most 16 MiB).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from andrea import files
from andrea.data.manifest import split_counts
from andrea.data.tokenfile import MAX_VOCAB
from andrea.data.tokenizer import Tokenizer, load_tokenizer
from andrea.errors import UserError
from andrea.model.sizes import parameter_breakdown
from andrea.run import distributed as dist
from andrea.run.paths import check_directory, check_output_file  # noqa: F401 (check_output_file: the commands')
from andrea.run.schedule import make_schedule
from andrea.run.sinks import check_sinks
from minitensor.precision import for_arrays
from minitensor.precision import get as get_policy

DEVICES = ("auto", "cpu", "gpu")
ACTIVATION_FLOATS_PER_LAYER = 12  # d_model floats per token and layer (BENCHMARKS.md, Memory)
KEPT_PROBS_MAX_BYTES = 16 << 20   # minitensor.layers.attention keeps a layer's probabilities only up to this size
WARN_FRACTION = 0.8


def choose_device(flag, fallback="auto", flag_name="--device"):
    """The device to use: `flag` when given, else $ANDREA_DEVICE, else `fallback`; validated.

    A `flag` of None (nothing given) defers to the environment. Returns "auto", "cpu" or "gpu".
    """
    if flag is not None:
        name = _normal_device(flag)
        if name not in DEVICES:
            raise UserError(f"{flag_name} {flag!r} is not a device: use auto, cpu or gpu")
        return name
    env = os.environ.get("ANDREA_DEVICE", "")
    if env:
        name = _normal_device(env)
        if name not in DEVICES:
            raise UserError(f"ANDREA_DEVICE={env!r} is not a device: set it to auto, cpu or gpu, or unset it")
        return name
    return fallback


def _normal_device(name) -> str:
    name = str(name).strip().lower()
    return "gpu" if name == "cuda" else name


def train_device(cfg_device: str) -> str:
    """train.device "auto" means not chosen: $ANDREA_DEVICE decides then, as the README says."""
    return choose_device(None if cfg_device == "auto" else cfg_device, "auto", "train.device")


def probe_device(device: str) -> tuple[str, str]:
    """("cpu" or "gpu", a note) for a device request: what the run will get, after trying the GPU.

    The note says why "auto" falls back to the CPU, in one calm line: a CPU machine with CuPy
    installed (the dev extra brings it for the kernel check) has no CUDA driver, which is no error.
    """
    import minitensor.device

    if device == "cpu":
        return "cpu", ""
    ok, why = minitensor.device._probe_gpu()  # cached: the model's backend gets the same answer
    if ok:
        return "gpu", ""
    if device == "gpu":
        raise UserError(minitensor.device.unavailable(why))
    if "InsufficientDriver" in why or "NoDevice" in why or "no CUDA device found" in why:
        why = "CuPy is installed, but this machine has no CUDA driver or GPU"
    return "cpu", f"no usable GPU ({why}): training on the CPU; --device cpu skips the GPU probe"


# ----------------------------------------------------------------------------------------------- paths


# ----------------------------------------------------------------------------------------------- memory

@dataclass
class MemoryEstimate:
    parameters: int
    state_bytes: int       # parameters, gradients, AdamW m and v
    activation_bytes: int  # kept from forward to backward for one micro-batch

    @property
    def overhead_bytes(self) -> int:
        # temporaries of the step, the interpreter, the token arrays (the measurement behind the
        # 10%: BENCHMARKS.md, "Memory")
        return (self.state_bytes + self.activation_bytes) // 10

    @property
    def total(self) -> int:
        return self.state_bytes + self.activation_bytes + self.overhead_bytes


def estimate_memory(cfg, processes=1) -> MemoryEstimate:
    """Bytes a training run of `cfg` holds at its peak, from the shapes alone (nothing allocated)."""
    m, t = cfg.model, cfg.train
    n = parameter_breakdown(m)["total"]
    policy = get_policy(t.precision if t.dtype == "float32" else t.dtype)
    size = policy.master_dtype.itemsize                # the weights, gradients, m and v: float32 under bf16
    act = policy.compute_dtype.itemsize                # the activations: 2 bytes under bf16
    compute_copy = n * act if policy.mixed else 0      # bf16: the layers' bfloat16 copy of the weights
    B, T = t.batch_size, t.sequence_length(m)
    per_token = ACTIVATION_FLOATS_PER_LAYER * m.d_model * m.n_layer + m.vocab_size + 3 * m.d_model
    causal = B * m.n_head * T * T * act  # an upper bound on the kept (lower-triangular) blocks
    probs = m.n_layer * causal if causal <= KEPT_PROBS_MAX_BYTES else 0
    moments = 2 * n * size // (processes if t.zero_stage else 1)  # ZeRO-1: each rank's range of m and v alone
    return MemoryEstimate(n, 2 * n * size + moments + compute_copy, B * T * per_token * act + probs)


def available_memory(device: str) -> tuple[int | None, str]:
    """(bytes this process may still use, where that figure comes from); None when unknown."""
    if device == "gpu":
        try:
            import cupy

            free, _ = cupy.cuda.runtime.memGetInfo()
            return int(free), "free GPU memory"
        except Exception:  # no usable GPU: the device check reports that
            return None, "GPU memory unknown"
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        cap = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if cap != "max":
            limits.append((int(cap) - used, "the cgroup's memory.max"))
    except (OSError, ValueError):
        pass
    if not limits:
        return None, "memory unknown"
    return min(limits)


def memory_device(device: str) -> str:
    """Whose memory a run on `device` fills: "gpu" for gpu, and for auto when a GPU works (the
    model goes there: minitensor.device.get_device), else "cpu"."""
    if device == "auto":
        from minitensor.device import gpu_available

        return "gpu" if gpu_available() else "cpu"
    return "gpu" if device == "gpu" else "cpu"


def check_memory(estimate: MemoryEstimate, device: str, warn=None) -> str:
    """Raises when the estimate exceeds the memory available; returns a one-line verdict."""
    free, source = available_memory(device)
    need = (f"~{gib(estimate.total)} (state {gib(estimate.state_bytes)}, activations "
            f"{gib(estimate.activation_bytes)}, other {gib(estimate.overhead_bytes)})")
    if free is None:
        return f"{need}; {source}"
    if estimate.total > free:
        raise UserError(f"this run needs {need} but only {gib(free)} is available ({source}): "
                        "lower train.batch_size (--set train.batch_size=...), model.n_layer or model.d_model")
    if estimate.total > WARN_FRACTION * free:
        (warn or files.warn)(f"this run needs {need}, {100 * estimate.total / free:.0f}% of the {gib(free)} "
                        f"available ({source}): other programs may push it out of memory")
    return f"{need} of {gib(free)} available ({source})"


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------------------------- data

def check_split(name: str, n_tokens: int, cfg, where) -> None:
    """A split must hold one window of seq_len + 1 tokens; the message names the key to change."""
    T = cfg.train.sequence_length(cfg.model)
    if n_tokens >= T + 1:
        return
    key = "train.seq_len" if cfg.train.seq_len else "model.context_length"
    hint = f"--set train.seq_len={max(n_tokens - 1, 1)} (or less)" if n_tokens > 1 else "a larger corpus"
    extra = " or a larger data.val_fraction" if name == "validation" else ""
    raise UserError(f"the {name} split in {where} holds {n_tokens} tokens, too few for one window of {T + 1} "
                    f"({key} is {T}): use {hint}{extra}")


def prepared_counts(data_dir: Path):
    """(train tokens, val tokens) of an already prepared data directory (from its manifest), or None."""
    return split_counts(data_dir)


def check_data(cfg, n_train: int, n_val: int, where) -> None:
    check_split("training", n_train, cfg, where)
    check_split("validation", n_val, cfg, where)


# ----------------------------------------------------------------------------------------------- the pass

@dataclass
class Plan:
    """What a run will do, as the dry run prints it."""
    cfg: object
    out_dir: Path
    requested: str  # auto, cpu or gpu
    device: str     # what the probe found: cpu or gpu
    memory: MemoryEstimate
    memory_verdict: str
    data: str
    processes: int = 1
    device_note: str = ""
    lines: list = field(default_factory=list)

    def describe(self) -> str:
        m, t = self.cfg.model, self.cfg.train
        T = t.sequence_length(m)
        accum = dist.accumulation(t.tokens_per_step, t.batch_size, T, self.processes)
        tokens = t.batch_size * T * accum * self.processes
        ranks = f" x {self.processes} processes" if self.processes > 1 else ""
        each = " each" if self.processes > 1 else ""
        asked = f" (train.device {self.requested})" if self.requested != self.device else ""
        memory = self.memory_verdict + (f", on each of the {self.processes} processes" if self.processes > 1 else "")
        rows = [
            ("model", f"{self.cfg.name}: {describe_model(m)}"),
            ("parameters", f"{self.memory.parameters:,}"),
            ("device", f"{self.device}{asked} ({describe_precision(t)})"
                       + (f": {self.device_note}" if self.device_note else "")),
            ("memory", memory),
            ("tokens/step", f"{tokens:,} (batch {t.batch_size} x {T} tokens x {accum} micro-batch"
                            f"{'es' if accum != 1 else ''}{each}{ranks})"),
            ("schedule", make_schedule(t).describe()),
            ("data", self.data),
            ("output", str(self.out_dir)),
        ]
        return "\n".join(f"{k:<12}{v}" for k, v in rows)


def describe_precision(t) -> str:
    """train.dtype and train.precision as the plan says them: "float32", "float64", or bf16's three types."""
    if t.precision == "float32":
        return t.dtype
    policy = get_policy(t.precision)
    return (f"{policy.name}: {policy.master} master weights, gradients and AdamW state, {policy.compute} "
            f"weights and activations, sums in {policy.accumulate}")


def describe_model(m) -> str:
    return (f"{m.n_layer} block{'s' if m.n_layer != 1 else ''}, d_model {m.d_model}, {m.n_head} head"
            f"{'s' if m.n_head != 1 else ''}, context {m.context_length}, vocab {m.vocab_size}")


def check(cfg, out_dir, processes=1, init_from=None, warn=None, tokenizer=None, corpus=True) -> Plan:
    """Everything that can be checked before data preparation and model allocation; see the module doc.

    Run on every one of `processes` ranks alike (andrea.train), with and without --dry-run; `tokenizer`
    is the one the run prepares with (data_request), and `corpus` False skips the checks of the
    preparation (listing the corpus: rank 0's, which alone prepares)."""
    t = cfg.train
    requested = train_device(t.device)
    device, device_note = probe_device(requested)
    check_directory(out_dir, "--out")
    data_dir = cfg.data.resolved_dir()
    check_directory(data_dir, "data.data_dir", writable=prepared_counts(data_dir) is None)
    check_step_shape(cfg, processes)
    if init_from:
        check_init_from(init_from, cfg)
    if t.warmup_steps > t.max_steps:
        # refusing would break quick runs (`--max-steps 10` on a config warming up for 50): say what happens
        peak = t.lr * t.max_steps / t.warmup_steps
        (warn or files.warn)(f"train.warmup_steps ({t.warmup_steps}) exceeds train.max_steps ({t.max_steps}): the "
                        f"warmup's rate rises to {peak:.2e} at the last step and never reaches train.lr "
                        f"({t.lr:g}); --set train.warmup_steps={t.max_steps // 10} gives warmup then decay")
    check_sinks(t.log_to, out_dir)  # each named once, its library, its folder: before anything is written
    if t.sample_tokens > 0 and not t.sample_prompt:
        raise UserError("train.sample_prompt is empty: give at least one character, or set train.sample_tokens=0")
    if device == "cpu":  # bf16 needs a GPU: refused here, before anything is written
        try:
            for_arrays(t.precision, np)
        except ValueError as e:
            raise UserError(str(e)) from None
    mem = estimate_memory(cfg, processes)
    verdict = check_memory(mem, memory_device(device), warn)  # device is probed already: cpu or gpu
    data = check_preparation(cfg, tokenizer) if corpus else _prepared_line(cfg, data_dir)
    return Plan(cfg, Path(out_dir), requested, device, mem, verdict, data, processes, device_note)


def check_step_shape(cfg, processes: int) -> None:
    """A step the launched processes can share, of token ids the token files can hold."""
    m, t = cfg.model, cfg.train
    if m.vocab_size > MAX_VOCAB:
        raise UserError(f"model.vocab_size {m.vocab_size} is more than the token files hold (uint16 ids: at most "
                        f"{MAX_VOCAB}): --set model.vocab_size={MAX_VOCAB} or less")
    dist.accumulation(t.tokens_per_step, t.batch_size, t.sequence_length(m), processes)


def check_init_from(directory, cfg) -> None:
    """--init-from's config was read with the run config; its weights are checked as loading them
    checks them (hf.read_state, which the run's hf.load_weights calls): files, headers, names,
    shapes against the model config, finite values."""
    from andrea.interop import hf
    from andrea.model.sizes import param_shapes

    hf.read_state(Path(directory), param_shapes(cfg.model))


def data_request(cfg, tokenizer=None) -> dict:
    """The arguments of the run's preparation (andrea.data.preparation's prepare and check_preparation alike)."""
    return {"inputs": cfg.data.inputs or None, "data_dir": cfg.data.resolved_dir(), "vocab_size": cfg.model.vocab_size,
            "val_fraction": cfg.data.val_fraction, "allow_smaller_vocab": cfg.data.allow_smaller_vocab,
            "tokenizer": tokenizer, "text_field": cfg.data.text_field or None}


def check_preparation(cfg, tokenizer=None) -> str:
    """The run's preparation checked as `prepare` checks it before writing, reading only; then, for a
    prepared directory, the model's vocabulary and both splits. The plan's data line."""
    from andrea.data.preparation import check_preparation as check_request

    request = data_request(cfg, tokenizer)
    try:
        plan = check_request(**request)
    except UserError as e:
        raise UserError(in_train_terms(str(e))) from e
    data_dir = request["data_dir"]
    if plan.done is None:
        source = " ".join(cfg.data.inputs) if cfg.data.inputs else "the Python standard library"
        return (f"{data_dir} not prepared yet: the run prepares it from {source} first ({len(plan.corpus.files):,} "
                f"files, {plan.sizes.sum() / 1e6:.1f} MB)")
    fit_vocabulary(copy.deepcopy(cfg), load_tokenizer(Path(data_dir) / "tokenizer.json"), data_dir)
    return _prepared_line(cfg, data_dir)


def _prepared_line(cfg, data_dir) -> str:
    counts = prepared_counts(data_dir)
    if counts is None:
        return f"{data_dir} not prepared yet: the run prepares it first"
    check_data(cfg, *counts, data_dir)
    return f"{data_dir}: {counts[0]:,} train tokens, {counts[1]:,} val tokens"


def fit_vocabulary(cfg, tokenizer, data_dir, note=lambda msg: None) -> None:
    """model.vocab_size against the tokenizer's ids. Smaller cannot embed them. Larger is a padded
    vocabulary when the tokenizer came with the model (a Hugging Face one, --init-from's: GPT-2-class
    checkpoints round their embedding up, and transformers' from_pretrained loads them as they are;
    the extra ids never occur in the data and are never sampled); with andrea's own tokenizer, it
    means the corpus gave fewer ids than asked for, which data.allow_smaller_vocab accepts."""
    n, m = tokenizer.vocab_size, cfg.model.vocab_size
    if cfg.data.allow_smaller_vocab and n < m and isinstance(tokenizer, Tokenizer):
        note(f"note: the corpus gave a tokenizer of {n} ids; model.vocab_size set to match")
        cfg.model.vocab_size = m = n
    if n < m and not isinstance(tokenizer, Tokenizer):
        note(f"note: model.vocab_size {m} pads the tokenizer's {n} ids (ids {n}..{m - 1} are never in the data "
             "and never sampled)")
    elif n != m:
        raise UserError(f"the tokenizer in {data_dir} has {n} ids but model.vocab_size is {m}: set "
                        f"model.vocab_size={n} or prepare again")


def check_prompt(tokenizer, cfg) -> None:
    """After the tokenizer exists: the sample prompt must encode to at least one token."""
    t = cfg.train
    if t.sample_tokens > 0:
        try:
            ids = tokenizer.encode(t.sample_prompt)
        except UserError as e:
            raise UserError(f"train.sample_prompt cannot be encoded: {e}") from e
        if not ids:
            raise UserError("train.sample_prompt encodes to no tokens: give at least one character")


# prepare's flags, as a `train` user sets the same thing
_TRAIN_TERMS = {
    "python -m andrea.prepare --allow-smaller-vocab": "--set data.allow_smaller_vocab=true",
    "--allow-smaller-vocab": "--set data.allow_smaller_vocab=true",
    "--vocab-size": "--set model.vocab_size",
    "--val-fraction": "--set data.val_fraction",
    "--data-dir": "--set data.data_dir",
    "--text-field": "--set data.text_field",
    "--input": "--set data.inputs",
    "pass --force": "run python -m andrea.prepare --force with the same inputs and --data-dir",
}


def in_train_terms(message: str) -> str:
    """A message of andrea.prepare reworded with the keys `python -m andrea.train` takes."""
    for flag, key in _TRAIN_TERMS.items():
        message = message.replace(flag, key)
    return message
