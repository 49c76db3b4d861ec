"""The per-run figures a --doc page keeps beside it (andrea.experiments.runfile): written with the
section, judged again by --from-doc at full precision, read back when seeds are added to a page whose
first runs are gone, refused when they and the page disagree; and docs/experiments.md's SwiGLU
interval recomputed from the file it keeps."""

import json
import shutil
from pathlib import Path

import pytest
from optional import require

from andrea import experiment
from andrea.cli import run_cli
from andrea.config import load_config
from andrea.experiments import base, page, paired, runfile, runs

ROOT = Path(__file__).resolve().parents[2]
GELU, SWIGLU = "gelu-4x", "swiglu-8_3x"


def run(argv):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(experiment.main, argv)
    return exit_info.value.code


def built_runs(out, losses, data_dir, steps=2):
    """Finished swiglu runs in out, as andrea.train leaves them, ending at the given final validation
    losses ({arm: {seed: loss}}): config.json, metrics.jsonl and a log each."""
    exp = experiment.EXPERIMENTS["swiglu"]
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for arm, by_seed in losses.items():
        for seed, loss in by_seed.items():
            run_dir = out / f"{arm}-seed{seed}"
            run_dir.mkdir()
            config = load_config("tiny", runs.arm_sets(exp, arm, seed, steps, [f"data.data_dir={data_dir}"]))
            (run_dir / "config.json").write_text(json.dumps(config.to_dict()))
            records = [{"step": 1, "loss": 9.0}] + [{"step": s, "loss": loss + 0.1} for s in range(2, steps)] + [
                {"step": steps, "loss": loss + 0.1, "val_loss": loss}]
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            (out / "logs" / f"{run_dir.name}.log").write_text(f"done: step {steps} in {60 + seed:.1f} s\n")


def new_page(doc):
    (glance_begin, glance_end), (begin, end) = page.markers(page.GLANCE), page.markers("swiglu")
    doc.write_text(f"# Claims\n\n{glance_begin}\n{page.GLANCE_HEAD}{glance_end}\n\n## SwiGLU\n\n{begin}\n{end}\n\n"
                   "The prose after it.\n")


def claim_line(text):
    return next(x for x in text.splitlines() if x.startswith("**claim: "))


def rows_of(losses):
    return [{"run": f"{a}-seed{s}", "arm": a, "seed": s, "val_loss": v, "diverged": False}
            for a, by_seed in losses.items() for s, v in by_seed.items()]


# four decimals, so that the tables' three give another interval than the runs' figures
FULL = {GELU: {0: 5.2041, 1: 5.2064, 2: 5.1905}, SWIGLU: {0: 5.5444, 1: 5.3163, 2: 5.2386}}


def test_the_page_keeps_each_runs_figures_and_from_doc_judges_them_at_full_precision(tmp_path, data_dir, capsys):
    require("matplotlib")
    out, doc = tmp_path / "swiglu", tmp_path / "doc.md"
    built_runs(out, FULL, data_dir)
    new_page(doc)
    assert run(["swiglu", "--out", str(out), "--report-only", "--doc", str(doc)]) == 0
    kept_path = tmp_path / "experiments" / "swiglu-runs.json"
    kept = runfile.read(doc, "swiglu", [GELU, SWIGLU])
    assert {r["run"]: r["val_loss"] for r in kept} == {r["run"]: r["val_loss"] for r in rows_of(FULL)}
    assert json.loads(kept_path.read_text())["command"] == \
        f"python -m andrea.experiment swiglu --out {out} --report-only --doc {doc}"
    full = paired.paired(kept, GELU, SWIGLU)
    printed = paired.paired(rows_of({a: {s: round(v, 3) for s, v in by.items()} for a, by in FULL.items()}),
                            GELU, SWIGLU)
    assert paired.short(full) != paired.short(printed)  # so that which figures were read shows
    written = doc.read_text()
    line = claim_line(written)
    assert f"mean {paired.signed(full.mean)}, 95% t-interval [{paired.signed(full.lo)}, {paired.signed(full.hi)}]" \
        in line and f"SwiGLU 8/3 - GELU 4x: {paired.short(full)}, margin 0.05 |" in written
    # the runs gone: judged again from the kept figures, the same verdict to the character
    shutil.rmtree(out)
    assert run(["swiglu", "--from-doc", str(doc)]) == 0
    again = doc.read_text()
    assert claim_line(again) == line
    assert "judged again from the per-run figures kept in experiments/swiglu-runs.json (full precision" in again
    # the file and the page disagreeing is one line, and the page is left as it was
    good = kept_path.read_text()
    for edited, message in [
            (good.replace("5.2064", "5.2164"), "run gelu-4x-seed1 prints a final val loss of 5.206 (diverged: no), "),
            (good.replace(",\n" + good.splitlines()[-2], ""), "hold different runs (swiglu-8_3x-seed2 in one"),
            (good.replace('"diverged": false', '"diverged": "no"', 1), "its run 0 is not an object with run, arm"),
            (good[:-5], "cannot be read back: it is not JSON"),
            (good.replace('"experiment": "swiglu"', '"experiment": "norm"'),
             'not an object with "experiment": "swiglu"')]:
        kept_path.write_text(edited)
        assert run(["swiglu", "--from-doc", str(doc)]) == 2, message
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err, (message, err)
        assert doc.read_text() == again
    # without the file, the tables as printed: the other interval
    kept_path.unlink()
    assert run(["swiglu", "--from-doc", str(doc)]) == 0
    tables = doc.read_text()
    assert f"SwiGLU 8/3 - GELU 4x: {paired.short(printed)}, margin 0.05 |" in tables
    assert "judged again from the per-run figures in the tables above (as printed)" in tables


def test_seeds_added_to_a_page_whose_runs_are_gone_are_judged_with_its_figures(tmp_path, data_dir, capsys):
    require("matplotlib")
    first, doc = tmp_path / "first", tmp_path / "doc.md"
    built_runs(first, FULL, data_dir)
    new_page(doc)
    assert run(["swiglu", "--out", str(first), "--report-only", "--doc", str(doc)]) == 0
    # a page written before its runs' figures were kept: its tables only, the runs gone
    shutil.rmtree(first)
    (tmp_path / "experiments" / "swiglu-runs.json").unlink()
    more = {GELU: {3: 5.2101, 4: 5.1987}, SWIGLU: {3: 5.3012, 4: 5.2519}}
    out = tmp_path / "swiglu"
    built_runs(out, more, data_dir)
    capsys.readouterr()
    assert run(["swiglu", "--out", str(out), "--report-only", "--doc", str(doc)]) == 0
    assert f"swiglu: {', '.join(f'{a}-seed{s}' for s in range(3) for a in (GELU, SWIGLU))} not in --out: their " \
           f"figures are {doc}'s" in capsys.readouterr().err
    text = doc.read_text()
    assert "Budget: 2 steps" in text and "; seeds 0, 1, 2, 3, 4." in text
    assert "Not in --out, so read from the page this report is written into: gelu-4x-seed0, swiglu-8_3x-seed0, " \
           "gelu-4x-seed1, swiglu-8_3x-seed1, gelu-4x-seed2, swiglu-8_3x-seed2, from its tables as printed" in text
    # seeds 0 to 2 as the tables printed them, 3 and 4 at full precision: ten runs, five differences
    printed = {a: {s: round(v, 3) for s, v in by.items()} for a, by in FULL.items()}
    five = paired.paired(rows_of({a: {**printed[a], **more[a]} for a in (GELU, SWIGLU)}), GELU, SWIGLU)
    assert five.seeds == [0, 1, 2, 3, 4]
    assert f"SwiGLU 8/3 - GELU 4x: {paired.short(five)}, margin 0.05 |" in text
    kept = runfile.read(doc, "swiglu", [GELU, SWIGLU])
    assert [r.get("from") for r in kept] == ["table"] * 6 + [None] * 4
    # the tables counted steps to a train loss of 5.65, these runs' target is 5.45: no step for the first runs
    assert [r["steps_to_target"] for r in kept] == ["not kept"] * 6 + [2] * 4
    assert "steps to train loss 5.45" in text and "| gelu-4x-seed0 | 5.204 | " in text
    line = claim_line(text)
    assert run(["swiglu", "--from-doc", str(doc)]) == 0 and claim_line(doc.read_text()) == line
    # a third session: seed 0 trained again replaces the page's seed 0; the kept rows of 1 and 2 stay
    rerun = tmp_path / "rerun"
    built_runs(rerun, {GELU: {0: 5.2041}, SWIGLU: {0: 5.5444}}, data_dir)
    assert run(["swiglu", "--out", str(rerun), "--report-only", "--doc", str(doc)]) == 0
    kept = {r["run"]: r for r in runfile.read(doc, "swiglu", [GELU, SWIGLU])}
    assert kept["gelu-4x-seed0"]["val_loss"] == 5.2041 and "from" not in kept["gelu-4x-seed0"]
    assert kept["gelu-4x-seed1"]["from"] == "table" and kept["gelu-4x-seed3"]["from"] == "page"
    assert "gelu-4x-seed3, swiglu-8_3x-seed3, gelu-4x-seed4, swiglu-8_3x-seed4, from the figures kept beside it " \
           "(experiments/swiglu-runs.json)" in doc.read_text()
    # runs of another budget are not added to the page's
    before = doc.read_text()
    other = tmp_path / "other"
    built_runs(other, {GELU: {5: 5.2}, SWIGLU: {5: 5.3}}, data_dir, steps=3)
    capsys.readouterr()
    assert run(["swiglu", "--out", str(other), "--report-only", "--doc", str(doc)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "its run gelu-4x-seed0, which --out does not hold, had another budget (2 steps" in err
    assert doc.read_text() == before


def claim_line_from_doc(tmp_path, doc, name):
    """The claim line `NAME --from-doc` writes into a copy of the page beside a copy of its kept figures."""
    (tmp_path / "experiments").mkdir()
    shutil.copy(doc, tmp_path / "experiments.md")
    shutil.copy(runfile.path_of(doc, name), tmp_path / "experiments" / f"{name}-runs.json")
    assert run([name, "--from-doc", str(tmp_path / "experiments.md")]) == 0
    again = (tmp_path / "experiments.md").read_text()
    return claim_line(again[again.index(page.markers(name)[0]):])


def test_the_pages_swiglu_interval_is_recomputed_from_its_kept_figures(tmp_path):
    """docs/experiments.md's SwiGLU verdict, from docs/experiments/swiglu-runs.json: by hand with
    andrea.experiments.paired, and by --from-doc on a copy of the page (the same line to the character)."""
    doc = ROOT / "docs" / "experiments.md"
    kept = runfile.read(doc, "swiglu", [GELU, SWIGLU])
    assert kept is not None, "docs/experiments/swiglu-runs.json is missing"
    iv = paired.paired(kept, GELU, SWIGLU)
    text = doc.read_text()
    line = claim_line(text[text.index(page.markers("swiglu")[0]):])
    assert iv.n == len(kept) // 2 and iv.seeds == sorted({r["seed"] for r in kept})  # every seed paired
    assert f"mean {paired.signed(iv.mean)}, 95% t-interval [{paired.signed(iv.lo)}, {paired.signed(iv.hi)}]" in line
    assert f"**claim: {paired.no_worse(iv, base.NO_WORSE.nats)}**" in line
    assert f"| `swiglu` | {paired.no_worse(iv, base.NO_WORSE.nats)} | SwiGLU 8/3 - GELU 4x: {paired.short(iv)}, " \
           "margin 0.05 |" in text
    assert claim_line_from_doc(tmp_path, doc, "swiglu") == line


def test_the_pages_mlp_ratio_intervals_are_recomputed_from_its_kept_figures(tmp_path):
    """docs/experiments.md's mlp-ratio verdict, from docs/experiments/mlp-ratio-runs.json (ten seeds): each
    gain and the slowdown by hand with andrea.experiments.paired, and by --from-doc on a copy of the page."""
    arms = ["ratio-1", "ratio-2", "ratio-4", "ratio-8"]
    doc = ROOT / "docs" / "experiments.md"
    kept = runfile.read(doc, "mlp-ratio", arms)
    assert kept is not None, "docs/experiments/mlp-ratio-runs.json is missing"
    assert sorted({r["seed"] for r in kept}) == list(range(10)) and len(kept) == 40
    text = doc.read_text()
    line = claim_line(text[text.index(page.markers("mlp-ratio")[0]):])
    gains = [paired.paired(kept, b, a, "") for a, b in zip(arms, arms[1:])]
    slowdown = paired.contrast(kept, {"ratio-2": 1, "ratio-4": -2, "ratio-8": 1}, "")
    for iv in (*gains, slowdown):
        assert iv.n == 10 and iv.lo > 0, iv  # every interval above 0: the rule supports
        assert f"mean {paired.signed(iv.mean)}, 95% t-interval [{paired.signed(iv.lo)}, {paired.signed(iv.hi)}]" in line
    assert line.startswith("**claim: supports**")
    assert claim_line_from_doc(tmp_path, doc, "mlp-ratio") == line
