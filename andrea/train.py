"""Train an ANDREA model: `python -m andrea.train` (no arguments: the tiny model on the Python stdlib).

    python -m andrea.train                                   # prepare data if missing, train, sample
    python -m andrea.train --config small --out runs/small --set train.lr=1e-3
    python -m andrea.train --out runs/small --resume         # continue from the newest good checkpoint
    python -m andrea.train --resume-from runs/wsd/ckpt-00004000 --out runs/wsd-decay --max-steps 5000
                                                             # a branch: that checkpoint goes on in a new run
    python -m andrea.train --config 120m --dry-run           # the pre-flight checks and the plan, no training

A run goes through phases, each a function below, read top to bottom in `run_training`: the
checks (andrea.run.launch: the config from the arguments, the same on every rank; andrea.run.preflight:
device, paths, step shape, --init-from's weights, memory, data; the same with and without --dry-run),
the run directory, the data (andrea.run.rundata), the model (andrea.run.trainer.Trainer), the state
(a checkpoint's or a fresh one), the metrics sinks (andrea.run.metrics.open_sinks: opened before
the run directory is written, so that one that cannot start leaves no half-made run), the loop
(`Trainer.run`: steps, logging, evaluation, the non-finite guard, the stop vote, checkpoints), the end
(the last save checked, the plot, the summary, a sample). andrea.run.rundir claims --out for this run
alone (a marker of what wrote it, a lock held until the run ends); andrea.run.runlog keeps it to one
story (metrics that survive a full disk, each step once after a resume, exit code 4 when the last
save failed).

Under mpiexec (`mpiexec -n N python -m mpi4py -m andrea.train ...`) each of the N processes takes
its share of every step's windows and the gradients are summed across them once per step (see
andrea.run.distributed); rank 0 alone prints, writes metrics, checkpoints and samples.
"""

import os

if __name__ == "__main__":  # before NumPy loads OpenBLAS: its threads sleep after each GEMM (BENCHMARKS.md)
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import json  # after the setting above, on purpose
import time
from pathlib import Path

from andrea.cli import ArgumentParser, run_cli
from andrea.config import make_config
from andrea.errors import UserError
from andrea.model.sizes import format_breakdown, run_sizes
from andrea.plot import plot_after_training
from andrea.run import checkpoint as ckpt
from andrea.run import distributed as dist
from andrea.run import preflight, rundir, runlog
from andrea.run.launch import build_run_config, require_same_launch, run_tokenizer
from andrea.run.metrics import Metrics, open_sinks
from andrea.run.rundata import data_fingerprint, prepare_data, unigram_baseline
from andrea.run.schedule import make_schedule
from andrea.run.stopping import EXIT_INTERRUPTED
from andrea.run.kernels import agreed_kernels
from andrea.run.trainer import Trainer
from andrea.sample import stream
from minitensor.device import quiet_fallback
from minitensor.memory import keep_freed_memory


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
    ap.add_argument("--resume-from", metavar="PATH",
                    help="continue a checkpoint (RUN/ckpt-NNNNNNNN, or a run directory's newest) as a new run in "
                         "--out, "
                         "e.g. a wsd decay branched from a stable-phase checkpoint (docs/training.md)")
    ap.add_argument("--change-schedule", action="store_true",
                    help="with --resume or --resume-from: let --set change the schedule (train.schedule, lr, min_lr, "
                         "warmup_steps, decay_fraction); without it such a change is refused")
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


def main(argv=None):
    keep_freed_memory()  # an entry point's choice: see minitensor/memory.py
    world = dist.init()
    quiet_fallback()  # the pre-flight pass says once, on rank 0, which device a run of "auto" gets
    with dist.guard(world), rundir.released_at_end():  # --out stays claimed (locked) until the run ends
        return run_training(parse_args(argv), world)


def run_training(args, world):
    """The whole run on one rank, phase by phase; every collective inside is issued by all ranks in
    this order.

    A `together` block holds no collective of its own, so a rank that fails in one meets the others
    in its agreement; an error anywhere else ends every rank through dist.guard.
    """
    # the checks: everything that can fail is checked before any work, with or without --dry-run
    cfg, out_dir, plan = check_launch(args, world)
    if args.dry_run:
        world.log(plan.describe())
        return 0
    if plan.device_note:
        world.note(f"note: {plan.device_note}")
    # the run directory: claimed for this run; what killed processes left in it is removed
    with world.together():
        if world.is_main:
            rundir.claim(out_dir, "run", args.resume, args.overwrite)
            runlog.remove_stale_temporaries(out_dir, cfg.data.resolved_dir())
    # the data: prepared once, by rank 0, while the others wait; then read by every rank
    tokenizer, train_tokens, val_tokens = load_data(cfg, args, world, out_dir)
    # the model, optimizer and data loader, on every rank
    trainer = build_trainer(cfg, out_dir, args, world, tokenizer, train_tokens, val_tokens)
    # the state: a checkpoint's (--resume, --resume-from), or rank 0's fresh weights on every rank
    meta = None
    if args.resume or args.resume_from:
        meta = resume(trainer, args)
        if meta is None:
            return 0  # finished already
    else:
        share_state(trainer)
    # the metrics sinks, opened before the run directory is written: one that cannot start leaves it as it was
    with world.together():
        sinks = open_sinks(out_dir, cfg, world, trainer.step)
    try:
        if meta is not None:
            record_resume(trainer, meta)
        if world.is_main:
            (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
            tokenizer.save(out_dir / "tokenizer.json")
        _header(cfg, args, trainer, len(train_tokens), len(val_tokens), out_dir)
    except BaseException:
        Metrics(sinks).close()
        raise
    # the loop
    start_step, started = trainer.step, time.perf_counter()
    code = trainer.run(stop_at_step=args.stop_at_step, sinks=sinks)
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


def load_data(cfg, args, world, out_dir):
    """(tokenizer, train tokens, val tokens) on every rank: rank 0 prepares what is missing first."""
    with world.together():
        tokenizer = run_tokenizer(args, out_dir)
        prepared = prepare_data(cfg, tokenizer=tokenizer, note=world.note) if world.is_main else None
    with world.together():
        tokenizer, train_tokens, val_tokens = prepared or prepare_data(cfg, build=False, note=world.note)
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


def build_trainer(cfg, out_dir, args, world, tokenizer, train_tokens, val_tokens):
    """The Trainer on every rank, its gradients summed over NCCL on GPUs (connected here, outside
    any `together` block: NCCL's set-up is a collective)."""
    # the fused GPU kernels: rank 0's choice on every rank (a collective, so outside `together`)
    kernels = agreed_kernels(world, cfg.train, run_sizes(cfg.model, cfg.train.batch_size, cfg.train.precision))
    with world.together():
        if world.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
        trainer = Trainer(cfg, out_dir, train_tokens, val_tokens, tokenizer, world, init_from=args.init_from,
                          schedule=make_schedule(cfg.train), kernels=kernels)
        if args.init_from:
            world.log(f"initialised from {args.init_from}")
    if trainer.reducer is None:
        trainer.reducer = world.reducer_for(trainer.model.xp)  # NCCL: the unique id goes out over MPI
    if trainer.accum > 1 and world.is_main:
        trainer.loader = runlog.MicroBatchProgress(trainer.loader, trainer.accum)
    return trainer


def resume(trainer, args):
    """Rank 0 reads the checkpoint (--resume: the newest good one in --out; --resume-from: the one it
    names, or its run's newest good one); the others get it by broadcast (share_state). Writes
    nothing: record_resume does, once the metrics sinks have started.

    Returns the checkpoint's meta (its "path" added), or None when it is already at train.max_steps
    (nothing to train)."""
    world, out_dir = trainer.world, trainer.out_dir
    with world.together():
        meta = None
        if world.is_main:
            path, tensors, meta = read_checkpoint(trainer, args.resume_from or out_dir)
            trainer.restore(tensors, meta)
            trainer.last_checkpoint = path if not args.resume_from else None
            meta = dict(meta, path=str(path))
    meta = world.broadcast_json(meta)
    with world.together():
        if not world.is_main and trainer.shards is not None:  # sharded: each rank keeps its own range of the
            trainer.restore(*ckpt.load_checkpoint(meta["path"]))  # optimizer's state, so each reads it
        elif not world.is_main:
            trainer.restore_meta(meta)
    if trainer.step >= trainer.cfg.train.max_steps and args.resume_from:
        raise UserError(f"{meta['path']} is step {trainer.step}, which train.max_steps "
                        f"{trainer.cfg.train.max_steps} does not go beyond: give the branch a larger --max-steps")
    if trainer.step >= trainer.cfg.train.max_steps:
        world.log(f"the run in {out_dir} has already finished: {meta['path']} is step {trainer.step} of "
                  f"train.max_steps {trainer.cfg.train.max_steps}; nothing to do (to train longer: --resume "
                  "--max-steps N)")
        return None
    share_state(trainer)
    with world.together():
        if world.is_main and args.stop_at_step is not None and args.stop_at_step <= trainer.step:
            raise UserError(f"--stop-at-step {args.stop_at_step} is not after the resumed step {trainer.step}")
    return meta


def record_resume(trainer, meta):
    """metrics.jsonl without the rows after the checkpoint, and a resume record (rank 0); the log's lines."""
    world, out_dir = trainer.world, trainer.out_dir
    dropped = runlog.drop_rows_after(out_dir / "metrics.jsonl", trainer.step, meta["path"]) if world.is_main else 0
    world.log(f"resumed from {meta['path']} at step {trainer.step}"
              + (f"; dropped {dropped} metrics rows of later steps, which this run recomputes" if dropped else ""))
    _note_schedule(trainer, meta)
    saved = int(meta.get("processes", 1))
    if saved != world.size:
        world.log(f"note: the checkpoint was written by {saved} process(es), this run has {world.size}: same "
                  f"batches in the same order, now {trainer.accum} micro-batch(es) per process; results match the "
                  "other count to float32 summation order, not bit for bit")


def read_checkpoint(trainer, where):
    """(path, tensors, meta) of the checkpoint `where` names (a ckpt-NNNNNNNN directory), or of the
    newest good one in the run directory `where`, checked to fit the trainer."""
    where = Path(where)
    if not ckpt.is_checkpoint_name(where.name) and not ckpt.list_checkpoints(where):
        raise UserError(f"nothing to resume in {where}: the run there stopped before its first checkpoint; "
                        f"start it afresh with --overwrite")
    if ckpt.is_checkpoint_name(where.name):
        tensors, meta = ckpt.load_checkpoint(where)
        trainer.validate_checkpoint(tensors, meta)
        return where, tensors, meta
    return ckpt.latest_checkpoint(where, validate=trainer.validate_checkpoint)


def _note_schedule(trainer, meta):
    """When the learning rate from the resumed step on is not the checkpoint's run's (--change-schedule, a
    new train.max_steps), the log says how it moves and what the schedule now is."""
    step, schedule = trainer.step, trainer.schedule
    try:
        saved = make_schedule(make_config({s: meta["config"][s] for s in ("model", "train")}).train)
    except (KeyError, TypeError, UserError):
        return
    before, now = saved.lr(step), schedule.lr(step)
    if saved.describe() != schedule.describe():
        trainer.world.log(f"note: the schedule was {saved.describe()}; it is now {schedule.describe()}. The "
                          f"learning rate of step {step + 1} is {now:.2e} ({before:.2e} under the old one)")


def share_state(trainer):
    """Rank 0's weights and optimizer state (every tensor the optimizer names) on every rank (a no-op
    for one process). Sharded (train.zero_stage 1), each rank holds its own range of the state, fresh
    or read from the checkpoint, so only the weights go out."""
    if trainer.world.size == 1:
        return
    state = trainer.opt.named_state().values() if trainer.shards is None else ()
    for buf in (trainer.model.params.data, *state):
        trainer.reducer.broadcast(buf)
    trainer.model.params.refresh_compute()  # train.precision=bf16: the layers' bfloat16 copy of the weights


def finish(trainer, code, start_step, seconds):
    """After the loop, on rank 0: the last save checked, the plot, the summary, a sample; the exit code."""
    t, out_dir, world = trainer.cfg.train, trainer.out_dir, trainer.world
    if not world.is_main:
        return code
    code = runlog.final_checkpoint_check(out_dir, trainer.step, trainer.last_checkpoint, code)
    if code == 0:
        world.log(plot_after_training(out_dir))
    if code in (0, EXIT_INTERRUPTED):
        loss = float(trainer.last_loss) if trainer.last_loss is not None else None
        world.log(runlog.summary(out_dir, trainer.step - start_step, trainer.step, seconds,
                                 trainer.meter.run_rate(), loss, trainer.last_val, trainer.last_checkpoint,
                                 unigram_baseline(trainer.cfg)))
    if code == 0 and trainer.step >= t.max_steps and t.sample_tokens > 0:
        world.log(f"\nsample (temperature 0.8, top-k 50) from {t.sample_prompt!r}:\n" + "-" * 60)
        stream(trainer.model, trainer.tokenizer, t.sample_prompt, t.sample_tokens, 0.8, 50, seed=t.seed)
        world.log("-" * 60 + f"\nmore: python -m andrea.sample --checkpoint {out_dir} --prompt 'import '")
    return code


def _header(cfg, args, trainer, n_train, n_val, out_dir):
    """The run's first lines, from the effective config (overrides included), not the file's name."""
    m, t, world = cfg.model, cfg.train, trainer.world
    changed = [o for o in args.set if o.startswith("model.")]
    name = f"{cfg.name} with {', '.join(changed)}" if changed else cfg.name
    world.log(f"ANDREA {name} ({preflight.describe_model(m)}): {trainer.model.num_parameters():,} parameters on "
              f"{trainer.model.device.name} ({t.dtype})\n{format_breakdown(m)}")
    for line in trainer.startup:
        world.log(line)
    micro = "micro-batch" if trainer.accum == 1 else "micro-batches"
    ranks = f" x {world.size} processes ({trainer.reducer.name})" if world.size > 1 else ""
    world.log(f"batch {t.batch_size} x {trainer.T} tokens x {trainer.accum} {micro}{ranks} = "
              f"{trainer.tokens_per_step:,} tokens/step; {n_train:,} train tokens, {n_val:,} val tokens; "
              f"output in {out_dir}")


def _quiet(msg):
    """Warnings of the pre-flight pass on ranks other than 0: rank 0 prints them once."""


if __name__ == "__main__":
    run_cli(main)
