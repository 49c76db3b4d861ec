"""andrea.experiment at a tiny budget (each command end to end in seconds: its runs, table, figure
and verdict), the gradient-flow log and its plot, and a variant's run resumed and sampled."""

import json
import math
import sys
from pathlib import Path

import pytest
from optional import require

from andrea import experiment, plot, sample, train
from andrea.cli import run_cli
from andrea.config import load_config
from andrea.experiments import base, composition, mlp, norm, page, report, residual, runs
from andrea.run import gradflow
from minitensor.parallel import num_threads

STDLIB_JSON = Path(json.__file__).parent
SMALL = ["model.n_layer=2", "model.d_model=16", "model.n_head=2", "model.context_length=16", "train.seq_len=16",
         "train.batch_size=2", "train.eval_batches=1"]


def corpus(data_dir):
    return [f"data.inputs={STDLIB_JSON}", f"data.data_dir={data_dir}", "data.allow_smaller_vocab=true"]


def run(main, argv):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, argv)
    return exit_info.value.code


@pytest.mark.parametrize("name", sorted(experiment.EXPERIMENTS))
def test_each_experiment_runs_and_reports(tmp_path, data_dir, name):
    require("matplotlib")
    out = tmp_path / name
    argv = [name, "--out", str(out), "--steps", "3", "--seeds", "0"]
    for o in SMALL + corpus(data_dir):
        argv += ["--set", o]
    assert run(experiment.main, argv) == 0
    arms = experiment.EXPERIMENTS[name].arms
    results = json.loads((out / "results.json").read_text())
    assert [r["arm"] for r in results["rows"]] == list(arms)
    table = (out / "results.md").read_text()
    for arm in arms:
        assert f"| {arm}-seed0 |" in table
        metrics = [json.loads(line) for line in (out / f"{arm}-seed0" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in metrics if "grad_flow" in r] == [1, 2, 3]  # log_interval 1 at 3 steps
        assert len(metrics[0]["grad_flow"]["grad_in"]) == 2
    for r in results["rows"]:
        assert r["ratio_init"] > 0 and r["val_loss"] > 0 and r["exit_code"] == 0
    assert any(v in table for v in ("**claim: supports**", "**claim: contradicts**", "**claim: leaves open**"))
    baseline = json.loads((data_dir / "meta.json").read_text())["unigram_val_nats"]
    assert f"Unigram baseline of the validation tokens: {baseline:.3f} nats/token" in table  # issue 30, class 14
    assert {r["unigram_baseline"] for r in results["rows"]} == {baseline}
    assert "| arm | seeds | mean final val loss | spread over seeds (max - min) |" in table
    assert "Runs that did not diverge yet did not train (ended at or above it)" in table  # 3 steps learn nothing
    for r in results["rows"]:  # each run's time and the machine's load, from its log
        assert r["seconds"] is not None and r["seconds"] >= 0  # 0.0 s: 3 steps of a tiny model, as the log rounds
        assert len(r["load"]) == 1 and r["load"][0] >= 0 and r["threads"] == [num_threads()]
    assert f"Time: the {len(arms)} runs' wall times add up to" in table and "1-minute load average" in table
    assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_experiment_that_reads_a_loss_runs_three_seeds_by_default_on_a_model_that_learns():
    # issue 28's re-budget; depth reads gradient ratios of thin stacks, not a loss, so it is left out
    for name in ("residual", "norm", "activation", "mlp-ratio", "swiglu", "no-norm", "composition"):
        exp = experiment.EXPERIMENTS[name]
        assert len(exp.seeds) >= 3, name
        assert set(base.LEARNS) <= set(exp.base), name  # the default model's width, context and batch
        assert exp.steps >= 200, name  # 410k tokens: the first budget (150 steps of d_model 64, 77k) learned too little
        if "model.n_layer=4" in exp.base:  # at 200 steps one 4-block run ended 0.967 nats under the baseline
            assert exp.steps >= 300, name
        assert set(exp.arm_steps) <= set(exp.arms) and all(n >= exp.steps for n in exp.arm_steps.values()), name
    # norm's first budget (12 blocks x 200 steps) left pre-norm without warmup 0.49-0.58 nats under it
    assert "model.n_layer=6" in experiment.EXPERIMENTS["norm"].base and experiment.EXPERIMENTS["norm"].steps >= 400


def test_the_time_line_says_other_work_shared_the_cores_only_when_the_load_says_so(monkeypatch):
    monkeypatch.setattr(report.os, "cpu_count", lambda: 2)
    rows = [{"seconds": 190.0, "load": [2.06], "threads": [1]}, {"seconds": 185.0, "load": [2.0], "threads": [1]}]
    line = report.time_line(rows)  # two one-thread runs side by side on 2 cores: the experiment's own load
    assert "add up to 6 min 15 s" in line and "load average 2.0 to 2.1 at the runs' ends." in line
    assert "other work" not in line
    loaded = report.time_line([dict(rows[0], load=[6.3])])
    assert "(more than this machine's 2 cores: other work shared them, a time measured under load)" in loaded


def test_a_session_without_a_done_line_is_timed_by_the_experiment(tmp_path):
    # no-norm's three runs the guard stopped at lr 3e-2 had no time in the report: "3 runs have no time logged"
    end = f"{runs.LOAD_LINE} 1.98; {runs.THREADS_LINE} 1\n"
    done = "done: step 120 (120 this run) in 40.5 s | 6,331 tokens/s\n"
    guard = "error: training stopped at step 59 after 5 non-finite steps in a row; last good checkpoint: none\n"
    logs = {"finished": "step 1/120\n" + done + f"{runs.SESSION_LINE} 42.0 s\n" + end,
            "stopped": "step 1/300\n" + guard + f"{runs.SESSION_LINE} 21.3 s\n" + end,
            "resumed": "step 1/300\n" + f"{runs.SESSION_LINE} 10.0 s\n" + end + done + f"{runs.SESSION_LINE} 41.0 s\n"
                       + end,
            "before": "step 1/120\n" + done + end}  # a log written before SESSION_LINE
    timing = {}
    for name, text in logs.items():
        (tmp_path / name).write_text(text)
        timing[name] = runs._timing(tmp_path / name)
    assert [timing[n]["seconds"] for n in logs] == [40.5, 21.3, 50.5, 40.5]
    assert [timing[n]["untimed_by_train"] for n in logs] == [0, 1, 1, 0]
    assert timing["resumed"]["load"] == [1.98, 1.98] and timing["stopped"]["threads"] == [1]
    line = report.time_line(list(timing.values()))
    assert "the 4 runs' wall times add up to 2 min 33 s" in line
    assert '; 2 runs without a "done" line (stopped before the end) timed by the experiment, start-up included' in line


def test_the_learned_line_tells_a_run_that_did_not_train_from_one_that_trained_too_little():
    def row(run, val, diverged=False):
        return {"run": run, "val_loss": val, "unigram_baseline": 6.683, "diverged": diverged}

    trained, stuck, slow, blown = row("pre-seed0", 5.5), row("post-seed0", 6.727), row("pre-seed1", 6.1), \
        row("none-seed0", math.inf, diverged=True)
    line = report.learned_line([trained, stuck, blown])
    assert "did not train (ended at or above it): post-seed0 (6.727)" in line
    assert line.endswith("Every run that trained ended at least 1.0 nats under it.\n") and "none-seed0" not in line
    line = report.learned_line([trained, slow])
    assert "did not train" not in line
    assert "Runs that trained but ended less than 1.0 nats under it: pre-seed1 (6.100)" in line
    at_baseline = report.learned_line([trained, row("flat-seed0", 6.683)])
    assert "did not train (ended at or above it): flat-seed0 (6.683)" in at_baseline
    assert report.learned_line([trained]).endswith("Every run that trained ended at least 1.0 nats under it.\n")
    assert report.learned_line([stuck, blown]).endswith("post-seed0 (6.727). No run trained.\n")


def rows_of(losses, **more):
    """Result rows as summarise makes them: {arm: [final val loss of seed 0, seed 1, ...]}."""
    return [dict({"arm": arm, "run": f"{arm}-seed{seed}", "seed": seed, "val_loss": loss, "diverged": False,
                  "ratio_final": more.get(arm, 1.0), "delta_init_max": 0.1, "first_nonfinite": None,
                  "params": 1000}) for arm, values in losses.items() for seed, loss in enumerate(values)]


def test_the_seeds_spread_leaves_diverged_runs_out():
    # no-norm's first runs: two runs at lr 3e-2 without LayerNorm ended at 5e7 and 2e10 nats, a "spread" of 2e10
    rows = rows_of({"pre-lr3e-2": [6.04, 6.11, 6.16], "none-lr3e-2": [4.98e7, 10.07, 2.26e10]})
    for r in rows:
        r["diverged"] = r["arm"] == "none-lr3e-2"
    assert base.seed_spread(rows, ["pre-lr3e-2", "none-lr3e-2"]) == pytest.approx(0.12)
    assert "| none-lr3e-2 | 0, 1, 2 | 7549933336.690 | not measured: diverged |" in report.arm_table(rows)


# Runs whose differences are known. One arm ends at SEEDS (seed to seed its loss moves by 0.3, as
# the seeds moved the real runs' losses); the other at SEEDS plus each case's per-seed differences.
SEEDS = (5.0, 5.3, 5.6)
EQUAL = (0.0, 0.0, 0.0)
CLEAR = (0.30, 0.32, 0.31)            # clearly higher in every seed
LOWER = (-0.30, -0.32, -0.31)         # clearly lower
WITHIN = (0.01, -0.02, 0.015)         # either way, within NO_WORSE's 0.05
SLIGHT = (0.010, 0.011, 0.012)        # one-signed and small, and alike in every seed
WIDE = (0.340, 0.110, 0.048)          # one-signed but wide: SwiGLU against GELU, docs/experiments.md section 6
CASES = {"equal": EQUAL, "clearly higher": CLEAR, "clearly lower": LOWER, "within the margin": WITHIN,
         "one-signed, small": SLIGHT, "one-signed, wide": WIDE}


def pair(a, b, diffs, seeds=SEEDS):
    """Rows of arm a ending at `seeds` and arm b at `seeds` + diffs (b - a, per seed)."""
    return rows_of({a: list(seeds), b: [x + d for x, d in zip(seeds, diffs)]})


def verdicts(rule, a, b, **extra):
    return {case: rule(pair(a, b, diffs) + extra.get(case, [])).verdict for case, diffs in CASES.items()}


def test_each_rule_reads_the_paired_differences_of_runs_whose_differences_are_known():
    # the old rule set a difference of means against the seeds' spread (0.3 here): it left "one-signed,
    # small" open and called "one-signed, wide" comparable; the paired rule reads each seed's difference
    directional = {"equal": "leaves open", "clearly higher": "supports", "clearly lower": "contradicts",
                   "within the margin": "leaves open", "one-signed, small": "supports",
                   "one-signed, wide": "leaves open"}
    no_worse = {"equal": "supports", "clearly higher": "contradicts", "clearly lower": "supports",
                "within the margin": "supports", "one-signed, small": "supports", "one-signed, wide": "leaves open"}
    assert verdicts(mlp.judge_activation, "gelu", "relu") == directional
    assert verdicts(norm.judge_pre_over_post, "pre-warmup", "post-warmup") == directional
    assert verdicts(experiment.EXPERIMENTS["swiglu"].judge, "gelu-4x", "swiglu-8_3x") == no_worse
    pre_half = dict(experiment.EXPERIMENTS["norm"].more)["pre-norm no worse without warmup"]
    assert verdicts(pre_half, "pre-warmup", "pre-no-warmup") == no_worse
    assert verdicts(norm.judge_norm, "post-warmup", "post-no-warmup") == directional
    residual_rule = residual.judge_residual  # the gradient lost without skips in every seed: the loss decides
    assert {case: residual_rule(rows_of({"residual": list(SEEDS), "no-residual": [x + d for x, d in zip(SEEDS, diffs)]},
                                        residual=50.0, **{"no-residual": 1e-12})).verdict
            for case, diffs in CASES.items()} == dict(directional, **{"clearly lower": "contradicts"})
    verdict = mlp.judge_activation(pair("gelu", "relu", WIDE))
    assert verdict.why.startswith("ReLU - GELU per seed: +0.340 (seed 0), +0.110 (seed 1), +0.048 (seed 2); "
                                  "positive in 3 of 3; mean +0.166, 95% t-interval [-0.216, +0.548]")
    assert "about 6 seeds in all would clear 0" in verdict.why
    assert verdict.glance == "ReLU - GELU: +0.166 [-0.216, +0.548]"
    swiglu = experiment.EXPERIMENTS["swiglu"].judge(pair("gelu-4x", "swiglu-8_3x", WIDE))
    assert "against the margin 0.05 nats (a 5% change in perplexity" in swiglu.why
    assert "about 10 seeds in all would clear the margin 0.05" in swiglu.why
    assert swiglu.glance == "SwiGLU 8/3 - GELU 4x: +0.166 [-0.216, +0.548], margin 0.05"


def ratio_rows(g12, g24, g48):
    """The MLP-ratio arms with the per-seed gains 1 to 2, 2 to 4 and 4 to 8 given."""
    loss = {8: list(SEEDS)}
    for r, gains in ((4, g48), (2, g24), (1, g12)):
        loss[r] = [x + g for x, g in zip(loss[2 * r], gains)]
    return rows_of({f"ratio-{r}": loss[r] for r in (1, 2, 4, 8)})


def test_the_mlp_ratio_rule_reads_each_seeds_gains():
    rule = mlp.judge_mlp_ratio
    assert rule(ratio_rows(CLEAR, (0.15, 0.16, 0.14), SLIGHT)).verdict == "supports"       # returns diminish
    assert rule(ratio_rows(CLEAR, SLIGHT, CLEAR)).verdict == "contradicts"                # 8 gains more than 4 did
    assert rule(ratio_rows(CLEAR, LOWER, SLIGHT)).verdict == "contradicts"                # 4 ends above 2
    verdict = rule(ratio_rows(CLEAR, WIDE, SLIGHT))                                       # 2 to 4 not settled
    assert verdict.verdict == "leaves open" and "the slowest of the open parts" in verdict.why
    assert rule(ratio_rows(EQUAL, EQUAL, EQUAL)).verdict == "leaves open"


def test_the_no_norm_rule_reads_each_rate_and_each_seed():
    rule = experiment.EXPERIMENTS["no-norm"].judge

    def at(low, high, blown=()):  # none - pre per seed at lr 3e-3 and 3e-2; `blown`: seeds non-finite at 3e-2
        rows = pair("pre-lr3e-3", "none-lr3e-3", low) + pair("pre-lr3e-2", "none-lr3e-2", high)
        for r in rows:
            if r["arm"] == "none-lr3e-2" and r["seed"] in blown:
                r.update(val_loss=math.nan, diverged=True, first_nonfinite=40 + r["seed"])
        return rows

    assert rule(at(CLEAR, CLEAR)).verdict == "supports"               # worse at every rate
    assert rule(at(EQUAL, WITHIN)).verdict == "contradicts"           # no worse anywhere, never non-finite
    verdict = rule(at(EQUAL, EQUAL, blown=(0, 1, 2)))                 # non-finite in every seed at 3e-2
    assert verdict.verdict == "supports" and "non-finite from step 40 (seed 0)" in verdict.why
    assert "nan" not in verdict.why
    assert rule(at(EQUAL, EQUAL, blown=(1,))).verdict == "leaves open"  # one seed of three: not instability
    assert rule(at(WIDE, EQUAL)).verdict == "leaves open"


def test_the_residual_rule_reads_the_last_step():
    # the old rule read the gradient ratio at step 1, where the LayerNorms keep it alive without skips
    losses = {"residual": [5.3, 5.32, 5.31], "no-residual": [6.5, 6.6, 6.55]}
    verdict, why, _ = residual.judge_residual(rows_of(losses, residual=50.0, **{"no-residual": 1e-12}))
    assert verdict == "supports" and "at the last step the embeddings receive 1e-12" in why
    assert residual.judge_residual(rows_of(losses, residual=50.0, **{"no-residual": 10.0}))[0] == "leaves open"
    assert residual.judge_residual(rows_of(losses, residual=1.0, **{"no-residual": 2.0}))[0] == "contradicts"
    close = {"residual": [5.3, 5.5, 5.4], "no-residual": [5.35, 5.45, 5.5]}  # the loss: +0.05, -0.05, +0.1
    assert residual.judge_residual(rows_of(close, residual=50.0, **{"no-residual": 1e-12}))[0] == "leaves open"


def test_report_only_writes_its_section_of_a_doc(tmp_path, data_dir, capsys):
    require("matplotlib")
    out, doc = tmp_path / "residual", tmp_path / "doc.md"
    begin, end = page.markers("residual")
    before, after = "# Claims\n\nThe prose, kept.\n", "\n## Next\n\nAlso kept.\n"
    doc.write_text(f"{before}{begin}\nthe old table\n{end}\n{after}")
    argv = ["residual", "--out", str(out), "--steps", "2", "--seeds", "0,1"]
    for o in SMALL + corpus(data_dir):
        argv += ["--set", o]
    assert run(experiment.main, argv) == 0
    assert run(experiment.main, argv + ["--report-only", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith(f"{before}{begin}\nCommand: `python -m andrea.experiment residual --out") and \
        text.endswith(f"![residual](experiments/residual.png)\n{end}\n{after}")
    assert "the old table" not in text and "| residual | 0, 1 |" in text and "**claim: " in text
    assert (tmp_path / "experiments" / "residual.png").read_bytes()[:4] == b"\x89PNG"
    results = (out / "results.md").read_text()
    assert results[results.index("| run |"):results.index("\n![")] in text  # the table and verdicts of results.md
    capsys.readouterr()
    doc.write_text("no markers\n")  # said before anything is trained
    assert run(experiment.main, ["norm", "--out", str(tmp_path / "norm"), "--doc", str(doc)]) == 2
    assert capsys.readouterr().err == f"error: --doc {doc} has no section for norm: put the lines " \
        f"{page.markers('norm')[0]} and {page.markers('norm')[1]} where it goes\n"
    assert not (tmp_path / "norm").exists() and doc.read_text() == "no markers\n"


def test_the_arms_differ_only_in_their_variant(tmp_path, data_dir):
    out = tmp_path / "norm"
    argv = ["norm", "--out", str(out), "--steps", "2", "--seeds", "0"]
    for o in SMALL + corpus(data_dir):
        argv += ["--set", o]
    require("matplotlib")
    assert run(experiment.main, argv) == 0
    configs = {d.name: json.loads((d / "config.json").read_text()) for d in out.iterdir() if d.name.endswith("seed0")}
    pre, post = configs["pre-warmup-seed0"], configs["post-no-warmup-seed0"]
    assert (pre["model"]["norm_position"], post["model"]["norm_position"]) == ("pre", "post")
    assert (pre["train"]["warmup_steps"], post["train"]["warmup_steps"]) == (1, 0)
    for c in (pre, post):  # the same seed, hence the same initial draws and batches, and budget
        c["model"].pop("norm_position")
        c["train"].pop("warmup_steps")
    assert pre == post


@pytest.mark.parametrize("argv, message", [(["residual", "--scale", "0"], "--scale must be positive"),
                                           (["residual", "--scale", "inf"], "--scale must be positive and finite"),
                                           (["residual", "--scale", "nan"], "--scale must be positive and finite"),
                                           (["resid"], "argument name: invalid choice: 'resid'"),
                                           ([], "the following arguments are required: name"),
                                           (["residual", "--bogus"], "unrecognized arguments: --bogus"),
                                           (["residual", "--seeds", "a"], "--seeds must be integers"),
                                           (["residual", "--steps", "1"], "--steps must be at least 2"),
                                           (["residual", "--arms", "x"], "--arms: x is not an arm of residual")])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert run(experiment.main, argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {message}") and "\n" not in err


@pytest.mark.parametrize("matplotlib", ["installed", "missing"])
def test_an_out_that_is_a_file_is_a_one_line_error(tmp_path, capsys, monkeypatch, matplotlib):
    if matplotlib == "missing":  # as with only the test extra: the experiment asked for it before --out
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    (tmp_path / "f").write_text("mine")
    assert run(experiment.main, ["residual", "--out", str(tmp_path / "f")]) == 2  # was exit 1 (NotADirectoryError)
    assert capsys.readouterr().err == f"error: --out {tmp_path / 'f'} is a file, not a directory: choose a directory\n"
    assert (tmp_path / "f").read_text() == "mine"


def test_an_interrupted_experiment_continues_where_it_stopped(tmp_path, data_dir, monkeypatch, capsys):
    # issue 30, class 10: the same command again retrained the finished arm and restarted the
    # interrupted one, deleting the checkpoint the interruption had said to resume from
    require("matplotlib")
    import os
    import signal

    out = tmp_path / "residual"
    argv = ["residual", "--out", str(out), "--steps", "4", "--seeds", "0"]
    for o in SMALL + corpus(data_dir):
        argv += ["--set", o]
    step = train.Trainer.train_step

    def ctrl_c_in_the_second_arm(self, lr):  # as a Ctrl-C at step 2 of no-residual would
        if not self.cfg.model.residual and self.step == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return step(self, lr)

    monkeypatch.setattr(train.Trainer, "train_step", ctrl_c_in_the_second_arm)
    assert run(experiment.main, argv) == 130
    assert "interrupted in no-residual-seed0, which keeps its checkpoint" in capsys.readouterr().err
    kept = (out / "residual-seed0" / "ckpt-00000004" / "meta.json").read_bytes()
    assert (out / "no-residual-seed0" / "ckpt-00000002").is_dir()
    monkeypatch.setattr(train.Trainer, "train_step", step)
    assert run(experiment.main, argv) == 0
    err = capsys.readouterr().err
    assert "residual-seed0 has finished already: kept" in err and "resuming no-residual-seed0" in err
    assert (out / "residual-seed0" / "ckpt-00000004" / "meta.json").read_bytes() == kept  # not trained again
    assert "resumed from" in (out / "logs" / "no-residual-seed0.log").read_text()
    rows = [json.loads(line) for line in (out / "no-residual-seed0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert [r["run"] for r in json.loads((out / "results.json").read_text())["rows"]] == \
        ["residual-seed0", "no-residual-seed0"]
    # another budget is another experiment: its arms are trained again
    assert run(experiment.main, argv[:4] + ["3"] + argv[5:]) == 0
    assert "holds a run of another config (train.max_steps" in capsys.readouterr().err


def test_grad_flow_is_recorded_only_when_asked_and_only_at_log_steps():
    cfg = load_config("tiny", SMALL + ["train.log_interval=3", "train.max_steps=7"]).train

    class Model:
        cfg, flow = load_config("tiny").model, None

        def record_flow(self, recorder):
            self.flow = recorder

    m = Model()
    for step in range(1, 8):
        with gradflow.recording(m, step, cfg) as flow:
            assert flow is None and m.flow is None
    cfg.log_grad_flow = True
    seen = []
    for step in range(1, 8):
        with gradflow.recording(m, step, cfg) as flow:
            if flow is not None:
                seen.append(step)
                assert m.flow is flow
        assert m.flow is None  # evaluation after the step is not measured
    assert seen == [1, 3, 6, 7]


def test_a_variant_run_logs_its_flow_resumes_and_samples(tmp_path, data_dir):
    require("matplotlib")
    out = tmp_path / "post"
    sets = []
    for o in SMALL + corpus(data_dir) + ["model.norm_position=post", "model.activation=relu", "train.max_steps=4",
                                        "train.log_interval=2", "train.log_grad_flow=true", "train.sample_tokens=0",
                                        "train.device=cpu", "train.checkpoint_interval=2"]:
        sets += ["--set", o]
    assert run(train.main, ["--out", str(out), "--stop-at-step", "2"] + sets) == 0
    assert run(train.main, ["--out", str(out), "--resume"]) == 0
    saved = json.loads((out / "config.json").read_text())["model"]
    assert (saved["norm_position"], saved["activation"], saved["residual"]) == ("post", "relu", True)
    flows = gradflow.read_flow(out)
    assert [s for s, _ in flows] == [1, 2, 4]
    assert all(len(f["grad_in"]) == 2 and f["grad_top"] > 0 for _, f in flows)
    model, _, _ = sample.load_model(out)
    assert (model.cfg.norm_position, model.cfg.activation) == ("post", "relu")  # the checkpoint records it
    assert [b.position for b in model.blocks] == ["post", "post"]
    assert run(sample.main, ["--checkpoint", str(out), "--max-new-tokens", "5", "--prompt", "def "]) == 0
    assert run(plot.main, ["--grad-flow", str(out), "--out", str(tmp_path / "g.png")]) == 0
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_grad_flow_says_how_to_get_one(tmp_path, data_dir, capsys):
    run_dir = tmp_path / "plain"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    assert run(plot.main, ["--grad-flow", str(run_dir)]) == 2
    assert "train.log_grad_flow=true" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["grad_top", "grad_in", "mlp_delta"])
def test_plot_grad_flow_of_a_record_missing_a_key_names_the_key(tmp_path, key, capsys):
    # issue 30, class 11: a KeyError traceback
    require("matplotlib")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    flow = {"grad_top": 1.0, "grad_in": [0.5, 0.7], "stream_rms": [1.0, 1.1], "attn_delta": [0.1, 0.1],
            "mlp_delta": [0.2, 0.2]}
    rows = [{"step": 1, "loss": 9.0, "grad_flow": flow}, {"step": 2, "loss": 8.0, "grad_flow": dict(flow)}]
    del rows[1]["grad_flow"][key]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert run(plot.main, ["--grad-flow", str(run_dir), "--out", str(tmp_path / "g.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run_dir / 'metrics.jsonl'} step 2: its grad_flow has no {key!r}") and \
        err.count("\n") == 1
    assert not (tmp_path / "g.png").exists()


def test_arms_then_report_only_rebuild_the_report_from_finished_runs(tmp_path, data_dir, capsys):
    require("matplotlib")
    out = tmp_path / "residual"
    argv = ["residual", "--out", str(out), "--steps", "2", "--seeds", "0"]
    for o in SMALL + corpus(data_dir):
        argv += ["--set", o]
    assert run(experiment.main, argv + ["--arms", "no-residual"]) == 0
    assert run(experiment.main, argv + ["--arms", "residual"]) == 0
    assert [r["run"] for r in json.loads((out / "results.json").read_text())["rows"]] == ["residual-seed0"]
    assert run(experiment.main, argv + ["--report-only"]) == 0
    first = json.loads((out / "results.json").read_text())["rows"]
    assert [r["run"] for r in first] == ["residual-seed0", "no-residual-seed0"]
    (out / "results.json").unlink()
    (out / "residual.png").unlink()
    assert run(experiment.main, argv + ["--report-only"]) == 0
    again = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["run"], r["val_loss"], r["ratio_final"]) for r in again] == \
        [(r["run"], r["val_loss"], r["ratio_final"]) for r in first]
    assert (out / "residual.png").is_file()
    (out / "no-residual-seed0" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    capsys.readouterr()
    assert run(experiment.main, argv + ["--report-only"]) == 0
    assert "no-residual-seed0 has no finished run: left out" in capsys.readouterr().err
    assert [r["run"] for r in json.loads((out / "results.json").read_text())["rows"]] == ["residual-seed0"]


# ----------------------------------------------------------------------------- the remaining claims (issue 28)

NO_DEPTH = [o for o in SMALL if not o.startswith("model.n_layer=")]


def test_the_depth_arms_have_the_depth_and_skips_they_name(tmp_path, data_dir):
    require("matplotlib")
    out = tmp_path / "depth"
    argv = ["depth", "--out", str(out), "--steps", "2", "--seeds", "0", "--arms", "residual-12,no-residual-12"]
    for o in NO_DEPTH + corpus(data_dir):
        argv += ["--set", o]
    assert run(experiment.main, argv) == 0
    for arm, skip in (("residual-12", True), ("no-residual-12", False)):
        saved = json.loads((out / f"{arm}-seed0" / "config.json").read_text())["model"]
        assert (saved["n_layer"], saved["residual"]) == (12, skip)
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["n_layer"] for r in rows] == [12, 12] and all(len(r["grad_init"]) == 13 for r in rows)
    assert all(r["ratio_init"] > 0 for r in rows)
    assert "12 blocks: with residuals" in (out / "results.md").read_text()


def test_the_composition_probe_reads_every_block_and_head(tmp_path, data_dir):
    require("matplotlib")
    out = tmp_path / "composition"
    argv = ["composition", "--out", str(out), "--steps", "3", "--seeds", "0"]
    for o in SMALL + corpus(data_dir):
        argv += ["--set", o]
    assert run(experiment.main, argv) == 0
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert len(row["lens_loss"]) == 3 and all(math.isfinite(v) and v > 0 for v in row["lens_loss"])
    assert len(row["distance"]) == len(row["previous"]) == len(row["lens_top"]) == 2
    for distance, previous in zip(row["distance"], row["previous"]):
        assert len(distance) == len(previous) == 2                                     # n_head 2
        assert all(0 <= d <= 15 for d in distance) and all(0 <= p <= 1 for p in previous)
    table = (out / "results.md").read_text()
    assert "| block 1 |" in table and "| embeddings |" in table
    for band in ("early: syntax and position", "middle: relations", "late: content"):
        assert f"**band {band}: " in table


def test_the_no_norm_probe_names_the_first_skipped_step(tmp_path, data_dir):
    require("matplotlib")
    out = tmp_path / "no-norm"
    argv = ["no-norm", "--out", str(out), "--steps", "2", "--seeds", "0", "--arms", "none-lr3e-3"]
    for o in SMALL + corpus(data_dir):
        argv += ["--set", o]
    assert run(experiment.main, argv) == 0
    run_dir = out / "none-lr3e-3-seed0"
    assert json.loads((run_dir / "config.json").read_text())["model"]["norm_position"] == "none"
    counts = base.probe_counts(run_dir)
    assert counts["first_nonfinite"] is None and counts["params"] > 0 and counts["stream_rms_last"] > 0
    with open(run_dir / "metrics.jsonl", "a") as f:  # what NonFiniteGuard writes for a skipped step
        for step in (7, 8):
            f.write(json.dumps({"step": step, "loss": "nan", "grad_norm": "inf", "skipped": True}) + "\n")
    assert base.probe_counts(run_dir)["first_nonfinite"] == 7
    # a run the guard stopped (max_bad_steps skipped steps last) is finished: reported as diverged, not left out
    config = json.loads((run_dir / "config.json").read_text())
    config["train"]["max_steps"] = 20
    (run_dir / "config.json").write_text(json.dumps(config))
    assert not runs.finished(run_dir)
    with open(run_dir / "metrics.jsonl", "a") as f:
        for step in (9, 10, 11):  # each skipped step, as at a log step, followed by its logged record
            f.write(json.dumps({"step": step, "loss": "nan", "grad_norm": "inf", "skipped": True}) + "\n")
            f.write(json.dumps({"step": step, "loss": "nan", "lr": 1e-3, "grad_norm": "inf"}) + "\n")
    assert runs.finished(run_dir)
    assert run(experiment.main, argv + ["--report-only"]) == 0
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert row["run"] == "none-lr3e-3-seed0" and row["first_nonfinite"] == 7 and row["last_step"] == 11
    assert "Stopped before the end by the non-finite guard: none-lr3e-3-seed0 (at step 11)." in \
        (out / "results.md").read_text()


def _row(arm, val, seed=0, **extra):
    return {"arm": arm, "run": f"{arm}-seed{seed}", "seed": seed, "val_loss": val, "diverged": False,
            "first_nonfinite": None, **extra}


def test_the_new_rules_read_what_they_say():
    s = experiment.EXPERIMENTS["swiglu"].judge

    def seeds(arm, *losses, **extra):  # one row per seed
        return [_row(arm, v, k, **extra) for k, v in enumerate(losses)]

    gelu = seeds("gelu-4x", 5.0, 5.01, params=1000)
    assert s(gelu + seeds("swiglu-8_3x", 5.1, 5.11, params=1004))[0] == "contradicts"  # 0.1 worse in both seeds
    assert s(gelu + seeds("swiglu-8_3x", 5.0, 5.011, params=1004))[0] == "supports"    # within the margin
    assert s(gelu + seeds("swiglu-8_3x", 4.0, 4.01, params=1100))[0] == "leaves open"  # not matched
    one_seed = [_row("gelu-4x", 5.0, params=1000), _row("swiglu-8_3x", 5.5, params=1004)]
    assert s(one_seed)[0] == "leaves open"                                             # no interval
    n = experiment.EXPERIMENTS["no-norm"].judge
    steady = (seeds("pre-lr3e-3", 5.0, 5.01) + seeds("none-lr3e-3", 5.0, 5.01) + seeds("pre-lr3e-2", 5.0, 5.01)
              + seeds("none-lr3e-2", 4.9, 4.91))
    assert n(steady)[0] == "contradicts"
    assert n([r for r in steady if r["seed"] == 0])[0] == "leaves open"                # one seed: no interval
    blown = steady[:6] + [_row("none-lr3e-2", 5.0, 0, first_nonfinite=30) | {"diverged": True},
                          _row("none-lr3e-2", 5.0, 1, first_nonfinite=40) | {"diverged": True}]
    verdict, why, _ = n(blown)
    assert verdict == "supports" and "non-finite from step 30 (seed 0), step 40 (seed 1)" in why
    d = residual.judge_depth

    def depth_rows(res, nores):
        return [{"arm": f"{k}-{n}", "n_layer": n, "ratio_init": v, "ratio_final": v}
                for n in (12, 192) for k, v in (("residual", res), ("no-residual", nores))]

    assert d(depth_rows(0.5, 1e-5))[0] == "supports"
    assert d(depth_rows(1e-4, 1e-5))[0] == "contradicts"
    assert d(depth_rows(0.5, 0.2))[0] == "leaves open"


def test_an_arm_may_have_its_own_budget_which_scale_scales_and_steps_overrides(tmp_path, data_dir):
    exp = experiment.EXPERIMENTS["no-norm"]
    assert runs.arm_steps(exp, "pre-lr3e-3") == exp.steps == 300 and runs.arm_steps(exp, "pre-lr3e-2") == 1000
    assert runs.arm_steps(exp, "none-lr3e-2", scale=0.5) == 500 and runs.arm_steps(exp, "none-lr3e-2", steps=7) == 7
    assert runs.arm_steps(exp, "pre-lr3e-3", scale=1e-9) == 2  # never fewer than 2 steps
    assert "train.max_steps=1000" in runs.budget(1000) and "train.eval_interval=200" in runs.budget(1000)
    require("matplotlib")
    out = tmp_path / "no-norm"  # --scale 0.01: 3 steps at lr 3e-3, 10 at 3e-2, each run as its arm says
    argv = ["no-norm", "--out", str(out), "--scale", "0.01", "--seeds", "0", "--arms", "pre-lr3e-3,pre-lr3e-2"]
    for o in SMALL + corpus(data_dir):
        argv += ["--set", o]
    assert run(experiment.main, argv) == 0
    saved = {a: json.loads((out / f"{a}-seed0" / "config.json").read_text())["train"]
             for a in ("pre-lr3e-3", "pre-lr3e-2")}
    assert [saved[a]["max_steps"] for a in saved] == [3, 10] and saved["pre-lr3e-2"]["eval_interval"] == 2
    assert [r["steps"] for r in json.loads((out / "results.json").read_text())["rows"]] == [3, 10]
    per_step = 2 * 16  # SMALL's batch of 2 x 16 tokens
    assert (f"Budget per run: 3 steps, {3 * per_step} training tokens (pre-lr3e-3); 10 steps, {10 * per_step} "
            "training tokens (pre-lr3e-2); seed 0.") in (out / "results.md").read_text()


def test_the_budget_line_reads_each_runs_config_and_names_the_runs_the_guard_stopped():
    def row(arm, seed, steps, last):
        return {"arm": arm, "run": f"{arm}-seed{seed}", "seed": seed, "steps": steps, "tokens": steps * 2048,
                "losses": [(1, 9.0), (last - last % 50, 6.0)], "last_step": last}  # logged every 50 steps

    same = [row("gelu", 0, 300, 300), row("relu", 0, 300, 300), row("gelu", 1, 300, 300)]
    assert report.budget_line(same) == "Budget: 300 steps, 614,400 training tokens per run; seeds 0, 1.\n"
    # no-norm's first report read the last logged steps of the runs the guard stopped: "Budget: 75, 90, 300 steps"
    mixed = [row("pre-lr3e-3", 0, 300, 300), row("none-lr3e-2", 0, 1000, 215), row("none-lr3e-2", 1, 1000, 1000)]
    line = report.budget_line(mixed)
    assert line.startswith("Budget per run: 300 steps, 614,400 training tokens (pre-lr3e-3); 1000 steps, "
                           "2,048,000 training tokens (none-lr3e-2); seeds 0, 1.")
    assert line.endswith(" Stopped before the end by the non-finite guard: none-lr3e-2-seed0 (at step 215).\n")


def test_the_loss_axis_is_cut_off_only_when_a_run_blew_up():
    require("matplotlib")
    from andrea.run.figure import new_figure

    calm = [{"losses": [(1, 9.0), (300, 5.2)], "vals": [(300, 5.3)]}, {"losses": [(1, 9.1), (300, 15.0)], "vals": []}]
    ax = new_figure("test", (4, 3)).subplots()
    assert report._cut_blown_up(ax, calm) == ""
    blown = calm + [{"losses": [(1, 9.0), (50, 4.0e6), (59, math.nan)], "vals": []}]
    assert report._cut_blown_up(ax, blown) == " (cut off above 18.2)" and ax.get_ylim() == (4.95, 18.2)


def test_a_run_whose_validation_loss_rose_above_its_first_loss_by_more_than_rose_diverged(tmp_path):
    # no-norm at lr 3e-2, seed 1: a validation loss of 304,255 at step 160, back to 7.27 at step 800
    def diverged(vals):
        run_dir = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        run_dir.mkdir()
        records = [{"step": 1, "loss": 9.0}] + [{"step": s, "loss": 7.0, "val_loss": v} for s, v in vals]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return runs.summarise(run_dir, "none-lr3e-2", 1, 0)["diverged"]

    assert diverged([(160, 304255.0), (800, 7.27)])
    assert diverged([(160, 9.0 + runs.ROSE + 0.01), (800, 5.0)])
    assert not diverged([(160, 9.0 + runs.ROSE), (800, 5.0)])   # within ROSE of the first loss: a bump
    assert not diverged([(160, 6.0), (800, 5.0)])
    assert diverged([(160, 6.0), (800, 9.0)])                  # ended no lower than it began
    assert diverged([(160, 6.0), (800, math.nan)])


def test_the_band_rules_read_the_third_each_measure_falls_in():
    row = {"seed": 0, "run": "pre-norm-seed0", "n_layer": 6,
           "previous": [[0.9, 0.1], [0.2, 0.1], [0.1, 0.1], [0.1, 0.0], [0.0, 0.1], [0.1, 0.1]],
           "distance": [[1, 1], [2, 2], [9, 7], [3, 3], [2, 2], [2, 2]],
           "lens_loss": [8.0, 7.9, 7.8, 7.7, 7.6, 6.0, 5.0], "uniform_distance": 4.0, "uniform_previous": 0.2}
    verdicts = {what: v for what, v, _ in _bands([row])}
    assert verdicts == {"band early: syntax and position": "supports", "band middle: relations": "supports",
                        "band late: content": "supports"}
    late_first = dict(row, lens_loss=[8.0, 5.0, 4.9, 4.8, 4.7, 4.6, 4.5], distance=row["distance"][::-1])
    verdicts = {what: v for what, v, _ in _bands([row, late_first | {"seed": 1}])}
    assert verdicts["band late: content"] == "leaves open" and verdicts["band early: syntax and position"] == "supports"
    assert composition.judge_composition([row])[0] == "supports"
    assert composition.judge_composition([dict(row, lens_loss=[8.0, 8.2, 7, 6, 5, 4, 3])])[0] == "contradicts"
    # a model that did not end LEARNED nats under the unigram baseline decides nothing
    learned = dict(row, val_loss=5.5, unigram_baseline=6.683, diverged=False)
    not_yet = dict(learned, val_loss=6.0)
    assert composition.judge_composition([learned])[0] == "supports"
    verdict, why, _ = composition.judge_composition([not_yet])
    assert verdict == "leaves open" and "pre-norm-seed0 did not end 1.0 nats under the unigram baseline" in why
    assert {v for _, v, _ in _bands([not_yet])} == {"leaves open"}
    # attention that has not specialised reads no band (the first runs at the LEARNS budget: every block's
    # mean distance within 7% of uniform attention's, the largest previous-token share 0.06); the old rules
    # read those hundredths as contradicting the early and middle bands
    uniform = dict(learned, previous=[[0.04, 0.04], [0.04, 0.03], [0.05, 0.04], [0.04, 0.06], [0.03, 0.03],
                                      [0.04, 0.04]], distance=[[31.7, 31.6], [30.0, 28.4], [28.6, 29.7],
                                                               [30.6, 32.3], [31.9, 31.5], [33.9, 32.1]],
                   uniform_distance=31.75, uniform_previous=0.035)
    verdicts = {what: (v, why) for what, v, why in _bands([uniform])}
    assert verdicts["band early: syntax and position"][0] == "leaves open"
    assert "under a share of 0.5: attention not specialised" in verdicts["band early: syntax and position"][1]
    assert verdicts["band middle: relations"][0] == "leaves open"
    assert "(1.04 x uniform)" in verdicts["band middle: relations"][1]
    # the lens's drop through block 0 counts from the unigram baseline, not from the embeddings' lens: with
    # that, blocks 0 and 1 lower the loss by 0.5 (6.683 to 6.2) and blocks 4 and 5 by 1.7: late
    lens = dict(uniform, lens_loss=[14.2, 6.5, 6.2, 6.0, 5.9, 5.2, 4.2])
    assert {w: v for w, v, _ in _bands([lens])}["band late: content"] == "supports"
    assert {w: v for w, v, _ in _bands([dict(lens, unigram_baseline=None, val_loss=5.5)])}[
        "band late: content"] == "contradicts"  # from the embeddings' 14.2, block 0 alone drops 7.7
    assert experiment.EXPERIMENTS["swiglu"].judge([_row("gelu-4x", 6.0, params=1000, unigram_baseline=6.683),
                                                  _row("swiglu-8_3x", 5.0, params=1000, unigram_baseline=6.683)])[0] \
        == "leaves open"


def test_a_run_without_layernorm_with_swiglu_resumes_samples_and_traces(tmp_path, data_dir, capsys):
    from andrea import trace

    out = tmp_path / "bare"
    sets = []
    for o in SMALL + corpus(data_dir) + ["model.norm_position=none", "model.activation=swiglu", "train.max_steps=4",
                                        "train.sample_tokens=0", "train.device=cpu", "train.checkpoint_interval=2"]:
        sets += ["--set", o]
    assert run(train.main, ["--out", str(out), "--stop-at-step", "2"] + sets) == 0
    assert run(train.main, ["--out", str(out), "--resume"]) == 0
    saved = json.loads((out / "config.json").read_text())["model"]
    assert (saved["norm_position"], saved["activation"], saved["mlp_dim"]) == ("none", "swiglu", round(8 * 16 / 3))
    model, _, _ = sample.load_model(out)
    assert (model.cfg.norm_position, model.cfg.activation) == ("none", "swiglu")
    assert not [n for n, _ in model.named_parameters() if ".ln_" in n]
    assert run(sample.main, ["--checkpoint", str(out), "--max-new-tokens", "5", "--prompt", "def "]) == 0
    capsys.readouterr()
    assert run(trace.main, ["--checkpoint", str(out), "--prompt", "def f(x):"]) == 0
    printed = capsys.readouterr().out
    assert "ln_1           none (model.norm_position=none" in printed and "block 1" in printed
    assert run(train.main, ["--out", str(tmp_path / "bad")] + sets[:-2] + ["--set", "model.norm_position=off"]) == 2
    assert "model.norm_position must be pre, post or none, got 'off'" in capsys.readouterr().err


def _bands(rows):
    """The composition experiment's band verdicts, (what, verdict, why) each, as its report reads them."""
    return [(what, *judge(rows)[:2]) for what, judge in experiment.EXPERIMENTS["composition"].more]
