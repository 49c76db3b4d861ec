"""Export a trained ANDREA as a Hugging Face GPT-2 directory: `python -m andrea.export --checkpoint RUN --out DIR`.

--checkpoint takes a run directory (its newest good checkpoint) or one ckpt-* directory, as
andrea.sample does. DIR (by default out/<the run's name>-hf, beside the runs under out/, which git
ignores: `--checkpoint out/andrea-tiny` writes out/andrea-tiny-hf) gets config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, special_tokens_map.json and
generation_config.json (andrea.interop.hf), which transformers loads offline:

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(DIR)
    tokenizer = AutoTokenizer.from_pretrained(DIR)

DIR must be new, empty of those files, or an earlier export of the same run (which is replaced); a
training run's directory, another run's export or another program's files are refused before the
checkpoint is read (andrea.run.rundir). An export that is refused (a variant's block) or fails
writes nothing: a DIR it created is removed again.
"""

import shutil
import sys
from pathlib import Path

from andrea.cli import ArgumentParser, run_cli
from andrea.interop import hf
from andrea.run import rundir
from andrea.run.preflight import check_directory
from andrea.sample import load_model


def run_directory(checkpoint) -> Path:
    """The run directory of --checkpoint (a run directory, or one of its ckpt-* directories)."""
    path = Path(checkpoint)
    return path.parent if path.name.startswith("ckpt-") or (path / "meta.json").exists() else path


def default_out(checkpoint) -> Path:
    """out/<run name>-hf: where an export goes when --out is not given."""
    return Path("out") / f"{run_directory(checkpoint).resolve().name}-hf"


def main(argv=None):
    ap = ArgumentParser(prog="python -m andrea.export", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a run directory or a ckpt-* directory")
    ap.add_argument("--out", help="the directory to write (created if missing; an earlier export of the same run "
                                  "there is replaced); default: out/<run name>-hf")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_args(argv)
    args.out = str(args.out or default_out(args.checkpoint))
    check_directory(args.out, "--out")
    rundir.check(args.out, "export", source=run_directory(args.checkpoint))
    model, tokenizer, meta = load_model(args.checkpoint, device="cpu")
    hf.check_exportable(model.cfg, tokenizer)  # a refused export writes nothing, not even its --out
    out, created = Path(args.out), not Path(args.out).exists()
    try:
        with rundir.claim(out, "export", source=Path(meta["checkpoint"]).parent):
            paths = model.save_pretrained(out, tokenizer=tokenizer)
    except BaseException:
        if created:  # a failed write (a full disk) leaves no half export where there was nothing
            shutil.rmtree(out, ignore_errors=True)
        raise
    print(f"exported step {meta.get('step')} of {args.checkpoint} ({model.num_parameters():,} parameters) "
          f"to {args.out}: {', '.join(p.name for p in paths)}", file=sys.stderr)
    print(f"load it with transformers: AutoModelForCausalLM.from_pretrained({args.out!r}), "
          f"AutoTokenizer.from_pretrained({args.out!r})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_cli(main)
