"""One training run on one rank: the model, optimizer, data loader and bookkeeping, checkpointable
as a whole (`Trainer`), and its loop.

The loop (`Trainer.run`), per optimizer step: accumulate gradients over micro-batches, check the
loss and gradient norm are finite (andrea.run.stopping.NonFiniteGuard: a non-finite step applies no
update, too many in a row end the run), clip by global norm, take the learning rate from the
schedule the Trainer is handed (andrea.run.schedule) and an AdamW step; log a line every
log_interval steps and evaluate every eval_interval (andrea.run.throughput.Throughput: tokens/s, MFU
and the ETA from the time of training steps alone); vote on stopping (StopVote: Ctrl-C or SIGTERM
on any rank stops all after the same step); write a crash-safe checkpoint (weights, optimizer
moments, data-loader and random states, config) every checkpoint_interval steps, at the end and when
stopping, and say how to resume.

Under mpiexec each rank takes its share of every step's windows and the gradients are summed across
ranks once per step (andrea.run.distributed), or with train.zero_stage 1 (ZeRO-1) reduce-scattered, each
rank updating its range of the weights and keeping the optimizer's state for it alone, and the weights
all-gathered; with train.overlap (the default) bucket by bucket during the last micro-batch's backward
(andrea.run.overlap). Rank 0 alone prints, writes metrics and checkpoints.

train.precision=bf16 (a GPU only) builds the model in bf16 (andrea.model.transformer): the loop is the
same, the loss, gradients, clipping norm, AdamW's state and the checkpoint's weights float32, and each
AdamW step writes the bfloat16 weights the layers read (minitensor.flat, Params.compute).
"""

import math
from pathlib import Path

import numpy as np

from andrea.config import saved_model_config
from andrea.data.loader import BatchLoader, iter_eval_batches
from andrea.errors import UserError
from andrea.interop import hf
from andrea.model.sizes import flops_per_token
from andrea.model.transformer import ANDREA
from andrea.run import checkpoint as ckpt
from andrea.run import distributed as dist
from andrea.run import gradflow, preflight
from andrea.run.metrics import open_metrics
from andrea.run.nccl import require_nccl
from andrea.run.overlap import GradientReduction
from andrea.run.perf import format_duration, matmul_peak_flops, peak_dtype, peak_label
from andrea.run.reducer import Shards
from andrea.run.schedule import make_schedule
from andrea.run.stopping import EXIT_INTERRUPTED, EXIT_NONFINITE, NonFiniteGuard, StopVote
from andrea.run.throughput import Throughput
from minitensor.device import GPUUnavailable, set_tf32, to_numpy
from minitensor.flat import ALIGN
from minitensor.optim import AdamW

# a checkpoint holds each of the optimizer's state tensors (AdamW.STATE) as optimizer.<name>, over the
# flat buffer's span (the same for any number of ranks, sharded or not), and its step count as
# meta["optimizer_t"]
OPTIMIZER_PREFIX = "optimizer."


class Trainer:
    """One training run: the model, optimizer, data and bookkeeping, checkpointable as a whole."""

    def __init__(self, cfg, out_dir, tokens, val_tokens, tokenizer, world=None, init_from=None, schedule=None,
                 kernels=None):
        """`init_from`: a GPT-2 directory (save_pretrained's) whose weights the model starts from;
        `schedule`: the learning rate of each step (andrea.run.schedule; default: the one cfg.train names);
        `kernels`: train.kernels as agreed by every rank (andrea.run.kernels.agreed_kernels; default: cfg.train.kernels)."""
        self.cfg, self.out_dir = cfg, Path(out_dir)
        self.schedule = schedule or make_schedule(cfg.train)
        self.world = world = world or dist.Single()
        t = cfg.train
        device = preflight.train_device(t.device)  # "auto" lets $ANDREA_DEVICE decide
        if device != "cpu":
            dist.use_local_gpu(world)
        try:
            # ZeRO-1 cuts the flat buffers into one equal, aligned range per rank: their size a multiple of 16 N
            self.model = ANDREA(cfg.model, device=device, dtype=t.dtype, seed=t.seed,
                                kernels=t.kernels if kernels is None else kernels, batch=t.batch_size,
                                flat_multiple=ALIGN * (world.size if t.zero_stage else 1), precision=t.precision)
        except GPUUnavailable as e:
            raise UserError(str(e)) from e
        # the GPU's TF32 mode (process-wide) and the model's kernels, said in the log
        self.startup = [set_tf32(self.model.xp, t.tf32), kernels_line(self.model.ops)]
        # ZeRO-1: each rank updates, and keeps the optimizer's state for, its range of the buffers alone
        self.shards = Shards(self.model.params.size, world.size) if t.zero_stage else None
        self.opt = AdamW(self.model, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay,
                         shard=self.shards.bounds(world.rank) if self.shards else None)
        self.T = t.sequence_length(cfg.model)
        self.accum = dist.accumulation(t.tokens_per_step, t.batch_size, self.T, world.size)
        self.loader = BatchLoader(tokens, t.batch_size, self.T, seed=t.seed,
                                  accum=self.accum, rank=world.rank, world=world.size)
        if t.check_collectives:  # from here on (the config is the same on every rank, so is this point)
            world.check_collectives()
        # NCCL's set-up is a collective, which must not run inside a `together` block (a rank that
        # failed before it would meet the others in another collective): run_training connects it
        self.reducer = world.reducer_for(self.model.xp) if world.size == 1 or self.model.xp is np else None
        if self.reducer is None:
            require_nccl()
        self.reduction = None  # the step's gradient reduction (andrea.run.overlap), once the reducer is there
        self.val_tokens, self.tokenizer = val_tokens, tokenizer
        self.step = 0
        self.guard = NonFiniteGuard(t.max_bad_steps, world)
        self.last_checkpoint = None
        self.last_loss, self.last_val = None, None  # the last step's loss, the last (step, val loss, val bpb)
        self.tokens_per_step = t.batch_size * self.T * self.accum * world.size
        self.flops_per_step = flops_per_token(cfg.model, self.T, self.model.num_parameters()) * self.tokens_per_step
        if init_from:
            hf.load_weights(self.model, init_from)

    # --- checkpoints ---

    def optimizer_state(self):
        """{name: the optimizer's state tensor over the flat buffer's span, on the host}: what a checkpoint
        holds. Replicated, the optimizer's own arrays; sharded (train.zero_stage 1), each gathered from
        every rank's range, one at a time, through one buffer: a collective, which every rank calls, and
        rank 0 alone keeps a copy (the others return None)."""
        span = self.model.params.span
        if self.shards is None:
            return {name: to_numpy(state)[:span] for name, state in self.opt.named_state().items()}
        start, stop = self.opt.shard
        whole, gathered = self.model.xp.zeros_like(self.model.params.grads), {}
        for name, state in self.opt.named_state().items():
            whole[start:stop] = state
            self.reducer.all_gather(whole, self.shards)
            if self.world.is_main:
                gathered[name] = np.array(to_numpy(whole[:span]))  # a copy: `whole` takes the next one
        return gathered if self.world.is_main else None

    def state(self, optimizer=None):
        """(tensors, meta) of a checkpoint, on rank 0; `optimizer`: what optimizer_state() gave it. Sharded,
        that is a collective every rank takes part in, so pass it: without it, state() gathers on this rank
        alone. The weights are the float32 masters under any train.precision (bf16's bfloat16 copy is
        rounded from them again on restore), so a checkpoint resumes in float32 or bf16 alike."""
        # views into the flat buffers, not copies: a checkpoint of ANDREA-120M would otherwise
        # hold a second 370 MB of weights in memory while it is written
        tensors = {name: to_numpy(view) for name, view in self.model.named_parameters()}
        for name, state in (optimizer or self.optimizer_state()).items():  # optimizer.m, optimizer.v
            tensors[OPTIMIZER_PREFIX + name] = state
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

    def save(self, optimizer=None):
        tensors, meta = self.state(optimizer)
        path = ckpt.save_checkpoint(self.out_dir, self.step, tensors, meta, keep_last=self.cfg.train.keep_last)
        self.last_checkpoint = path
        return path

    def validate_checkpoint(self, tensors, meta):
        """Refuses a checkpoint this run cannot continue from exactly (raises CheckpointError)."""
        saved_model = meta.get("config", {}).get("model")
        try:  # as this andrea builds it: the derived values derived again
            saved_model = saved_model_config(saved_model) if isinstance(saved_model, dict) else None
        except UserError as e:
            raise ckpt.CheckpointError(f"its model config is not one this andrea reads: {e}") from None
        current = self.cfg.to_dict()["model"]
        if saved_model != current:
            diff = sorted(k for k in current if saved_model is None or saved_model.get(k) != current[k])
            raise ckpt.CheckpointError(f"its model config differs from this run's in {', '.join(diff)}")
        if meta.get("tokenizer_fingerprint") != self.tokenizer.fingerprint():
            raise ckpt.CheckpointError("it was trained with a different tokenizer")
        for name in self.opt.STATE:
            saved = tensors.get(OPTIMIZER_PREFIX + name)
            if saved is None or saved.shape != (self.model.params.span,):
                raise ckpt.CheckpointError(f"its optimizer state ({OPTIMIZER_PREFIX}{name}) does not fit this model")

    def restore(self, tensors, meta):
        self.model.load_state_dict({k: v for k, v in tensors.items() if k.startswith("transformer.")})
        state = {name: tensors[OPTIMIZER_PREFIX + name] for name in self.opt.STATE}
        self.opt.load_state_dict({**state, "t": meta["optimizer_t"]})
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
        model, reduction = self.model, self.gradient_reduction()
        model.zero_grad()
        total = 0.0
        micro_batches = self.accum * self.world.size
        for k in range(self.accum):
            x, y = self.loader.next_batch()
            total = total + model.loss(x, y)
            # so that the sum over ranks is the mean; the last one's buckets start reducing as it completes them
            (reduction.backward if k == self.accum - 1 else model.backward)(1.0 / micro_batches)
        if self.cfg.train.zero_stage:
            return self._sharded_update(lr, total / micro_batches if self.world.size == 1 else
                                        self.world.sum_scalars([float(total)])[0] / micro_batches)
        reduction.finish()  # the step's gradient collective(s) complete
        if self.world.size > 1:  # the ranks' losses summed on the host: a second read, with several processes
            total = self.world.sum_scalars([float(total)])[0]
        loss = total / micro_batches
        norm = model.ops.global_norm(model.params.grads)  # of the summed buffer: the same on every rank
        scale, finite = model.ops.clip_scale(norm, self.cfg.train.grad_clip, loss)
        if not bool(finite):  # the step's one host read
            return loss, norm, False
        self.opt.step(lr=lr, grad_scale=scale)
        return loss, norm, True

    def gradient_reduction(self):
        """The step's GradientReduction (andrea.run.overlap): overlapped with the backward when there are
        several processes and train.overlap is on."""
        if self.reduction is None:
            self.reduction = GradientReduction(self.model, self.reducer, self.shards,
                                               overlap=self.world.size > 1 and self.cfg.train.overlap)
        return self.reduction

    def _sharded_update(self, lr, loss):
        """ZeRO-1's end of a step (train.zero_stage 1): the gradients reduce-scattered (each rank gets the
        sum of its range), the clipping norm from the ranges' squared norms all-reduced, AdamW over this
        rank's range, and the parameters all-gathered for the next forward. A skipped step changes no
        weights, so it gathers nothing."""
        model, shards = self.model, self.shards
        grads, xp = model.params.grads, model.xp
        self.gradient_reduction().finish()  # reduce-scattered: whole, or bucket by bucket during the backward
        start, stop = shards.bounds(self.world.rank)
        # in the norm's own dtype (float64 on NumPy), whose sqrt(x^2) is x: one rank's step is the replicated one
        squares = xp.asarray(model.ops.global_norm(grads[start:stop])).reshape(1) ** 2
        self.reducer.all_reduce(squares)  # the same sum on every rank, so the same decision
        norm = xp.sqrt(squares[0])
        scale, finite = model.ops.clip_scale(norm, self.cfg.train.grad_clip, loss)
        if not bool(finite):  # the step's one host read
            return loss, norm, False
        self.opt.step(lr=lr, grad_scale=scale)
        self.reducer.all_gather(model.params.data, shards)
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
        for x, y in iter_eval_batches(self.val_tokens, t.batch_size, self.T, t.eval_batches, w.rank, w.size):
            total, n = total + self.model.loss(x, y), n + 1
            targets, text_bytes = targets + y.size, text_bytes + int(lengths[y].sum())
        if w.size > 1:
            total, n, targets, text_bytes = w.sum_scalars([float(total), n, targets, text_bytes])
        val = float(total / n) if n else math.nan
        return val, val * targets / (math.log(2) * text_bytes) if text_bytes else math.nan

    # --- the loop ---

    def run(self, stop_at_step=None, sinks=None):
        """Trains to max_steps (or stop_at_step); returns the exit code. `sinks`: train.log_to's, opened
        already (andrea.run.metrics.open_sinks), or None to open them here."""
        t = self.cfg.train
        # rank 0 alone writes metrics; a failed write (full disk) warns and training goes on
        with open_metrics(self.out_dir, self.cfg, self.world, self.step, sinks) as self.metrics, \
                StopVote(self.world, self) as vote:
            meter = self.meter = self._throughput_meter()
            while self.step < t.max_steps:
                # the step: forward and backward over the micro-batches, one AdamW update
                lr = self.schedule.lr(self.step)
                meter.start()
                with gradflow.recording(self.model, self.step + 1, t) as flow:  # None unless a logged step
                    loss, norm, applied = self.train_step(lr)
                self.step += 1
                self.last_loss = loss
                meter.step_done()
                # the non-finite guard: a skipped update is counted; too many in a row end the run
                if not self.guard.record(applied, self.step, loss, norm, self.metrics):
                    self.world.note(self.guard.stop_message(self.step, self.last_checkpoint, self.out_dir))
                    return EXIT_NONFINITE
                # the log line and the evaluation, each on its own interval
                self._log_and_evaluate(lr, loss, norm, meter, flow)
                # the stop vote: a signal on any rank stops every rank after this same step
                stopping = vote.agreed() or self.step == stop_at_step
                # the checkpoint: on its interval, at the end, and when stopping
                if self.step % t.checkpoint_interval == 0 or self.step == t.max_steps or stopping:
                    meter.stop()  # a save is not training time
                    # sharded, the optimizer's state is gathered first, by every rank
                    optimizer = self.optimizer_state() if self.shards is not None else None
                    if self.world.is_main:
                        self._checkpoint_or_warn(optimizer)
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
        dtype = peak_dtype(self.cfg.train.precision)  # bf16: against the bf16 GEMMs' peak, which its steps use
        name = peak_label(xp, self.cfg.train.tf32, dtype)
        if world.size > 1:
            name = f"{world.size} x {name}"

        def measure(fresh=False):
            n = {"n": 2048, "repeats": 5} if xp is np else {}
            return matmul_peak_flops(xp, fresh=fresh, dtype=dtype, **n) * world.size

        def measure_again(beaten, peak):
            fresh = measure(fresh=True)
            # world, not self: the meter is the Trainer's, and a closure over the Trainer would make a
            # cycle that keeps the token files mapped until the garbage collector runs
            world.log(f"note: the steps since the last line ran at {beaten / 1e12:.3g} TFLOP/s, above the peak of "
                      f"{peak / 1e12:.3g} measured so far (a busy machine measures it low); measured again: "
                      f"{fresh / 1e12:.3g} TFLOP/s. MFU is now against the highest of the measurements and the "
                      "rates run")
            return fresh

        if not world.is_main:  # its MFU is never logged
            return Throughput(xp, self.tokens_per_step, self.flops_per_step, 1.0, name)
        peak = measure()
        self.world.log(f"MFU is against the {name}: {peak / 1e12:.2f} TFLOP/s measured here (measured again when "
                       "steps beat it)")
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
            waited = ""
            if self.world.size > 1:  # how long this step waited for its gradient reduction past the backward
                record["reduce_wait_s"] = self.reduction.waited_s
                waited = f" | reduce wait {1e3 * self.reduction.waited_s:.1f} ms"
            self.world.log(f"step {self.step:>6}/{t.max_steps} | loss {loss:.4f} | lr {lr:.2e} | grad norm {norm:.3f}"
                f" | {tps:,.0f} tok/s | MFU {100 * mfu:.1f}% of {meter.peak_name}{waited} | {when}")
        if self.step % t.eval_interval == 0 or self.step == t.max_steps:
            meter.stop()  # evaluation time is not training throughput
            val, bpb = self.evaluate()
            self.last_val = (self.step, val, bpb)
            record = record or {"step": self.step, "loss": loss, "lr": lr, "grad_norm": norm}
            record["val_loss"], record["val_bpb"] = val, bpb
            self.world.log(f"step {self.step:>6}: val loss {val:.4f} ({bpb:.4f} bits/byte)")
        if record and flow:
            record["grad_flow"] = flow.as_dict()
        if record:
            self.metrics.log(record)
            self.metrics.flush()

    def _checkpoint_or_warn(self, optimizer=None):
        try:
            path = self.save(optimizer)
            self.world.log(f"step {self.step:>6}: saved checkpoint {path}")
        except ckpt.CheckpointError as e:  # e.g. a full disk: keep training, the previous one is intact
            self.world.note(f"warning: {e}")

    def _stopped(self, signum):
        launcher = f"mpiexec -n {self.world.size} python -m mpi4py" if self.world.size > 1 else "python"
        resume = f"{launcher} -m andrea.train --out {self.out_dir} --resume"
        if signum:
            self.world.note(f"interrupted at step {self.step}; checkpoint in {self.out_dir}. Resume with: {resume}")
            return EXIT_INTERRUPTED
        self.world.log(f"stopped at step {self.step} (--stop-at-step); resume with: {resume}")
        return 0


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
