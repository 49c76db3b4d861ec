"""Each kind of norm (model.norm, a key of andrea.model.block.NORMS) as a user runs it: trained,
stopped and resumed, then sampled, evaluated and traced from its run directory; and a run written
when model.norm named the norm's position (pre, post, none) still resumes, samples and traces.
"""

import contextlib
import io
import json
import re

import numpy as np
import pytest
from runs import run_main, small_config

from andrea import eval as evaluation
from andrea import sample, trace
from andrea.cli import run_cli
from andrea.model.block import NORMS
from andrea.run import checkpoint as ckpt
from minitensor.device import to_numpy

PROMPT = "import json\n"


def call(main, argv):
    """(exit code, stdout) of a command run in-process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as e:
        run_cli(main, argv)
    return e.value.code, out.getvalue()


def trained(tmp_path, data_dir, *sets):
    """A run of the small config with `--set` sets, stopped after step 2 of 4 and resumed to the end."""
    out = tmp_path / "run"
    config = small_config(tmp_path, data_dir, max_steps=4, eval_interval=2, checkpoint_interval=2)
    sets = [a for s in sets for a in ("--set", s)]
    assert run_main(["--config", str(config), "--out", str(out), *sets, "--stop-at-step", "2"]) == 0
    assert run_main(["--out", str(out), "--resume"]) == 0
    return out


def logged_steps(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r and np.isfinite(r["loss"])]


def used(out, data_dir):
    """What andrea.trace printed, after andrea.sample and andrea.eval (on data_dir's validation split)
    ran on the run in out."""
    code, printed = call(sample.main, ["--checkpoint", str(out), "--prompt", PROMPT, "--max-new-tokens", "8"])
    assert code == 0 and printed.startswith(PROMPT)
    code, printed = call(evaluation.main, [str(out), "--data-dir", str(data_dir), "--max-tokens", "300"])
    assert code == 0 and re.search(r"loss \d+\.\d+ nats/token \| \d+\.\d+ bits/byte", printed), printed
    code, printed = call(trace.main, ["--checkpoint", str(out), "--prompt", PROMPT])
    assert code == 0 and "block 0" in printed and "logit lens" in printed
    return printed


@pytest.mark.parametrize("kind", list(NORMS))
def test_a_norm_trains_resumes_samples_evaluates_and_traces(tmp_path, data_dir, kind):
    out = trained(tmp_path, data_dir, f"model.norm={kind}")
    assert logged_steps(out) == [1, 2, 3, 4]
    model, tokenizer, _, _ = trace.load_any(out)
    assert model.cfg.norm == kind and type(model.ln_f) is NORMS[kind] and type(model.blocks[0].ln_1) is NORMS[kind]
    printed = used(out, data_dir)
    # the trace prints the statistics this kind has, with the values its layer computed for the token
    stats = to_numpy(model.trace(np.array([tokenizer.encode(PROMPT)]))[0]["ln_1"][list(NORMS[kind].stats)[0]])
    line = next(line for line in printed.splitlines() if line.startswith("  ln_1"))
    shown = dict(re.findall(r"(\w+) ([+-]?\d+\.\d+)", line))
    assert list(shown) == list(NORMS[kind].stats)
    assert float(shown[NORMS[kind].stats[0]]) == pytest.approx(float(stats[0, -1, 0]), abs=1e-4)


def write_old_spelling(out, position):
    """Rewrites the run in out as andrea wrote it when model.norm was the position: its config and each
    checkpoint's say norm: <position>, with no norm_position."""
    for path in [out / "config.json", *(p / "meta.json" for p in ckpt.list_checkpoints(out))]:
        values = json.loads(path.read_text())
        model = (values["meta"]["config"] if "meta" in values else values)["model"]
        assert model.pop("norm_position") == position and model["norm"] == "layernorm"
        model["norm"] = position
        path.write_text(json.dumps(values))


@pytest.mark.parametrize("position", ["post", "none"])
def test_a_run_from_before_the_position_was_apart_resumes_samples_and_traces(tmp_path, data_dir, position):
    out = tmp_path / "run"
    config = small_config(tmp_path, data_dir, max_steps=4, eval_interval=2, checkpoint_interval=2)
    assert run_main(["--config", str(config), "--out", str(out), "--set", f"model.norm_position={position}",
                     "--stop-at-step", "2"]) == 0
    write_old_spelling(out, position)
    assert run_main(["--out", str(out), "--resume"]) == 0
    assert logged_steps(out) == [1, 2, 3, 4]
    model = trace.load_any(out)[0]
    assert (model.cfg.norm, model.cfg.norm_position) == ("layernorm", position)
    assert all(b.position == position for b in model.blocks)
    used(out, data_dir)
