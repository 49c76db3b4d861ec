"""No traceback, and no file lost, from any entry point for any input: train, sample, prepare, params,
export, plot, trace and eval.

Hypothesis generates values for every config key (read from the config dataclasses, so keys added
later are covered without editing this file) and every flag: numbers of every sign, NaN, the
infinities, huge values, wrong types (lists, mappings, null in YAML), empty and non-UTF-8
strings, and paths of every kind (a file, a directory, a missing path, a path under a file, the
root, the empty string) including directories that already hold something: a training run, a data
directory, a Hugging Face model (andrea's export), a broken one, a user's own config.json. Each
entry point runs in-process (train through --dry-run, so nothing is trained or prepared) and must
either succeed or print `error: ...` as its last line and exit 2; any other exception fails the
test with the input that caused it. And it must leave every file it did not create as it was
(`nothing_lost`): only an export may replace the earlier export it made, only plot a figure it drew.
The number of examples is fixed (CASES), so the runtime stays bounded; each test prints how many
it drew.
"""

import contextlib
import io
import json
import os
import shutil
from dataclasses import fields
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from optional import require
from runs import STDLIB_JSON, run_main, small_config

from andrea import eval as evaluation
from andrea import export, params, plot, prepare, sample, trace, train
from andrea.cli import run_cli
from andrea.config import SECTIONS, section_keys
from andrea.data.preparation import prepare as prepare_data
from andrea.run import rundir

CASES = {"train": 140, "sample": 60, "prepare": 50, "params": 60, "export": 40, "plot": 40, "trace": 40, "eval": 40}
KEYS = [f"{section}.{key}" for section, cls in SECTIONS.items() for key in section_keys(cls)]

NUMBERS = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.integers(min_value=-3, max_value=40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63), 1e308, -1e-308, float("nan"), float("inf")]),
)
# no NUL anywhere: neither argv nor the environment can carry one
NON_UTF8 = st.binary(max_size=8).map(lambda b: (b"\xff" + b.replace(b"\0", b"")).decode("utf-8", "surrogateescape"))
TEXT = st.one_of(st.just(""), st.text(max_size=12).map(lambda s: s.replace("\0", "")), NON_UTF8,
                 st.sampled_from(["nan", "inf", "-inf", "1e999", "-1", "0", "1e9", "true", "cpu", "gpu", "auto",
                                  "tpu", "cuda", "a,b", "=", "x=y", "1.5"]))


def flag_values(paths):
    """Strings as a shell would pass them: numbers written out, text, and paths."""
    return st.one_of(NUMBERS.map(str), TEXT, st.sampled_from(paths))


def yaml_values():
    """Values a YAML config can hold for a key: scalars of every type, lists, mappings, null."""
    scalar = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=8))
    return st.one_of(scalar, st.lists(scalar, max_size=3), st.dictionaries(st.text(max_size=4), scalar, max_size=2))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Paths of every kind, a prepared data directory and a trained run to sample from."""
    root = tmp_path_factory.mktemp("world")
    data = root / "data"
    prepare_data([str(STDLIB_JSON)], data, allow_smaller_vocab=True, progress=False)
    run = root / "run"
    cfg = small_config(root, data, max_steps=2)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert run_main(["--config", str(cfg), "--out", str(run)]) == 0
    a_file = root / "a_file.txt"
    a_file.write_text("def f(x):\n    return x\n" * 50)
    (root / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (root / "empty.txt").write_text("")
    (root / "dir").mkdir()
    (root / "dir" / "t.txt").write_text("hello world\n" * 40)
    (root / "latin1.yaml").write_bytes(b"model:\n  d_model: 6\xe9\n")
    (root / "syntax.yaml").write_text("model:\n  d_model: 64\n   n_layer: [\n")
    (root / "list.yaml").write_text("- 1\n- 2\n")
    (root / "keys.yaml").write_text("1: 2\nmodel: {3: 4}\n")
    (root / "corrupt_run").mkdir()
    (root / "corrupt_run" / "config.json").write_text('{"model": {"d_model": "x"')
    hf_dir, broken_hf, mine = root / "hf", root / "hf_broken", root / "mine"
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        run_cli(export.main, ["--checkpoint", str(run), "--out", str(hf_dir)])
    shutil.copytree(hf_dir, broken_hf)
    config = json.loads((broken_hf / "config.json").read_text())
    (broken_hf / "config.json").write_text(json.dumps(dict(config, n_layer=1.5)))
    (broken_hf / rundir.MARKER).unlink()  # as transformers would leave it: not andrea's export
    mine.mkdir()
    (mine / "config.json").write_text('{"my": "own settings"}')
    (mine / "notes.txt").write_text("mine")
    paths = [str(p) for p in (
        root, data, run, sorted(run.glob("ckpt-*"))[0], a_file, a_file / "under_a_file", root / "missing",
        root / "missing" / "deeper", root / "binary.bin", root / "empty.txt", root / "dir", root / "dir" / "*.txt",
        root / "latin1.yaml", root / "syntax.yaml", root / "list.yaml", root / "keys.yaml", root / "corrupt_run",
        run / "config.json", cfg, hf_dir, broken_hf, mine, mine / "config.json", run / "loss.png",
    )] + ["/", "", ".", "tiny", "120m", "huge"]
    return {"root": root, "data": data, "run": run, "cfg": cfg, "paths": paths, "n": 0}


def call(main, argv, env_device=None):
    """Runs an entry point as its __main__ does; returns (exit code, stderr). Other exceptions propagate."""
    err, out = io.StringIO(), io.StringIO()
    old = os.environ.pop("ANDREA_DEVICE", None)
    if env_device is not None:
        os.environ["ANDREA_DEVICE"] = env_device
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
            run_cli(main, argv)
    finally:
        os.environ.pop("ANDREA_DEVICE", None)
        if old is not None:
            os.environ["ANDREA_DEVICE"] = old
    return info.value.code, err.getvalue()


def entries_under(root):
    """{path: (size, mtime, inode)} of every file and directory under `root` (directories as None):
    a change, a replacement or a deletion of a file shows."""
    found = {}
    for directory, dirs, names in os.walk(root):
        found.update({os.path.join(directory, d): None for d in dirs})
        for name in names:
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                found[path] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return found


@contextlib.contextmanager
def nothing_lost(world, argv, may_change=()):
    """The files of the world are as they were after the block, but those under a `may_change` path
    (the command's own earlier output). A command may create files (its output): they are removed
    after the check, so that every example meets the same world."""
    before = entries_under(world["root"])
    yield
    after = entries_under(world["root"])
    allowed = tuple(str(p) for p in may_change if str(p))
    changed = [p for p, st in before.items() if after.get(p, "gone") != st and not p.startswith(allowed)]
    assert not changed, f"{argv!r} changed or deleted files it did not create: {changed[:5]}"
    for path in sorted(set(after) - set(before)):
        if os.path.dirname(path) in before or os.path.dirname(path) == str(world["root"]):
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)


def own_output(main, argv):
    """The earlier output of export or plot that this call may replace: its --out when that command made it."""
    out = argv[argv.index("--out") + 1] if "--out" in argv[:-1] else None
    if out and main is export.main and Path(out).is_dir() and rundir.kind_of(out) == "export":
        return [out]
    if out and main is plot.main and Path(out).is_file() and plot.drawn_here(out):
        return [out]
    if out and main is trace.main and (Path(out) / trace.FIGURE).is_file():
        return [str(Path(out) / trace.FIGURE)]  # refused unless andrea.trace drew it
    return []


def check_outcome(code, err, argv):
    assert code in (0, None, 2), f"exit {code} for {argv!r}:\n{err}"
    if code == 2:
        last = err.strip().splitlines()[-1] if err.strip() else ""
        assert last.startswith("error: "), f"no one-line error for {argv!r}:\n{err}"
        assert "Traceback" not in err


def run_property(name, strategy, check):
    """Draws CASES[name] examples of `strategy` into `check`; returns how many were drawn."""
    drawn = []

    @settings(max_examples=CASES[name], deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(strategy)
    def prop(example):
        drawn.append(1)
        check(example)

    prop()
    print(f"\n{name}: {len(drawn)} cases drawn")
    return len(drawn)


def test_train_dry_run_never_tracebacks(world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default data/ and out/ are relative: keep them in here
    paths = world["paths"]
    flags = {"--max-steps": flag_values(paths), "--stop-at-step": flag_values(paths), "--seed": flag_values(paths),
             "--device": flag_values(paths), "--out": st.sampled_from(paths), "--config": st.sampled_from(paths),
             "--init-from": st.sampled_from(paths + [str(world["root"] / "hf")] * 4)}
    strategy = st.fixed_dictionaries({
        "yaml": st.dictionaries(st.sampled_from(KEYS), yaml_values(), max_size=4),
        "sets": st.lists(st.tuples(st.sampled_from(KEYS), flag_values(paths)), max_size=4),
        "raw_sets": st.lists(TEXT, max_size=1),
        "flags": st.dictionaries(st.sampled_from(sorted(flags)), st.none(), max_size=3).flatmap(
            lambda chosen: st.fixed_dictionaries({k: flags[k] for k in chosen})),
        "resume": st.booleans(),
        "overwrite": st.booleans(),
        "env": st.one_of(st.none(), TEXT),
    })
    base = yaml.safe_load(Path(world["cfg"]).read_text())

    def check(ex):
        world["n"] += 1
        cfg = {s: dict(v) for s, v in base.items()}
        for key, value in ex["yaml"].items():
            section, name = key.split(".")
            cfg[section][name] = value
        path = tmp_path / f"c{world['n']}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        argv = ["--config", str(path), "--out", str(tmp_path / f"out{world['n']}")]
        for flag, value in ex["flags"].items():
            argv += [flag, value]
        for key, value in ex["sets"]:
            argv += ["--set", f"{key}={value}"]
        for raw in ex["raw_sets"]:
            argv += ["--set", raw]
        argv += ["--resume"] * ex["resume"] + ["--overwrite"] * ex["overwrite"] + ["--dry-run"]
        with nothing_lost(world, argv):
            code, err = call(train.main, argv, ex["env"])
        check_outcome(code, err, argv)

    assert run_property("train", strategy, check) >= CASES["train"] // 2


def test_sample_never_tracebacks(world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = world["paths"]
    strategy = st.fixed_dictionaries({
        "--checkpoint": st.sampled_from(paths + [str(world["run"])] * 3),
        "--prompt": st.one_of(TEXT, st.text(max_size=40).map(lambda s: s.replace("\0", ""))),
        # generation time grows with this one: huge values are legal but slow, so they are only negative here
        "--max-new-tokens": st.one_of(st.integers(-(10**30), 6).map(str), TEXT),
        "--temperature": flag_values(paths),
        "--top-k": flag_values(paths),
        "--seed": flag_values(paths),
    }, optional={"--device": flag_values(paths), "--top-p": flag_values(paths)})
    strategy = st.tuples(strategy, st.one_of(st.none(), TEXT))

    def check(ex):
        flags, env = ex
        argv = [x for flag, value in flags.items() for x in (flag, value)]
        with nothing_lost(world, argv):
            code, err = call(sample.main, argv, env)
        check_outcome(code, err, argv)

    assert run_property("sample", strategy, check) >= CASES["sample"] // 2


def test_prepare_never_tracebacks(world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = world["root"]
    # every draw names --input: the default corpus (the whole stdlib) would take minutes to prepare
    inputs = [str(p) for p in (root / "a_file.txt", root / "dir", root / "dir" / "*.txt", root / "binary.bin",
                               root / "empty.txt", root / "missing", root / "a_file.txt" / "x")] + ["", "*"]
    counter = iter(range(10**9))
    strategy = st.fixed_dictionaries({
        "--input": st.lists(st.one_of(st.sampled_from(inputs), NON_UTF8), min_size=1, max_size=2),
        "--data-dir": st.one_of(st.sampled_from(world["paths"]), st.just("fresh"), NON_UTF8),
    }, optional={"--vocab-size": flag_values(world["paths"]), "--val-fraction": flag_values(world["paths"]),
                 "--allow-smaller-vocab": st.none(), "--force": st.none(),
                 "--tokenizer": st.sampled_from(world["paths"] + [str(root / "hf"), str(root / "hf" / "tokenizer.json"),
                                                                  str(world["data"])])})

    def check(ex):
        argv = ["--quiet"]
        for flag, value in ex.items():
            if flag == "--data-dir" and value == "fresh":
                value = str(tmp_path / f"d{next(counter)}")
            argv += [flag] + ([] if value is None else value if isinstance(value, list) else [value])
        data_dir = argv[argv.index("--data-dir") + 1]
        # what a data directory keeps when prepare refuses is the data work's test (andrea.prepare):
        # here every file outside the given --data-dir must stay as it was
        with nothing_lost(world, argv, may_change=[data_dir]):
            code, err = call(prepare.main, argv)
        check_outcome(code, err, argv)

    assert run_property("prepare", strategy, check) >= CASES["prepare"] // 2


def test_params_never_tracebacks(world):
    paths = world["paths"]
    strategy = st.tuples(st.one_of(st.sampled_from(paths), TEXT),
                         st.lists(st.tuples(st.sampled_from(KEYS), flag_values(paths)), max_size=3))

    def check(ex):
        config, sets = ex
        argv = [config] + [x for key, value in sets for x in ("--set", f"{key}={value}")]
        with nothing_lost(world, argv):
            code, err = call(params.main, argv)
        check_outcome(code, err, argv)

    assert run_property("params", strategy, check) >= CASES["params"] // 2


def test_export_never_tracebacks_nor_overwrites(world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = [p for p in world["paths"] if p != "/"]  # "/" is writable here (root): never export into it
    counter = iter(range(10**9))
    strategy = st.fixed_dictionaries({
        "--checkpoint": st.sampled_from(paths + [str(world["run"])] * 4),
        "--out": st.sampled_from(paths + ["fresh"] * 4),
    }, optional={"--bogus": st.none()})

    def check(ex):
        argv = []
        for flag, value in ex.items():
            value = str(tmp_path / f"e{next(counter)}") if value == "fresh" else value
            argv += [flag] + ([] if value is None else [value])
        with nothing_lost(world, argv, may_change=own_output(export.main, argv)):
            code, err = call(export.main, argv)
        check_outcome(code, err, argv)

    assert run_property("export", strategy, check) >= CASES["export"] // 2


def test_plot_never_tracebacks_nor_overwrites(world, tmp_path, monkeypatch):
    require("matplotlib")
    monkeypatch.chdir(tmp_path)
    paths = world["paths"]
    counter = iter(range(10**9))
    strategy = st.fixed_dictionaries({
        "runs": st.lists(st.sampled_from(paths + [str(world["run"])] * 4), min_size=1, max_size=2),
        "--out": st.sampled_from(paths + ["fresh"] * 4),
    }, optional={"--bogus": st.none()})

    def check(ex):
        out = str(tmp_path / f"p{next(counter)}.png") if ex["--out"] == "fresh" else ex["--out"]
        argv = [*ex["runs"], "--out", out] + (["--bogus"] if "--bogus" in ex else [])
        with nothing_lost(world, argv, may_change=own_output(plot.main, argv)):
            code, err = call(plot.main, argv)
        check_outcome(code, err, argv)

    assert run_property("plot", strategy, check) >= CASES["plot"] // 2


def test_trace_never_tracebacks_nor_overwrites(world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = world["paths"]
    counter = iter(range(10**9))
    strategy = st.fixed_dictionaries({
        "--checkpoint": st.sampled_from(paths + [str(world["run"])] * 4 + [str(world["root"] / "hf")] * 2),
        "--prompt": st.one_of(TEXT, st.text(max_size=40).map(lambda s: s.replace("\0", ""))),
    }, optional={"--position": flag_values(paths), "--top-k": flag_values(paths), "--device": flag_values(paths),
                 "--out": st.sampled_from([p for p in paths if p != "/"] + ["fresh"] * 2)})

    def check(ex):
        argv = []
        for flag, value in ex.items():
            argv += [flag, str(tmp_path / f"t{next(counter)}") if value == "fresh" else value]
        with nothing_lost(world, argv, may_change=own_output(trace.main, argv)):
            code, err = call(trace.main, argv)
        check_outcome(code, err, argv)

    assert run_property("trace", strategy, check) >= CASES["trace"] // 2


def test_eval_never_tracebacks(world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = world["paths"]
    texts = [p for p in paths if p != "/"]  # "/" as --input would read the whole file system
    sizes = st.one_of(st.integers(-3, 40).map(str), TEXT)  # each window costs a forward: small ones only
    strategy = st.fixed_dictionaries({
        "model": st.sampled_from(paths + [str(world["run"])] * 4 + [str(world["root"] / "hf")] * 2),
        "text": st.one_of(st.tuples(st.just("--data-dir"), st.sampled_from(paths + [str(world["data"])] * 4)),
                          st.tuples(st.just("--input"), st.sampled_from(texts))),
    }, optional={"--seq-len": sizes, "--batch-size": sizes, "--max-tokens": sizes, "--split": TEXT,
                 "--device": flag_values(paths)})

    def check(ex):
        argv = [ex.pop("model"), *ex.pop("text")] + [x for flag, value in ex.items() for x in (flag, value)]
        with nothing_lost(world, argv):
            code, err = call(evaluation.main, argv)
        check_outcome(code, err, argv)

    assert run_property("eval", strategy, check) >= CASES["eval"] // 2


def test_the_keys_come_from_the_config_classes():
    assert {"model.d_model", "model.mlp_ratio", "train.lr", "train.device", "data.inputs"} <= set(KEYS)
    assert len(KEYS) == sum(len(fields(c)) for c in SECTIONS.values()) + 1  # and mlp_ratio, an argument


def test_every_path_kind_in_every_path_flag(world, tmp_path, monkeypatch):
    """The paths deterministically, each in each place a path goes (the property tests draw among them)."""
    monkeypatch.chdir(tmp_path)
    n = 0
    for path in world["paths"]:
        for main, argv in (
            (params.main, [path]),
            (train.main, ["--config", path, "--dry-run"]),
            (train.main, ["--config", str(world["cfg"]), "--out", path, "--dry-run"]),
            (train.main, ["--config", str(world["cfg"]), "--out", path, "--resume", "--dry-run"]),
            (train.main, ["--config", str(world["cfg"]), "--set", f"data.data_dir={path}", "--dry-run"]),
            (sample.main, ["--checkpoint", path, "--max-new-tokens", "2"]),
            (prepare.main, ["--input", str(world["root"] / "dir"), "--data-dir", path, "--quiet"]),
            (prepare.main, ["--input", path, "--data-dir", str(tmp_path / f"d{n}"), "--quiet"]),
            (prepare.main, ["--input", str(world["root"] / "dir"), "--data-dir", str(tmp_path / f"t{n}"),
                            "--tokenizer", path, "--quiet"]),
            (train.main, ["--config", str(world["cfg"]), "--init-from", path, "--out", str(tmp_path / f"i{n}"),
                          "--dry-run"]),
            (export.main, ["--checkpoint", path, "--out", str(tmp_path / f"x{n}")]),
            (export.main, ["--checkpoint", str(world["run"]), "--out", path]),
            (plot.main, [path, "--out", str(tmp_path / f"p{n}.png")]),
            (plot.main, [str(world["run"]), "--out", path]),
            (trace.main, ["--checkpoint", path, "--prompt", "import"]),
            (trace.main, ["--checkpoint", str(world["run"]), "--prompt", "import", "--out", path]),
            (evaluation.main, [path, "--data-dir", str(world["data"]), "--max-tokens", "40"]),
            (evaluation.main, [str(world["run"]), "--data-dir", path, "--max-tokens", "40"]),
            (evaluation.main, [str(world["run"]), "--input", path, "--max-tokens", "40"]),
        ):
            if (main is trace.main and argv[-1] == "/") or (main is evaluation.main and argv[1:3] == ["--input", "/"]):
                continue  # a figure written into "/" (writable here: root), or the whole file system read as text
            if main is export.main and argv[3] == "/":
                continue  # writable here (root): never export into it
            if main is prepare.main and argv[1] in ("", ".", "/", str(world["root"])):
                continue  # a whole tree as a corpus: legal, but minutes of tokenizer training
            n += 1
            mine = [argv[3]] if main is prepare.main else own_output(main, argv)
            with nothing_lost(world, argv, may_change=mine):
                code, err = call(main, argv)
            check_outcome(code, err, argv)
    print(f"\npaths: {n} cases")

