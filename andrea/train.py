"""Train an ANDREA model: `python -m andrea.train` (no arguments: the tiny model on the Python stdlib).

    python -m andrea.train                                   # prepare data if missing, train, sample
    python -m andrea.train --config small --out runs/small --set train.lr=1e-3
    python -m andrea.train --out runs/small --resume         # continue from the newest good checkpoint
    python -m andrea.train --config 120m --dry-run           # the pre-flight checks and the plan, no training

A run goes through phases, each a function below, read top to bottom in `run_training`: the
checks (andrea.run.preflight: device, paths, step shape, --init-from's weights, memory, data; the same
with and without --dry-run, on every rank, after the ranks have compared their arguments), the
run directory, the data, the model, the state (a checkpoint's or a fresh one), the loop, the end
(the last save checked, the plot, the summary, a sample).

The loop (`Trainer.run`), per optimizer step: accumulate gradients over micro-batches, check the
loss and gradient norm are finite (NonFiniteGuard: a non-finite step applies no update, too many
in a row end the run), clip by global norm, set the learning rate (warmup then cosine) and take
an AdamW step; log a line every log_interval steps and evaluate every eval_interval (Throughput:
tokens/s, MFU and the ETA from the time of training steps alone); vote on stopping (StopVote:
Ctrl-C or SIGTERM on any rank stops all after the same step); write a crash-safe checkpoint
(weights, optimizer moments, data-loader and random states, config) every checkpoint_interval
steps, at the end and when stopping, and say how to resume. andrea.run.rundir claims --out for this
run alone (a marker of what wrote it, a lock held until the run ends); andrea.run.runlog keeps it to
one story (metrics that survive a full disk, each step once after a resume, exit code 4 when the
last save failed).

Under mpiexec (`mpiexec -n N python -m mpi4py -m andrea.train ...`) each of the N processes takes
its share of every step's windows and the gradients are summed across them once per step (see
andrea.run.distributed); rank 0 alone prints, writes metrics, checkpoints and samples.
"""

import hashlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from andrea.cli import ArgumentParser, run_cli
from andrea.config import load_config, make_config, saved_model_config
from andrea.data import dataset as data
from andrea.data import lock
from andrea.errors import UserError
from andrea.interop import hf
from andrea.interop.hf import load_tokenizer
from andrea.model.optim import AdamW
from andrea.model.transformer import ANDREA, flops_per_token, format_breakdown
from andrea.plot import plot_after_training
from andrea.prepare import prepare
from andrea.run import checkpoint as ckpt
from andrea.run import distributed as dist
from andrea.run import gradflow, preflight, rundir, runlog
from andrea.run.perf import format_duration, matmul_peak_flops, peak_label, synchronize
from andrea.sample import stream
from minitensor.device import GPUUnavailable, quiet_fallback, set_tf32
from minitensor.memory import keep_freed_memory
from minitensor.optim import cosine_lr

EXIT_INTERRUPTED = 130
EXIT_NONFINITE = 3


WORLD = dist.Single()  # replaced by main() under mpiexec


def log(msg):
    if WORLD.is_main:
        print(msg, flush=True)


def note(msg):
    if WORLD.is_main:
        print(msg, file=sys.stderr, flush=True)


class Trainer:
    """One training run: the model, optimizer, data and bookkeeping, checkpointable as a whole."""

    def __init__(self, cfg, out_dir, tokens, val_tokens, tokenizer, world=None):
        self.cfg, self.out_dir = cfg, Path(out_dir)
        self.world = world = world or dist.Single()
        t = cfg.train
        device = preflight.train_device(t.device)  # "auto" lets $ANDREA_DEVICE decide
        if device != "cpu":
            dist.use_local_gpu(world)
        try:
            self.model = ANDREA(cfg.model, device=device, dtype=t.dtype, seed=t.seed, kernels=t.kernels)
        except GPUUnavailable as e:
            raise UserError(str(e)) from e
        # the GPU's TF32 mode (process-wide) and the model's kernels, said in the log
        self.startup = [set_tf32(self.model.xp, t.tf32), kernels_line(self.model.ops)]
        self.opt = AdamW(self.model, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay)
        self.T = t.sequence_length(cfg.model)
        self.accum = dist.accumulation(t.tokens_per_step, t.batch_size, self.T, world.size)
        self.loader = data.BatchLoader(tokens, t.batch_size, self.T, seed=t.seed,
                                       accum=self.accum, rank=world.rank, world=world.size)
        # NCCL's set-up is a collective, which must not run inside a `together` block (a rank that
        # failed before it would meet the others in another collective): run_training connects it
        self.reducer = world.reducer_for(self.model.xp) if world.size == 1 or self.model.xp is np else None
        if self.reducer is None:
            dist.require_nccl()
        self.val_tokens, self.tokenizer = val_tokens, tokenizer
        self.step = 0
        self.guard = NonFiniteGuard(t.max_bad_steps)
        self.last_checkpoint = None
        self.last_loss, self.last_val = None, None  # the last step's loss, the last (step, val loss, val bpb)
        self.tokens_per_step = t.batch_size * self.T * self.accum * world.size
        self.flops_per_step = flops_per_token(cfg.model, self.T, self.model.num_parameters()) * self.tokens_per_step

    # --- checkpoints ---

    def state(self):
        # views into the flat buffers, not copies: a checkpoint of ANDREA-120M would otherwise
        # hold a second 370 MB of weights in memory while it is written
        tensors = {name: _host(view) for name, view in self.model.named_parameters()}
        tensors["optimizer.m"] = _host(self.opt.m)
        tensors["optimizer.v"] = _host(self.opt.v)
        meta = {
            "config": self.cfg.to_dict(),
            "step": self.step,
            "optimizer_t": self.opt.t,
            "loader": self.loader.state_dict(),
            "processes": self.world.size,
            "bad_steps_total": self.guard.total,
            "tokenizer_fingerprint": self.tokenizer.fingerprint(),
            "numpy_random_state": _json_rng_state(),
        }
        return tensors, meta

    def save(self):
        tensors, meta = self.state()
        path = ckpt.save_checkpoint(self.out_dir, self.step, tensors, meta, keep_last=self.cfg.train.keep_last)
        self.last_checkpoint = path
        return path

    def validate_checkpoint(self, tensors, meta):
        """Refuses a checkpoint this run cannot continue from exactly (raises CheckpointError)."""
        saved_model = meta.get("config", {}).get("model")
        try:  # as this andrea builds it: the keys of older runs filled in, the derived values derived again
            saved_model = saved_model_config(saved_model) if isinstance(saved_model, dict) else None
        except UserError as e:
            raise ckpt.CheckpointError(f"its model config is not one this andrea reads: {e}") from None
        current = self.cfg.to_dict()["model"]
        if saved_model != current:
            diff = sorted(k for k in current if saved_model is None or saved_model.get(k) != current[k])
            raise ckpt.CheckpointError(f"its model config differs from this run's in {', '.join(diff)}")
        if meta.get("tokenizer_fingerprint") != self.tokenizer.fingerprint():
            raise ckpt.CheckpointError("it was trained with a different tokenizer")
        if tensors.get("optimizer.m") is None or tensors["optimizer.m"].shape != self.opt.m.shape:
            raise ckpt.CheckpointError("its optimizer state does not fit this model")

    def restore(self, tensors, meta):
        self.model.load_state_dict({k: v for k, v in tensors.items() if k.startswith("transformer.")})
        self.opt.load_state_dict({"m": tensors["optimizer.m"], "v": tensors["optimizer.v"], "t": meta["optimizer_t"]})
        self.restore_meta(meta)

    def restore_meta(self, meta):
        """The non-tensor state; the ranks that did not read the checkpoint get the tensors by broadcast."""
        self.opt.t = meta["optimizer_t"]
        self.loader.load_state_dict(meta["loader"])
        self.step = int(meta["step"])
        self.guard.total = int(meta.get("bad_steps_total", 0))
        _set_json_rng_state(meta.get("numpy_random_state"))

    # --- one step ---

    def train_step(self, lr):
        """Forward/backward over the micro-batches and one AdamW step; returns (loss, grad_norm, applied),
        loss and grad_norm as values on the model's device (read them to log, not every step).

        On a GPU nothing here waits for the device but one read: whether the loss and the gradient
        norm are finite, which decides whether the step is applied (the non-finite guard). The loss
        adds up on the device, and the clipping scale goes to AdamW as a device array."""
        model = self.model
        model.zero_grad()
        total = 0.0
        micro_batches = self.accum * self.world.size
        for _ in range(self.accum):
            x, y = self.loader.next_batch()
            total = total + model.loss(x, y)
            model.backward(1.0 / micro_batches)  # so that the sum over ranks is the mean
        self.reducer.sum_(model.params.grads)  # the step's one gradient collective
        if self.world.size > 1:  # the ranks' losses summed on the host: a second read, with several processes
            total = self.world.sum_scalars([float(total)])[0]
        loss = total / micro_batches
        norm = model.ops.global_norm(model.params.grads)  # of the summed buffer: the same on every rank
        scale, finite = model.ops.clip_scale(norm, self.cfg.train.grad_clip, loss)
        if not bool(finite):  # the step's one host read
            return loss, norm, False
        self.opt.step(lr=lr, grad_scale=scale)
        return loss, norm, True

    def evaluate(self):
        """(mean validation loss in nats per token, bits per byte of the same targets): the batches'
        losses add up on the device, read once at the end. Bits per byte = the targets' nats over
        ln 2 x their bytes of text (EOT none), counted on the host from the tokenizer's byte table;
        the eval batches are all the same size, so the batch mean x targets is their nats."""
        t = self.cfg.train
        w = self.world
        total, n, targets, text_bytes = 0.0, 0, 0, 0
        lengths = self.tokenizer.text_bytes()
        for x, y in data.iter_eval_batches(self.val_tokens, t.batch_size, self.T, t.eval_batches, w.rank, w.size):
            total, n = total + self.model.loss(x, y), n + 1
            targets, text_bytes = targets + y.size, text_bytes + int(lengths[y].sum())
        if w.size > 1:
            total, n, targets, text_bytes = w.sum_scalars([float(total), n, targets, text_bytes])
        val = float(total / n) if n else math.nan
        return val, val * targets / (math.log(2) * text_bytes) if text_bytes else math.nan

    # --- the loop ---

    def run(self, stop_at_step=None):
        """Trains to max_steps (or stop_at_step); returns the exit code."""
        t = self.cfg.train
        # a failed write (full disk) warns and training goes on
        path = self.out_dir / "metrics.jsonl" if self.world.is_main else os.devnull
        with runlog.MetricsFile(path) as self.metrics, StopVote(self.world, self) as vote:
            meter = self.meter = self._throughput_meter()
            while self.step < t.max_steps:
                # the step: forward and backward over the micro-batches, one AdamW update
                lr = cosine_lr(self.step, t.lr, t.min_lr, t.warmup_steps, t.max_steps)
                meter.start()
                with gradflow.recording(self.model, self.step + 1, t) as flow:  # None unless a logged step
                    loss, norm, applied = self.train_step(lr)
                self.step += 1
                self.last_loss = loss
                meter.step_done()
                # the non-finite guard: a skipped update is counted; too many in a row end the run
                if not self.guard.record(applied, self.step, loss, norm, self.metrics):
                    note(self.guard.stop_message(self.step, self.last_checkpoint, self.out_dir))
                    return EXIT_NONFINITE
                # the log line and the evaluation, each on its own interval
                self._log_and_evaluate(lr, loss, norm, meter, flow)
                # the stop vote: a signal on any rank stops every rank after this same step
                stopping = vote.agreed() or self.step == stop_at_step
                # the checkpoint: on its interval, at the end, and when stopping
                if (self.step % t.checkpoint_interval == 0 or self.step == t.max_steps or stopping) \
                        and self.world.is_main:
                    meter.stop()  # a save is not training time
                    self._checkpoint_or_warn()
                if stopping:
                    return self._stopped(vote.signal)
        return 0

    def _throughput_meter(self):
        # CPU: the best of 5 2048^3 products (a single one can come out low on a shared VM,
        # BENCHMARKS.md, which would inflate MFU). GPU: 8192^3 products in a loop timed with events, after
        # set_tf32, so the peak is the one of the GEMM mode the run uses. Only rank 0 logs MFU, of
        # the global FLOP/s against N times its own peak. A peak measured while other work loaded
        # the machine comes out low (MFU then read over 100%): the meter measures it again when a
        # window's steps beat it (Throughput.window).
        xp, world = self.model.xp, self.world
        name = peak_label(xp, self.cfg.train.tf32)
        if world.size > 1:
            name = f"{world.size} x {name}"

        def measure(fresh=False):
            n = {"n": 2048, "repeats": 5} if xp is np else {}
            return matmul_peak_flops(xp, fresh=fresh, **n) * world.size

        def measure_again(beaten, peak):
            fresh = measure(fresh=True)
            log(f"note: the steps since the last line ran at {beaten / 1e12:.3g} TFLOP/s, above the peak of "
                f"{peak / 1e12:.3g} measured so far (a busy machine measures it low); measured again: "
                f"{fresh / 1e12:.3g} TFLOP/s. MFU is now against the highest of the measurements and the rates run")
            return fresh

        if not world.is_main:  # its MFU is never logged
            return Throughput(xp, self.tokens_per_step, self.flops_per_step, 1.0, name)
        peak = measure()
        log(f"MFU is against the {name}: {peak / 1e12:.2f} TFLOP/s measured here (measured again when steps beat it)")
        return Throughput(xp, self.tokens_per_step, self.flops_per_step, peak, name, measure_again)

    def _log_and_evaluate(self, lr, loss, norm, meter, flow=None):
        t = self.cfg.train
        record = None
        logging = self.step % t.log_interval == 0 or self.step == 1 or self.step == t.max_steps
        if logging or self.step % t.eval_interval == 0:
            loss, norm = float(loss), float(norm)  # the reads wait for the step to finish
        if logging:
            tps, mfu = meter.window()
            eta = meter.eta(t.max_steps - self.step)
            when = f"ETA {format_duration(eta)}" if eta is not None else "first step: start-up included, not in the ETA"
            record = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tps, "mfu": mfu}
            log(f"step {self.step:>6}/{t.max_steps} | loss {loss:.4f} | lr {lr:.2e} | grad norm {norm:.3f}"
                f" | {tps:,.0f} tok/s | MFU {100 * mfu:.1f}% of {meter.peak_name} | {when}")
        if self.step % t.eval_interval == 0 or self.step == t.max_steps:
            meter.stop()  # evaluation time is not training throughput
            val, bpb = self.evaluate()
            self.last_val = (self.step, val, bpb)
            record = record or {"step": self.step, "loss": loss, "lr": lr, "grad_norm": norm}
            record["val_loss"], record["val_bpb"] = val, bpb
            log(f"step {self.step:>6}: val loss {val:.4f} ({bpb:.4f} bits/byte)")
        if record and flow:
            record["grad_flow"] = flow.as_dict()
        if record:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()

    def _checkpoint_or_warn(self):
        try:
            path = self.save()
            log(f"step {self.step:>6}: saved checkpoint {path}")
        except ckpt.CheckpointError as e:  # e.g. a full disk: keep training, the previous one is intact
            note(f"warning: {e}")

    def _stopped(self, signum):
        launcher = f"mpiexec -n {self.world.size} python -m mpi4py" if self.world.size > 1 else "python"
        resume = f"{launcher} -m andrea.train --out {self.out_dir} --resume"
        if signum:
            note(f"interrupted at step {self.step}; checkpoint in {self.out_dir}. Resume with: {resume}")
            return EXIT_INTERRUPTED
        log(f"stopped at step {self.step} (--stop-at-step); resume with: {resume}")
        return 0


class Throughput:
    """Tokens/s, MFU and the ETA, from the time of training steps alone.

    The clock runs while steps run and stops (once the device has finished its queued work) for
    everything else: the log line, evaluation, checkpoints. Two tallies read it: the window since
    the last log line (the figures logged) and this run's steps after its first (the ETA and the
    end-of-run rate): a process's first step also compiles kernels and warms caches, far longer with
    a cold numba cache than the steps after it (BENCHMARKS.md, "The CPU kernels").

    MFU is against `peak`, the matmul peak measured at start. A window whose steps ran faster than
    it shows that measurement was low (a machine busy with other work at that moment):
    `measure_again(achieved, peak)` then measures it afresh, and the peak becomes the highest of
    every measurement and every rate achieved (the device did run that fast), so MFU stays a share
    of what this device demonstrably does, at most 100%."""

    def __init__(self, xp, tokens_per_step, flops_per_step, peak, peak_name, measure_again=None):
        self.xp, self.tokens_per_step, self.flops_per_step = xp, tokens_per_step, flops_per_step
        self.peak, self.peak_name, self.measure_again = peak, peak_name, measure_again
        self.first_step_s = None                  # this run's first step, start-up included
        self.run_steps, self.run_s = 0, 0.0       # the steps after it
        self.window_steps, self.window_s = 0, 0.0
        self._steps, self._since = 0, None        # since the clock last started

    def start(self):
        if self._since is None:
            self._since = time.perf_counter()

    def step_done(self):
        self._steps += 1
        if self.first_step_s is None:
            self.stop()  # the first step is timed alone

    def stop(self):
        if self._since is None:
            return
        synchronize(self.xp)
        seconds = time.perf_counter() - self._since
        if self.first_step_s is None:
            self.first_step_s = seconds
        else:
            self.run_steps, self.run_s = self.run_steps + self._steps, self.run_s + seconds
        self.window_steps, self.window_s = self.window_steps + self._steps, self.window_s + seconds
        self._steps, self._since = 0, None

    def window(self):
        """(tokens/s, MFU) of the steps since the last call (the clock is stopped first)."""
        self.stop()
        seconds = max(self.window_s, 1e-9)
        tps = self.window_steps * self.tokens_per_step / seconds
        achieved = self.window_steps * self.flops_per_step / seconds
        if self.measure_again is not None and achieved > self.peak:  # the clock is stopped meanwhile
            self.peak = max(self.peak, self.measure_again(achieved, self.peak), achieved)
        self.window_steps, self.window_s = 0, 0.0
        return tps, achieved / self.peak

    def eta(self, steps_left):
        """Seconds for `steps_left` more steps at this run's pace after its first step; None before
        a later step has been timed."""
        return self.run_s / self.run_steps * steps_left if self.run_steps else None

    def run_rate(self):
        """(tokens/s, seconds, steps) of this run's training steps after the first (the first alone
        when it is the only one)."""
        if self.run_steps:
            return self.run_steps * self.tokens_per_step / self.run_s, self.run_s, self.run_steps
        if self.first_step_s:
            return self.tokens_per_step / self.first_step_s, self.first_step_s, 1
        return 0.0, 0.0, 0


class NonFiniteGuard:
    """Steps whose loss or gradient norm is not finite apply no update (train_step skips it); this
    counts them, logs each, and says when max_bad_steps in a row should end the run."""

    def __init__(self, max_in_a_row, total=0):
        self.max_in_a_row, self.in_a_row, self.total = max_in_a_row, 0, total

    def record(self, applied, step, loss, norm, metrics):
        """False when the run must stop (max_in_a_row skipped steps in a row)."""
        if applied:
            self.in_a_row = 0
            return True
        loss, norm = float(loss), float(norm)
        self.in_a_row += 1
        self.total += 1
        metrics.write(json.dumps({"step": step, "loss": _num(loss), "grad_norm": _num(norm), "skipped": True}) + "\n")
        note(f"warning: step {step}: non-finite loss {loss} or gradient norm {norm}; update skipped "
             f"({self.in_a_row} in a row, {self.total} in total)")
        return self.in_a_row < self.max_in_a_row

    def stop_message(self, step, last_checkpoint, out_dir):
        good = last_checkpoint or (ckpt.list_checkpoints(out_dir) or [None])[0]
        return (f"error: training stopped at step {step} after {self.in_a_row} non-finite steps in a row; last "
                f"good checkpoint: {good or 'none'}. Lower train.lr or check the data, then resume with --resume")


class StopVote:
    """Ctrl-C or SIGTERM on any rank stops every rank after the same step, which is then saved.

    A context manager: its signal handlers hold for the run and the previous ones come back after.
    `agreed()` is the vote, a collective every rank calls once per step. A second Ctrl-C stops at
    once (checkpoints are atomic, so that loses nothing saved)."""

    def __init__(self, world, trainer):
        self.world, self.trainer = world, trainer
        self.signal = None  # the signal that stops this run, this rank's or another's
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame):
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum
        note(f"\n{signal.Signals(signum).name} received: finishing step {self.trainer.step + 1}, then saving a "
             "checkpoint (press Ctrl-C again to stop at once)")

    def agreed(self):
        """True when a signal reached any rank. The agreed value goes into a local first: assigning
        it to self.signal would erase a signal whose handler ran while max_int was under way (it is
        picked up after the next step instead)."""
        signalled = self.world.max_int(self.signal or 0)
        if signalled and self.signal is None:
            self.signal = signalled  # another rank's
        return bool(signalled)


def _host(a):
    return a.get() if hasattr(a, "get") else a


def _num(x):
    return x if math.isfinite(x) else str(x)


def _json_rng_state():
    """NumPy's legacy global RNG (used by nothing here, but by user code in hooks), as JSON."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}


def _set_json_rng_state(s):
    if s:
        np.random.set_state((s["name"], np.array(s["keys"], dtype=np.uint32), s["pos"], s["has_gauss"], s["cached"]))


def kernels_line(ops):
    """The start-up line that says which kernels the steps run, as the backend names them (on a GPU:
    the CUDA kernels chosen by their self-check, train.kernels). numba's CPU kernels compile during
    the first step unless numba's disk cache holds them, so the line says why that step is slow."""
    if getattr(ops, "numba", False):
        return ops.kernels_line + ("; the first step compiles them (tens of seconds) unless numba's cache "
                                   "already holds them")
    return ops.kernels_line


def prepare_data(cfg, build=True, tokenizer=None):
    """Tokens and tokenizer for the config's corpus, preparing them first if they are missing (build).

    `tokenizer` (a path) is the one to encode with instead of training one (--init-from's).
    """
    data_dir = cfg.data.resolved_dir()
    if preflight.prepared_counts(data_dir) is None:
        note(f"first run on this corpus: preparing {data_dir} (tokenizer and token files; later runs reuse it)")
    # prepare() returns at once when data_dir already holds this corpus, and refuses another one
    if build:
        try:
            prepare(**preflight.data_request(cfg, tokenizer), progress=True)
        except UserError as e:
            raise UserError(preflight.in_train_terms(str(e))) from e
    with lock.reading(data_dir, note):  # one preparation's files, should another process prepare it now
        tokenizer = load_tokenizer(data_dir / "tokenizer.json")
        preflight.fit_vocabulary(cfg, tokenizer, data_dir, note)
        fp = tokenizer.fingerprint()
        # the token files hold the tokenizer's ids, which a padded model.vocab_size holds too
        train_tokens = data.open_split(data_dir, "train", tokenizer.vocab_size, fp)
        val_tokens = data.open_split(data_dir, "val", tokenizer.vocab_size, fp)
    return tokenizer, train_tokens, val_tokens


def parse_args(argv):
    ap = ArgumentParser(prog="python -m andrea.train", description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="tiny (default), small, 120m, or a .yaml path; with --resume the run's own "
                                     "config.json is used, and --config may only repeat it")
    ap.add_argument("--out", help="output directory (default: out/<config name>)")
    ap.add_argument("--max-steps", type=int, help="total optimizer steps (sets train.max_steps)")
    ap.add_argument("--stop-at-step", type=int,
                    help="stop after this step as an interruption would, schedule unchanged")
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], help="sets train.device")
    ap.add_argument("--seed", type=int, help="sets train.seed")
    ap.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint in --out")
    ap.add_argument("--init-from", metavar="DIR",
                    help="start from the weights, model config and tokenizer of a GPT-2 directory (save_pretrained's)")
    ap.add_argument("--overwrite", action="store_true", help="start afresh in an --out that holds another run, "
                                                            "deleting its checkpoints and metrics")
    ap.add_argument("--dry-run", action="store_true",
                    help="check everything (config, paths, device, memory, data), print the plan and exit")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config value, e.g. --set train.lr=1e-3 (repeatable)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return ap.parse_args(argv)


def build_run_config(args):
    if args.init_from and args.resume:
        raise UserError("--init-from starts a run from a GPT-2 directory and --resume continues one: give only one")
    overrides = list(args.set)
    for flag, key in ((args.max_steps, "train.max_steps"), (args.device, "train.device"), (args.seed, "train.seed")):
        if flag is not None:
            overrides.append(f"{key}={flag}")
    out_dir = Path(args.out) if args.out else None
    if args.resume:
        if args.overwrite:
            raise UserError("--resume continues the run in --out and --overwrite deletes it: choose one")
        if out_dir is None:
            out_dir = Path("out") / load_config(args.config or "tiny").name
        preflight.check_directory(out_dir, "--out")
        base = runlog.read_saved_config(out_dir)
        cfg = make_config(base, overrides, name=str(base.get("name", "custom")), source=str(out_dir / "config.json"))
        if args.config is not None:
            _refuse_another_config(args.config, overrides, cfg, out_dir)
    else:
        if args.init_from:
            cfg = hf.init_from_config(args.config or "tiny", args.init_from, overrides)
            cfg.name = f"{Path(args.init_from).resolve().name}-finetune"  # its model is not the config's
        else:
            cfg = load_config(args.config or "tiny", overrides)
        out_dir = out_dir or Path("out") / cfg.name
    if args.stop_at_step is not None and not 1 <= args.stop_at_step <= cfg.train.max_steps:
        raise UserError(f"--stop-at-step must be between 1 and train.max_steps ({cfg.train.max_steps})")
    return cfg, out_dir


def config_differences(name, overrides, cfg):
    """The keys ("train.lr", ...) in which config `name` with `overrides` differs from a run's saved
    config `cfg`, but for a model.vocab_size that data.allow_smaller_vocab lowered at the run's start."""
    given, saved = load_config(name, overrides).to_dict(), cfg.to_dict()
    diff = [f"{s}.{k}" for s in ("model", "train", "data") for k in saved[s] if given[s].get(k) != saved[s][k]]
    if given["data"]["allow_smaller_vocab"] and saved["model"]["vocab_size"] < given["model"]["vocab_size"]:
        diff.remove("model.vocab_size")  # lowered to the tokenizer's size when the run started
    return diff


def _refuse_another_config(name, overrides, cfg, out_dir):
    """--config with --resume may only name the run's own config: a different one would be ignored."""
    diff = config_differences(name, overrides, cfg)
    if diff:
        raise UserError(f"--config {name} differs from the config of the run in {out_dir} in {', '.join(diff[:4])}: "
                        "drop --config to resume that run (change values with --set), or start a new run "
                        "with another --out")


def _header(cfg, args, trainer, n_train, n_val, out_dir):
    """The run's first lines, from the effective config (overrides included), not the file's name."""
    m, t = cfg.model, cfg.train
    changed = [o for o in args.set if o.startswith("model.")]
    name = f"{cfg.name} with {', '.join(changed)}" if changed else cfg.name
    log(f"ANDREA {name} ({preflight.describe_model(m)}): {trainer.model.num_parameters():,} parameters on "
        f"{trainer.model.backend.device} ({t.dtype})\n{format_breakdown(m)}")
    for line in trainer.startup:
        log(line)
    micro = "micro-batch" if trainer.accum == 1 else "micro-batches"
    world = trainer.world
    ranks = f" x {world.size} processes ({trainer.reducer.name})" if world.size > 1 else ""
    log(f"batch {t.batch_size} x {trainer.T} tokens x {trainer.accum} {micro}{ranks} = "
        f"{trainer.tokens_per_step:,} tokens/step; {n_train:,} train tokens, {n_val:,} val tokens; output in {out_dir}")


def _quiet(msg):
    """Warnings of the pre-flight pass on ranks other than 0: rank 0 prints them once."""


def main(argv=None):
    keep_freed_memory()  # an entry point's choice: see minitensor/memory.py
    global WORLD
    WORLD = dist.init()
    quiet_fallback()  # the pre-flight pass says once, on rank 0, which device a run of "auto" gets
    with dist.guard(WORLD), rundir.released_at_end():  # --out stays claimed (locked) until the run ends
        return run_training(parse_args(argv), WORLD)


def run_training(args, world):
    """The whole run on one rank, phase by phase; every collective inside is issued by all ranks in
    this order.

    A `together` block holds no collective of its own, so a rank that fails in one meets the others
    in its agreement; an error anywhere else ends every rank through dist.guard.
    """
    # the checks: everything that can fail is checked before any work, with or without --dry-run
    cfg, out_dir, plan = check_launch(args, world)
    if args.dry_run:
        log(plan.describe())
        return 0
    if plan.device_note:
        note(f"note: {plan.device_note}")
    # the run directory: claimed for this run; what killed processes left in it is removed
    with world.together():
        if world.is_main:
            rundir.claim(out_dir, "run", args.resume, args.overwrite)
            runlog.remove_stale_temporaries(out_dir, cfg.data.resolved_dir())
    # the data: prepared once, by rank 0, while the others wait; then read by every rank
    tokenizer, train_tokens, val_tokens = load_data(cfg, args, world, out_dir)
    # the model, optimizer and data loader, on every rank
    trainer = build_trainer(cfg, out_dir, args, world, tokenizer, train_tokens, val_tokens)
    # the state: a checkpoint's (--resume), or rank 0's fresh weights on every rank
    if args.resume:
        if resume(trainer, args.stop_at_step) == "finished":
            return 0
    else:
        share_state(trainer)
    if world.is_main:
        (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        tokenizer.save(out_dir / "tokenizer.json")
    _header(cfg, args, trainer, len(train_tokens), len(val_tokens), out_dir)
    # the loop
    start_step, started = trainer.step, time.perf_counter()
    code = trainer.run(stop_at_step=args.stop_at_step)
    # the end: the last save checked, the plot, the summary and a sample
    return finish(trainer, code, start_step, time.perf_counter() - started)


def check_launch(args, world):
    """The run's config, output directory and plan, the same on every rank, or one error for all."""
    with world.together():
        cfg, out_dir = build_run_config(args)
    require_same_launch(world, args, cfg, out_dir)
    with world.together():
        if preflight.train_device(cfg.train.device) != "cpu":
            dist.use_local_gpu(world)  # before the probe touches a GPU
        plan = preflight.check(cfg, out_dir, world.size, args.init_from, warn=None if world.is_main else _quiet,
                               tokenizer=run_tokenizer(args, out_dir), corpus=world.is_main)
        rundir.check(out_dir, "run", args.resume, args.overwrite)  # another program's directory, a run in use
    gpus = int(world.sum_scalars([plan.device == "gpu"])[0])
    with world.together():
        if 0 < gpus < world.size:
            raise UserError(f"{gpus} of {world.size} processes found a GPU: choose --device cpu or gpu for all")
    return cfg, out_dir, plan


LAUNCH_FLAGS = ("resume", "overwrite", "dry_run", "init_from", "stop_at_step")


def require_same_launch(world, args, cfg, out_dir):
    """Ranks started with different arguments (an MPMD launch) would issue different collectives and
    wait for each other forever: each compares its configuration with rank 0's, and if any differs
    all stop with one error naming the first differing keys."""
    if world.size == 1:
        return
    mine = {f"{section}.{key}": value for section in ("model", "train", "data")
            for key, value in cfg.to_dict()[section].items()}
    mine.update({"--out": str(out_dir)}, **{"--" + f.replace("_", "-"): getattr(args, f) for f in LAUNCH_FLAGS})
    dist.require_same(world, mine, "this process was started with other arguments than rank 0",
                      "start every process with the same arguments")


def load_data(cfg, args, world, out_dir):
    """(tokenizer, train tokens, val tokens) on every rank: rank 0 prepares what is missing first."""
    with world.together():
        prepared = prepare_data(cfg, tokenizer=run_tokenizer(args, out_dir)) if world.is_main else None
    with world.together():
        tokenizer, train_tokens, val_tokens = prepared or prepare_data(cfg, build=False)
        preflight.check_data(cfg, len(train_tokens), len(val_tokens), cfg.data.resolved_dir())
        preflight.check_prompt(tokenizer, cfg)
    # the same data.data_dir on every rank may be other data on each (a node's own copy, another
    # working directory): a rank on another corpus or tokenizer would train the model without a word
    short = {"tokenizer fingerprint": tokenizer.fingerprint()[:16],
             "data fingerprint": data_fingerprint(cfg.data.resolved_dir(), train_tokens, val_tokens)[:16]}
    dist.require_same(world, short, "this process's data differs from rank 0's",
                      f"every process must read the same prepared data: give each a copy of rank 0's "
                      f"{cfg.data.resolved_dir()} (meta.json, the shards and tokenizer.json)")
    return tokenizer, train_tokens, val_tokens


def run_tokenizer(args, out_dir):
    """The tokenizer the run prepares its data with, if it must: --init-from's; a resumed run's own
    (should its data directory have to be prepared again); None: the directory's, or a new one."""
    own = out_dir / "tokenizer.json" if args.resume and (out_dir / "tokenizer.json").is_file() else None
    return args.init_from or own


def data_fingerprint(data_dir, train_tokens, val_tokens, ids=4096):
    """sha256 of what a rank trains on, cheaply: the manifest's shard table (names, token counts,
    largest ids, the tokenizer's fingerprint) and the first and last `ids` ids of every shard."""
    meta = data.read_data_meta(data_dir) or {}
    table = {k: meta.get(k) for k in ("shards", "train_tokens", "val_tokens", "tokenizer_fingerprint")}
    digest = hashlib.sha256(json.dumps(table, sort_keys=True).encode())
    for split in (train_tokens, val_tokens):
        for shard in split.shards:
            digest.update(np.ascontiguousarray(shard[:ids]).tobytes() + np.ascontiguousarray(shard[-ids:]).tobytes())
    return digest.hexdigest()


def build_trainer(cfg, out_dir, args, world, tokenizer, train_tokens, val_tokens):
    """The Trainer on every rank, its gradients summed over NCCL on GPUs (connected here, outside
    any `together` block: NCCL's set-up is a collective)."""
    with world.together():
        if world.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
        trainer = Trainer(cfg, out_dir, train_tokens, val_tokens, tokenizer, world)
        if args.init_from:
            hf.load_weights(trainer.model, args.init_from)
            log(f"initialised from {args.init_from}")
    if trainer.reducer is None:
        trainer.reducer = world.reducer_for(trainer.model.xp)  # NCCL: the unique id goes out over MPI
    if trainer.accum > 1 and world.is_main:
        trainer.loader = runlog.MicroBatchProgress(trainer.loader, trainer.accum)
    return trainer


def finish(trainer, code, start_step, seconds):
    """After the loop, on rank 0: the last save checked, the plot, the summary, a sample; the exit code."""
    t, out_dir = trainer.cfg.train, trainer.out_dir
    if not trainer.world.is_main:
        return code
    code = runlog.final_checkpoint_check(out_dir, trainer.step, trainer.last_checkpoint, code)
    if code == 0:
        log(plot_after_training(out_dir))
    if code in (0, EXIT_INTERRUPTED):
        loss = float(trainer.last_loss) if trainer.last_loss is not None else None
        log(runlog.summary(out_dir, trainer.step - start_step, trainer.step, seconds, trainer.meter.run_rate(),
                           loss, trainer.last_val, trainer.last_checkpoint, unigram_baseline(trainer.cfg)))
    if code == 0 and trainer.step >= t.max_steps and t.sample_tokens > 0:
        log(f"\nsample (temperature 0.8, top-k 50) from {t.sample_prompt!r}:\n" + "-" * 60)
        stream(trainer.model, trainer.tokenizer, t.sample_prompt, t.sample_tokens, 0.8, 50, seed=t.seed)
        log("-" * 60 + f"\nmore: python -m andrea.sample --checkpoint {out_dir} --prompt 'import '")
    return code


def unigram_baseline(cfg):
    """The validation tokens' unigram entropy in nats (the loss of predicting every token by its
    frequency in the training tokens) from the data directory's meta.json; None when it has none."""
    value = (data.read_data_meta(cfg.data.resolved_dir()) or {}).get("unigram_val_nats")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def resume(trainer, stop_at_step):
    """Rank 0 reads the newest good checkpoint; the others get it by broadcast (share_state).

    Returns "finished" when that checkpoint is already at train.max_steps (nothing to train)."""
    world, out_dir = trainer.world, trainer.out_dir
    with world.together():
        meta = None
        if world.is_main and not ckpt.list_checkpoints(out_dir):
            raise UserError(f"nothing to resume in {out_dir}: the run there stopped before its first checkpoint; "
                            f"start it afresh with --overwrite")
        if world.is_main:
            path, tensors, meta = ckpt.latest_checkpoint(out_dir, validate=trainer.validate_checkpoint)
            trainer.restore(tensors, meta)
            trainer.last_checkpoint = path
            meta = dict(meta, path=str(path))
    meta = world.broadcast_json(meta)
    with world.together():
        if not world.is_main:
            trainer.restore_meta(meta)
    if trainer.step >= trainer.cfg.train.max_steps:
        log(f"the run in {out_dir} has already finished: {meta['path']} is step {trainer.step} of "
            f"train.max_steps {trainer.cfg.train.max_steps}; nothing to do (to train longer: --resume --max-steps N)")
        return "finished"
    share_state(trainer)
    dropped = runlog.drop_rows_after(out_dir / "metrics.jsonl", trainer.step, meta["path"]) if world.is_main else 0
    log(f"resumed from {meta['path']} at step {trainer.step}"
        + (f"; dropped {dropped} metrics rows of later steps, which this run recomputes" if dropped else ""))
    saved = int(meta.get("processes", 1))
    if saved != world.size:
        log(f"note: the checkpoint was written by {saved} process(es), this run has {world.size}: same batches in "
            f"the same order, now {trainer.accum} micro-batch(es) per process; results match the other count "
            "to float32 summation order, not bit for bit")
    with world.together():
        if world.is_main and stop_at_step is not None and stop_at_step <= trainer.step:
            raise UserError(f"--stop-at-step {stop_at_step} is not after the resumed step {trainer.step}")


def share_state(trainer):
    """Rank 0's weights and optimizer moments on every rank (a no-op for one process)."""
    if trainer.world.size == 1:
        return
    for buf in (trainer.model.params.data, trainer.opt.m, trainer.opt.v):
        trainer.reducer.broadcast_(buf)


if __name__ == "__main__":
    run_cli(main)
