"""What a new user meets first (issue 20, class 9): the sampler says what it loaded, the benchmark
shows only what it measured and keeps each result file, a one-point curve can be seen."""

import json
import subprocess
import sys

from optional import require
from runs import ROOT, run_main, small_config

from andrea import bench
from andrea.plot import Curves, draw


def test_sample_says_which_checkpoint_and_step_it_loaded(tmp_path, data_dir):
    out = tmp_path / "run"
    assert run_main(["--config", str(small_config(tmp_path, data_dir, max_steps=2)), "--out", str(out)]) == 0
    run = subprocess.run([sys.executable, "-m", "andrea.sample", "--checkpoint", str(out), "--prompt", "import ",
                          "--max-new-tokens", "3"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert f"sampling from {out / 'ckpt-00000002'} (step 2)" in run.stderr
    assert run.stdout.startswith("import ")  # the text alone on stdout


RESULT = {"config": "tiny", "batch": 16, "seq_len": 128, "tokens_per_s_median": 9000.0, "tokens_per_s_min": 8000.0,
          "tokens_per_s_max": 9500.0, "mfu": 0.3, "peak_rss_bytes": 2**29,
          "split_s": {"forward": 0.05, "backward": 0.1, "optimizer": 0.01}}


def test_bench_without_torch_prints_no_torch_columns(capsys):
    bench.print_table([RESULT])
    table = capsys.readouterr().out
    assert "nan" not in table and "torch" not in table
    bench.print_table([dict(RESULT, torch={"tokens_per_s_median": 4500.0, "peak_rss_bytes": 2**30})])
    table = capsys.readouterr().out
    assert "torch tok/s" in table and "2.00" in table and "nan" not in table


def test_bench_components_alone_keeps_the_plain_benchmarks_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench.json").write_text('[{"config": "tiny"}]')
    monkeypatch.setattr(bench, "_components", lambda repeats: {"gelu": {"andrea": 1.0}})
    assert bench.main(["--components"]) == 0
    assert json.loads((tmp_path / "bench.json").read_text()) == [{"config": "tiny"}]
    assert json.loads((tmp_path / "bench-components.json").read_text()) == [{"components": {"gelu": {"andrea": 1.0}}}]


def test_a_run_of_one_logged_step_is_a_visible_point():
    require("matplotlib")
    fig = draw([Curves("one step", train=[(2048, 9.0)])])
    (line,) = fig.axes[0].lines
    assert line.get_marker() not in ("", "None", None) and line.get_markersize() > 0


def test_pytest_q_says_which_backends_ran(tmp_path):
    one_test = "tests/app/test_cli.py::test_shipped_configs_load_and_match_the_spec"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", one_test],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "andrea backends: numpy" in run.stdout
