"""andrea.plot: loss against tokens seen from a run's metrics.jsonl, the unigram baseline of its data,
several runs on one figure, and one-line errors for missing or empty metrics."""

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from optional import require

from andrea import plot
from andrea.cli import run_cli
from andrea.config import build_config
from andrea.data.tokenizer import Tokenizer
from andrea.errors import UserError


def fake_run(tmp_path, name, records, batch_size=4, seq_len=16, baseline=6.5):
    """A run directory as andrea.train leaves it, and its data directory with meta.json."""
    data_dir = tmp_path / f"data-{name}"
    data_dir.mkdir()
    tok = Tokenizer([(104, 105)])  # "hi": 258 ids, enough for a fingerprint
    (data_dir / "meta.json").write_text(json.dumps({"tokenizer_fingerprint": tok.fingerprint(),
                                                    "unigram_val_nats": baseline}))
    run = tmp_path / name
    run.mkdir()
    cfg = build_config({"model": {"vocab_size": 258, "context_length": 32, "d_model": 8, "n_layer": 1, "n_head": 1},
                        "train": {"batch_size": batch_size, "seq_len": seq_len},
                        "data": {"data_dir": str(data_dir)}})
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    tok.save(run / "tokenizer.json")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


RECORDS = [
    {"step": 1, "loss": 9.0}, {"step": 2, "loss": 8.0, "val_loss": 8.5},
    {"step": 3, "loss": "nan", "skipped": True}, {"step": 3, "loss": 7.0}, {"step": 4, "loss": 6.0, "val_loss": 6.2},
    {"step": 4, "loss": 5.5, "val_loss": 6.0},  # a resumed run repeats step 4: the later record wins
]


def test_read_run_gives_loss_against_tokens_and_the_baseline(tmp_path):
    run = fake_run(tmp_path, "a", RECORDS)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "lo')  # killed while writing its last line
    curves = plot.read_run(run)
    assert curves.train == [(64, 9.0), (128, 8.0), (192, 7.0), (256, 5.5)]
    assert curves.val == [(128, 8.5), (256, 6.0)]
    assert curves.baseline == 6.5


def test_several_runs_on_one_figure(tmp_path):
    require("matplotlib")
    a = fake_run(tmp_path, "a", RECORDS)
    b = fake_run(tmp_path, "b", RECORDS[:2], batch_size=8, baseline=7.0)
    fig = plot.draw([plot.read_run(a), plot.read_run(b)])
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["a train", "a validation", "a unigram baseline 6.50",
                      "b train", "b validation", "b unigram baseline 7.00"]
    np.testing.assert_array_equal(ax.get_lines()[3].get_xdata(), [128, 256])  # b's batch is twice a's
    assert [t.get_text() for t in ax.get_legend().get_texts()] == labels
    out = tmp_path / "loss.png"
    with pytest.raises(SystemExit) as e:
        run_cli(plot.main, [str(a), str(b), "--out", str(out)])
    assert e.value.code == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_or_empty_metrics_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(UserError, match="metrics.jsonl does not exist"):
        plot.read_run(tmp_path / "nowhere")
    run = fake_run(tmp_path, "empty", [])
    with pytest.raises(SystemExit) as e:
        run_cli(plot.main, [str(run)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and "holds no loss yet" in err and err.count("\n") == 1
    (run / "metrics.jsonl").write_text("not json\n{}\n")
    with pytest.raises(UserError, match="line 1 is not JSON"):
        plot.read_run(run)


def test_after_training_says_where_or_why_not(tmp_path, monkeypatch):
    require("matplotlib")
    run = fake_run(tmp_path, "a", RECORDS)
    assert plot.plot_after_training(run) == f"loss plot: {run / 'loss.png'}"
    assert (run / "loss.png").stat().st_size > 1000
    assert plot.plot_after_training(tmp_path / "nowhere").startswith("warning: no loss plot: ")
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if not installed
    assert "pip install -e '.[plot]'" in plot.plot_after_training(run)


def test_a_line_cut_short_by_a_full_disk_is_skipped_wherever_it_is(tmp_path, monkeypatch):
    """metrics.jsonl's own writer, given a full disk once, leaves a cut line in the middle of the file."""
    from andrea.run import metrics as run_metrics
    run = fake_run(tmp_path, "a", [])
    real, calls = run_metrics._write, []

    def full_once(fd, data):
        calls.append(1)
        return real(fd, data[:10]) if len(calls) == 2 else real(fd, data)

    monkeypatch.setattr(run_metrics, "_write", full_once)
    metrics = run_metrics.JsonlSink(run / "metrics.jsonl")
    for record in ({"step": 1, "loss": 9.0}, {"step": 2, "loss": 8.0}, {"step": 3, "loss": 7.0}):
        metrics.log(record)
        metrics.flush()
    metrics.close()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert lines[1] == '{"step": 2' and len(lines) == 3  # the cut line, ended before the next one
    assert plot.read_run(run).train == [(64, 9.0), (192, 7.0)]


@pytest.mark.parametrize("where", ["missing directory", "a directory", "bad flag"])
def test_plot_refuses_a_bad_out_in_one_line_before_drawing(tmp_path, capsys, where):
    run = fake_run(tmp_path, "a", RECORDS)
    argv = {"missing directory": [str(run), "--out", str(tmp_path / "nowhere" / "loss.png")],
            "a directory": [str(run), "--out", str(tmp_path)],
            "bad flag": [str(run), "--outt", "x.png"]}[where]
    with pytest.raises(SystemExit) as e:
        run_cli(plot.main, argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert ".tmp" not in err and "usage:" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "data-a"]


def unwritable_directory(tmp_path):
    """A directory in which no file can be created: one without write permission, or, for root (whom
    permissions do not stop), sysfs, which refuses new files to everyone."""
    mine = tmp_path / "read-only"
    mine.mkdir()
    mine.chmod(0o555)
    for d in (mine, Path("/sys")):
        try:
            tempfile.NamedTemporaryFile(dir=d).close()
        except OSError:
            return d
    pytest.skip("no directory here refuses new files")


@pytest.mark.parametrize("grad_flow", [False, True])
def test_plot_into_a_directory_it_cannot_write_is_refused_before_drawing(tmp_path, capsys, monkeypatch, grad_flow):
    # issue 30, class 4: it drew the figure first and then failed writing it, exit 1
    from andrea.run import gradflow

    run = fake_run(tmp_path, "a", RECORDS)
    target = unwritable_directory(tmp_path)

    def drawing(*args, **kwargs):
        raise AssertionError("drew a figure it cannot write")

    monkeypatch.setattr(plot, "draw", drawing)
    monkeypatch.setattr(gradflow, "draw_flow", drawing)
    with pytest.raises(SystemExit) as e:
        run_cli(plot.main, [str(run), "--out", str(target / "loss.png")] + (["--grad-flow"] if grad_flow else []))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: --out {target / 'loss.png'} cannot be written") \
        and err.count("\n") == 1, err


def test_plot_replaces_only_a_figure_it_drew(tmp_path, capsys):
    require("matplotlib")
    run = fake_run(tmp_path, "a", RECORDS)
    out = tmp_path / "figure.png"
    for existing in (b"my own notes", b"\x89PNG\r\n\x1a\n someone else's image"):
        out.write_bytes(existing)
        with pytest.raises(SystemExit) as e:
            run_cli(plot.main, [str(run), "--out", str(out)])
        assert e.value.code == 2 and "not a figure drawn by andrea.plot" in capsys.readouterr().err
        assert out.read_bytes() == existing
    out.unlink()
    for _ in range(2):  # the second time over its own figure
        with pytest.raises(SystemExit) as e:
            run_cli(plot.main, [str(run), "--out", str(out)])
        assert e.value.code == 0 and plot.drawn_here(out)
    (run / "loss.png").write_bytes(b"an older run's figure")  # the run's own directory: replaced
    assert plot.plot_after_training(run) == f"loss plot: {run / 'loss.png'}" and plot.drawn_here(run / "loss.png")


@pytest.mark.parametrize("tool", ["andrea.plot", "andrea.experiment"])
def test_without_matplotlib_a_tool_that_draws_says_which_extra_to_install(tool, monkeypatch):
    from andrea.run.figure import new_figure, require_matplotlib

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` meets when it is absent
    for ask in (lambda: require_matplotlib(tool), lambda: new_figure(tool, figsize=(4, 3))):
        with pytest.raises(UserError, match=rf"^{tool} needs matplotlib: pip install -e '\.\[plot\]'$"):
            ask()
