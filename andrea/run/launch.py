"""What a training run is launched with: its config and output directory from the command's
arguments, and every rank's agreement on them.

`build_run_config` reads `--config`, `--set` and the flags into one config (a resumed run's own
config.json under --resume; --init-from's model config for a fine-tune). Ranks started with
different arguments (an MPMD launch) would issue different collectives and wait for each other
forever: `require_same_launch` stops them all with one error instead.
"""

from pathlib import Path

from andrea.config import load_config, make_config
from andrea.errors import UserError
from andrea.interop import hf
from andrea.run import distributed as dist
from andrea.run import preflight, runlog


def build_run_config(args):
    """(config, output directory) of the run `args` (parsed by andrea.train) asks for; a UserError for
    flags that contradict each other."""
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
        _refuse_another_model(base, cfg, out_dir)
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


def _refuse_another_model(base, cfg, out_dir):
    """A resumed run continues the model it saved: every checkpoint holds that model's weights and
    moments, so a --set that changes it could only end in each checkpoint being refused."""
    saved, now = make_config(base).to_dict()["model"], cfg.to_dict()["model"]
    changed = [f"model.{k} {saved.get(k)} -> {now[k]}" for k in now if saved.get(k) != now[k]]
    if changed:
        raise UserError(f"--set changes the model of the run in {out_dir} ({', '.join(changed[:4])}), whose "
                        "checkpoints hold the weights of the model it saved: resume without that --set, or start "
                        "a new run with another --out")


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


def run_tokenizer(args, out_dir):
    """The tokenizer the run prepares its data with, if it must: --init-from's; a resumed run's own
    (should its data directory have to be prepared again); None: the directory's, or a new one."""
    own = out_dir / "tokenizer.json" if args.resume and (out_dir / "tokenizer.json").is_file() else None
    return args.init_from or own
