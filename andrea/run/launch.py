"""What a training run is launched with: its config and output directory from the command's
arguments, and every rank's agreement on them.

`build_run_config` reads `--config`, `--set` and the flags into one config (a resumed run's own
config.json under --resume, the branched run's under --resume-from, neither changing the model, nor
the schedule without --change-schedule; --init-from's model config for a fine-tune). Ranks started with
different arguments (an MPMD launch) would issue different collectives and wait for each other
forever: `require_same_launch` stops them all with one error instead.
"""

from pathlib import Path

from andrea.config import load_config, make_config
from andrea.errors import UserError
from andrea.interop import hf
from andrea.run import checkpoint as ckpt
from andrea.run import distributed as dist
from andrea.run import preflight, runlog
from andrea.run.schedule import schedule_changes


def build_run_config(args):
    """(config, output directory) of the run `args` (parsed by andrea.train) asks for; a UserError for
    flags that contradict each other."""
    if args.init_from and (args.resume or args.resume_from):
        raise UserError("--init-from starts a run from a GPT-2 directory and --resume or --resume-from continues one: "
                        "give only one")
    if args.resume and args.resume_from:
        raise UserError("--resume continues the run in --out and --resume-from branches another run's checkpoint "
                        "into a new --out: give only one")
    if args.change_schedule and not (args.resume or args.resume_from):
        raise UserError("--change-schedule applies to a continued run: give it with --resume or --resume-from "
                        "(a new run takes any schedule)")
    overrides = list(args.set)
    for flag, key in ((args.max_steps, "train.max_steps"), (args.device, "train.device"), (args.seed, "train.seed")):
        if flag is not None:
            overrides.append(f"{key}={flag}")
    out_dir = Path(args.out) if args.out else None
    if args.resume or args.resume_from:
        cfg, out_dir = _continued_config(args, overrides, out_dir)
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


def _continued_config(args, overrides, out_dir):
    """(config, output directory) of a run that continues from a checkpoint: --resume's (the run in
    --out goes on) or --resume-from's (another run's checkpoint goes on in a new --out): the saved
    config of the run it comes from, with --set, of the same model and, unless --change-schedule,
    the same schedule."""
    if args.resume:
        if args.overwrite:
            raise UserError("--resume continues the run in --out and --overwrite deletes it: choose one")
        if out_dir is None:
            out_dir = Path("out") / load_config(args.config or "tiny").name
        preflight.check_directory(out_dir, "--out")
        source = out_dir
    else:
        source = source_run(args.resume_from)
        if out_dir is None:
            raise UserError("--resume-from starts a new run from that checkpoint: give its --out")
        preflight.check_directory(out_dir, "--out")
        if out_dir.resolve() == source.resolve():
            raise UserError(f"--resume-from {args.resume_from} is a checkpoint of the run in --out: continue that "
                            "run with --resume")
    base = runlog.read_saved_config(source)
    cfg = make_config(base, overrides, name=str(base.get("name", "custom")), source=str(source / "config.json"))
    if args.config is not None:
        _refuse_another_config(args.config, overrides, cfg, source)
    _refuse_another_model(base, cfg, source)
    changes = schedule_changes(make_config(base).to_dict()["train"], cfg.to_dict()["train"])
    if changes and not args.change_schedule:
        raise UserError(f"--set changes the schedule of the run in {source} ({', '.join(changes)}): add "
                        "--change-schedule to continue under the new one from the checkpoint's step on, or drop "
                        "that --set")
    return cfg, out_dir


def source_run(path) -> Path:
    """The run directory --resume-from names: itself, or the run of one of its checkpoints (ckpt-NNNNNNNN)."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    if ckpt.is_checkpoint_name(path.name) and (path.parent / "config.json").is_file():
        return path.parent
    raise UserError(f"--resume-from {path} is neither a run directory (one with config.json) nor a checkpoint "
                    "of one (RUN/ckpt-NNNNNNNN)")


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


def _refuse_another_model(base, cfg, out_dir):
    """A resumed run continues the model it saved: every checkpoint holds that model's weights and
    moments, so a --set that changes it could only end in each checkpoint being refused."""
    saved, now = make_config(base).to_dict()["model"], cfg.to_dict()["model"]
    changed = [f"model.{k} {saved.get(k)} -> {now[k]}" for k in now if saved.get(k) != now[k]]
    if changed:
        raise UserError(f"--set changes the model of the run in {out_dir} ({', '.join(changed[:4])}), whose "
                        "checkpoints hold the weights of the model it saved: resume without that --set, or start "
                        "a new run with another --out")


LAUNCH_FLAGS = ("resume", "resume_from", "change_schedule", "overwrite", "dry_run", "init_from", "stop_at_step")


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


def run_tokenizer(args, out_dir):
    """The tokenizer the run prepares its data with, if it must: --init-from's; a resumed run's own, or
    the one of the run --resume-from branches (should its data directory have to be prepared again);
    None: the directory's, or a new one."""
    source = out_dir if args.resume else source_run(args.resume_from) if args.resume_from else None
    own = source / "tokenizer.json" if source is not None and (source / "tokenizer.json").is_file() else None
    return args.init_from or own
