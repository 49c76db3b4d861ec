"""docs/architecture.md's recipes followed as written, each seam given a member defined here and
registered in its registry alone, then run as a user runs it (the commands in-process):

- a schedule (a straight-line decay after the warmup) in SCHEDULES: `train --set train.schedule=linear`
  logs its curve, across a resume, and `--dry-run` prints its describe();
- a metrics sink (CSV rows in the run directory) in SINKS: `train --set train.log_to=csv` hands it
  every record metrics.jsonl holds, and it writes their values;
- a record format (tab-separated values, the text in a named column) in FORMATS: `prepare` reads a
  directory of such files, each document whole on one side of the split, and `train` trains on it;
- a norm (LayerNorm without its bias), its maths as two `Ops` methods and its layer a `Norm`, in
  NORMS: `train --set model.norm=biasfree` builds and trains it, and `sample` and `trace` use it;
- a fused GPU kernel: the six files "Add a fused kernel" names are those every piece of
  minitensor/backends/kernels/ is in, each piece with a planted mutation; and in a copy of the project
  a new piece (ReLU(x + b)) added by the recipe's steps alone is refused by the rules until its steps
  are done, then listed, checked, run on the stand-in and chosen by the self-check.

Nothing else of the project is edited for any of them: each test fails if a seam needs more than
its registry (a list read elsewhere, a copy taken at import).
"""

import ast
import contextlib
import csv
import io
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from documents import split_documents
from hypothesis import given, settings
from hypothesis import strategies as st
from runs import run_main, small_config

import minitensor.backends
from andrea import prepare, sample, trace, train
from andrea.cli import run_cli
from andrea.data import stream
from andrea.data.manifest import open_split
from andrea.data.sources import Documents, Unit
from andrea.data.sources.records import FORMATS
from andrea.data.tokenizer import Tokenizer
from andrea.errors import UserError
from andrea.model.block import NORMS
from andrea.run.metrics import read_records
from andrea.run.schedule import SCHEDULES, Cosine, Schedule
from andrea.run.sinks import SINKS, scalars
from minitensor.backends.ops import Ops
from minitensor.backends.tricks import grad_writers
from minitensor.device import to_numpy
from minitensor.layers.layer import Norm

PROMPT = "import json\n"


def call(main, argv):
    """(exit code, stdout, stderr) of a command run in-process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        run_cli(main, argv)
    return e.value.code, out.getvalue(), err.getvalue()


def step_records(out):
    return [r for r in read_records(out / "metrics.jsonl") if "loss" in r and "step" in r]


# ----------------------------------------------------------------------------------------------- a schedule


class LinearDecay(Schedule):
    """After the warmup, a straight line from train.lr down to train.min_lr at train.max_steps."""

    name = "linear"
    settings = (*Schedule.settings, "min_lr")

    def after_warmup(self, step):
        span = max(1, self.max_steps - self.warmup_steps)
        return self.peak + (self.min_lr - self.peak) * min(1.0, (step - self.warmup_steps) / span)

    def describe(self):
        return (f"linear: {self.max_steps:,} steps, {self.warmup_words()}, then a straight line to "
                f"{self.min_lr:g} at step {self.max_steps:,}")


def test_a_schedule_in_SCHEDULES_is_what_train_schedule_runs(tmp_path, data_dir, monkeypatch):
    monkeypatch.setitem(SCHEDULES, "linear", LinearDecay)
    config = small_config(tmp_path, data_dir, max_steps=6, warmup_steps=2, eval_interval=3, checkpoint_interval=3)
    train_settings = SimpleNamespace(lr=3e-3, min_lr=3e-4, warmup_steps=2, max_steps=6)  # small_config's
    expected = [LinearDecay(train_settings).lr(step) for step in range(6)]  # the rate of the update that makes step + 1
    assert expected != [Cosine(train_settings).lr(step) for step in range(6)]

    code, printed, err = call(train.main, ["--config", str(config), "--out", str(tmp_path / "dry"), "--set",
                                           "train.schedule=linear", "--dry-run"])
    assert code == 0, err
    assert re.search(r"^schedule +linear: 6 steps, warmup over 2 steps to lr 0.003, then a straight line to 0.0003 "
                     r"at step 6$", printed, re.MULTILINE), printed

    out = tmp_path / "run"
    assert run_main(["--config", str(config), "--out", str(out), "--set", "train.schedule=linear",
                     "--stop-at-step", "3"]) == 0
    assert run_main(["--out", str(out), "--resume"]) == 0  # the resume compares the class's settings
    rows = step_records(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in rows] == expected
    assert json.loads((out / "config.json").read_text())["train"]["schedule"] == "linear"


# ----------------------------------------------------------------------------------------------- a metrics sink


class CsvSink:
    """csv/metrics.csv in the run directory: a row (step, tag, value) for each finite number of a record
    (andrea.run.sinks.scalars), the value as repr writes it (a float read back is the same float);
    the rows kept until flush, a new run's file started afresh, a resumed run's appended to."""

    name, module, extra, directory = "csv", None, None, "csv"  # no library: the standard library's csv
    opened = []  # the instances, for the test to look at what each was handed

    def __init__(self, out_dir, cfg, start_step):
        self.path, self.received, self.rows = Path(out_dir) / self.directory / "metrics.csv", [], []
        self.path.parent.mkdir(exist_ok=True)
        if not start_step:
            self.rows.append(["step", "tag", "value"])
            self.path.unlink(missing_ok=True)
        CsvSink.opened.append(self)

    def log(self, record):
        self.received.append(record)
        self.rows += [[record["step"], tag, repr(value)] for tag, value in scalars(record).items()]

    def flush(self):
        with open(self.path, "a", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows(self.rows)
        self.rows = []

    def close(self):
        self.flush()


def test_a_sink_in_SINKS_receives_every_record_metrics_jsonl_holds(tmp_path, data_dir, monkeypatch):
    monkeypatch.setitem(SINKS, "csv", CsvSink)
    monkeypatch.setattr(CsvSink, "opened", [])
    config = small_config(tmp_path, data_dir, max_steps=4, eval_interval=2, checkpoint_interval=4)
    out = tmp_path / "run"
    assert run_main(["--config", str(config), "--out", str(out), "--set", "train.log_to=csv"]) == 0
    records = read_records(out / "metrics.jsonl")
    assert [r["step"] for r in step_records(out)] == [1, 2, 3, 4] and any("val_loss" in r for r in records)
    # one sink, handed each record metrics.jsonl holds, in its order, with the same values
    (sink,) = CsvSink.opened
    assert [json.loads(json.dumps(r)) for r in sink.received] == records
    # and what it wrote, read back with csv's own reader
    with open(out / "csv" / "metrics.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "tag", "value"]
    written = [(int(step), tag, float(value)) for step, tag, value in rows[1:]]
    assert written == [(r["step"], tag, float(v)) for r in records for tag, v in scalars(r).items()]
    assert {"loss", "lr", "val_loss"} <= {tag for _, tag, _ in written}
    # its folder is the run's: --overwrite deletes it with the rest, whatever the new run logs to
    assert run_main(["--config", str(config), "--out", str(out), "--overwrite", "--max-steps", "1"]) == 0
    assert not (out / "csv").exists() and [r["step"] for r in step_records(out)] == [1]


# ----------------------------------------------------------------------------------------------- a source


def _unescape(field):
    return re.sub(r"\\(.)", lambda m: {"t": "\t", "n": "\n", "r": "\r"}.get(m[1], m[1]), field)


def _escape(text):
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


class Tsv:
    """Tab-separated values: a header line naming the columns, then one document a line, its text in
    the named column, tab, newline, carriage return and backslash escaped as \\t, \\n, \\r and \\\\.
    A record is a line (numbered from 1, the header holding no document); a blank line is none."""

    @staticmethod
    def scan(path, size, U, progress, text_field=""):
        """Blocks of whole lines, a block starting at the first line that starts at or after the next
        multiple of U; the file read a line at a time."""
        start, first, docs, pos, number = 0, 1, [], 0, 0
        with open(path, "rb") as f:
            for line in f:
                number += 1
                if pos >= (start // U + 1) * U:
                    yield Unit(start, pos, first, np.array(docs, dtype=np.int64), number - first)
                    start, first, docs = pos, number, []
                if number > 1 and line.strip():
                    docs.append(number)
                pos += len(line)
                progress(len(line))
        if pos > start:
            yield Unit(start, pos, first, np.array(docs, dtype=np.int64), number + 1 - first)

    @staticmethod
    def documents(path, start, end, first, count, text_field):
        with open(path, "rb") as f:
            header = f.readline().decode("utf-8").rstrip("\r\n").split("\t")
            f.seek(start)
            raw = f.read(end - start)
        if text_field not in header:
            raise UserError(f"{path}: no column {text_field!r} (its columns: {', '.join(header)})")
        column = header.index(text_field)
        text, valid = stream.decode(raw)
        out = Documents(len(raw), valid)
        for k, line in enumerate(text.split("\n")[:count]):
            if first + k == 1 or not line.strip():
                continue
            fields = line.rstrip("\r").split("\t")
            if len(fields) != len(header):
                raise UserError(f"{path}, line {first + k}: {len(fields)} columns, the header names {len(header)}")
            value = _unescape(fields[column])
            out.records.append(first + k)
            out.texts.append(value)
            out.sizes.append(len(value.encode("utf-8")))
        return out


def write_tsv(path, texts):
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = ["id\ttext\tlang"] + [f"{i}\t{_escape(t)}\ten" for i, t in enumerate(texts)]
    rows.insert(7, "")  # a blank line: no document
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")


def split_texts(data_dir, split):
    """The documents of a split as text: its ids cut at each end-of-text id (every document ends with one)."""
    tok = Tokenizer.load(data_dir / "tokenizer.json")
    ids = np.concatenate([np.asarray(a) for a in open_split(data_dir, split, tok.vocab_size,
                                                            tok.fingerprint()).shards]).tolist()
    assert ids
    return split_documents(tok, ids)


def test_a_record_format_in_FORMATS_prepares_whole_documents_and_trains(tmp_path, data_dir, monkeypatch):
    monkeypatch.setitem(FORMATS, ".tsv", Tsv)
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "json", "import", "return", "café", "\t", "\\", "\n"]
    texts = [f"doc {i}:\t" + " ".join(rng.choice(words, rng.integers(3, 40))) for i in range(240)]
    corpus = tmp_path / "corpus"
    write_tsv(corpus / "a.tsv", texts[:150])
    write_tsv(corpus / "sub" / "b.tsv", texts[150:])
    (corpus / "notes.txt").write_text("not a record\n")  # a directory input takes FORMATS' suffixes alone
    prepared = tmp_path / "data"
    code, _, err = call(prepare.main, ["--input", str(corpus), "--text-field", "text", "--data-dir", str(prepared),
                                        "--tokenizer", str(data_dir / "tokenizer.json"), "--val-fraction", "0.2",
                                        "--quiet"])
    assert code == 0, err
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["files"] == 2 and meta["text_field"] == "text"
    train_docs, val_docs = split_texts(prepared, "train"), split_texts(prepared, "val")
    # every document once, whole (its tabs, newlines and backslashes unescaped), on one side, in order
    assert sorted(train_docs + val_docs) == sorted(texts) and train_docs and val_docs
    assert train_docs == [t for t in texts if t in set(train_docs)]
    assert meta["documents"] == {"train": len(train_docs), "val": len(val_docs)}
    # and training reads it
    config = yaml.safe_load(small_config(tmp_path, data_dir, max_steps=2, eval_interval=2,
                                         checkpoint_interval=2).read_text())
    config["data"] = {"inputs": [str(corpus)], "text_field": "text", "data_dir": str(prepared),
                      "allow_smaller_vocab": True}
    (tmp_path / "tsv.yaml").write_text(yaml.safe_dump(config))
    code, _, err = call(train.main, ["--config", str(tmp_path / "tsv.yaml"), "--out", str(tmp_path / "run")])
    assert code == 0, err
    assert "preparing" not in err  # found, not prepared again
    rows = step_records(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)


# ----------------------------------------------------------------------------------------------- a norm
# LayerNorm without its bias (PaLM's): y = w xhat, xhat = (x - mean) rstd, rstd = 1 / sqrt(var + eps)
#   forward:   mean, var over the row (var biased: divides by C)
#   backward:  dw += sum over rows of dy xhat;  g = w dy, the gradient at xhat;
#              dx = rstd (g - mean(g) - xhat mean(g xhat))  (LayerNorm's: the bias has no path to x)


def biasfree_forward(self, x, w, eps):
    """x (N, C) -> y (N, C), mean and rstd (N, 1)."""
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    rstd = 1.0 / self.xp.sqrt((xc * xc).mean(axis=-1, keepdims=True) + eps)
    return xc * rstd * w, mean, rstd


def biasfree_backward(self, dy, x, mean, rstd, w, dw, dres=None):
    """dx (N, C); dw accumulates; dres (N, C), if given, is added to dx (a skip)."""
    xhat = (x - mean) * rstd
    dw += (dy * xhat).sum(axis=0)
    g = dy * w
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx if dres is None else dx + dres


class BiasFreeLayerNorm(Norm):
    """LayerNorm without its bias, through Ops.biasfree_forward / biasfree_backward."""

    params = ("weight",)
    stats = ("mean", "rstd")

    def __init__(self, w, dw, eps=1e-5, ops=None):
        super().__init__(ops)
        self.w, self.dw, self.eps = w, dw, eps

    def _rows(self, x):
        return self._take_ops(x).xp.ascontiguousarray(x.reshape(-1, x.shape[-1]))

    def forward(self, x):
        x2 = self._rows(x)
        y, mean, rstd = self.ops.biasfree_forward(x2, self.w, self.eps)
        self._save((x2, mean, rstd, x.shape))
        return y.reshape(x.shape)

    def infer_stats(self, x):
        x2 = self._rows(x)
        y, mean, rstd = self.ops.biasfree_forward(x2, self.w, self.eps)
        rows = (*x.shape[:-1], 1)
        return y.reshape(x.shape), {"mean": mean.reshape(rows), "rstd": rstd.reshape(rows)}

    def backward(self, dy, skip=None):
        x2, mean, rstd, shape = self._pop()
        dy2 = self.ops.xp.ascontiguousarray(dy.reshape(x2.shape))
        dres = None if skip is None else skip.reshape(x2.shape)
        return self.ops.biasfree_backward(dy2, x2, mean, rstd, self.w, self.dw, dres).reshape(shape)


@pytest.fixture
def biasfree(monkeypatch):
    """The norm as the recipe adds it: its two Ops methods, its layer in NORMS; the backends built from
    then on (as every one is, the methods being Ops' own) count its writes into dw."""
    monkeypatch.setattr(Ops, "biasfree_forward", biasfree_forward, raising=False)
    monkeypatch.setattr(Ops, "biasfree_backward", biasfree_backward, raising=False)
    monkeypatch.setattr(minitensor.backends, "_ops", {})
    monkeypatch.setitem(NORMS, "biasfree", BiasFreeLayerNorm)
    return BiasFreeLayerNorm


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 4), st.integers(2, 8), st.booleans(), st.integers(0, 2**31 - 1))
def test_the_norms_backward_is_its_forwards_derivative(rows, C, skip, seed):
    """Against central differences in float64, with and without the skip, through a new Ops."""
    rng = np.random.default_rng(seed)
    x, w, r = rng.normal(size=(rows, C)), rng.normal(size=C), rng.normal(size=(rows, C))
    res = rng.normal(size=(rows, C)) if skip else None
    ops = Ops(np)
    layer = BiasFreeLayerNorm(w, np.zeros(C), eps=1e-5, ops=ops)
    ops.biasfree_forward, ops.biasfree_backward = biasfree_forward.__get__(ops), biasfree_backward.__get__(ops)
    layer.forward(x)
    dx = layer.backward(r, skip=res)

    def loss():  # sum(r * y), plus the skip's sum(res * x) where there is one
        return float((r * layer.infer(x)).sum() + (0.0 if res is None else (res * x).sum()))

    for a, analytic in ((x, dx), (w, layer.dw)):
        numeric = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            keep = a[i]
            a[i] = keep + 1e-6
            up = loss()
            a[i] = keep - 1e-6
            numeric[i] = (up - loss()) / 2e-6
            a[i] = keep
        np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-7)


def test_a_norm_in_NORMS_trains_samples_and_traces(tmp_path, data_dir, biasfree):
    assert "biasfree_backward" in grad_writers()  # its dw counted by name, no list extended
    config = small_config(tmp_path, data_dir, max_steps=2, eval_interval=2, checkpoint_interval=2)
    out = tmp_path / "run"
    assert run_main(["--config", str(config), "--out", str(out), "--set", "model.norm=biasfree"]) == 0
    assert [r["step"] for r in step_records(out)] == [1, 2]
    model, tokenizer, _, _ = trace.load_any(out)
    assert model.cfg.norm == "biasfree" and all(type(n) is biasfree for b in model.blocks for n in (b.ln_1, b.ln_2))
    assert type(model.ln_f) is biasfree
    assert model.ops.biasfree_backward.__wrapped__  # the backend counts its writes (tricks.keep_grad_writes)
    # its parameters are the kind's: a weight each, no bias, trained away from 1 through its dw
    norms = {n: v for n, v in model.state_dict().items() if ".ln_" in n}
    assert sorted(norms) == ["transformer.h.0.ln_1.weight", "transformer.h.0.ln_2.weight",
                             "transformer.ln_f.weight"]
    assert all(not np.all(v == 1) for v in norms.values())
    # sampled and traced from the run directory, the trace printing the statistics it has
    code, printed, err = call(sample.main, ["--checkpoint", str(out), "--prompt", PROMPT, "--max-new-tokens", "8"])
    assert code == 0 and printed.startswith(PROMPT), err
    code, printed, err = call(trace.main, ["--checkpoint", str(out), "--prompt", PROMPT])
    assert code == 0 and "logit lens" in printed, err
    line = next(line for line in printed.splitlines() if line.startswith("  ln_1"))
    shown = dict(re.findall(r"(\w+) ([+-]?\d+\.\d+)", line))
    assert list(shown) == ["mean", "rstd"]
    stats = model.trace(np.array([tokenizer.encode(PROMPT)]))[0]["ln_1"]
    for name in ("mean", "rstd"):
        assert float(shown[name]) == pytest.approx(float(to_numpy(stats[name])[0, -1, 0]), abs=1e-4)


# ----------------------------------------------------------------------------------------------- a fused kernel

ROOT = Path(__file__).resolve().parents[2]


def section(title):
    """The text of docs/architecture.md's section `## title`, up to the next."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def mutated_pieces():
    """The (piece, spec) pairs of test_selfcheck's mutations, read from its source."""
    tree = ast.parse((ROOT / "tests" / "gpu" / "test_selfcheck.py").read_text(encoding="utf-8"))
    test = next(n for n in tree.body if getattr(n, "name", "") == "test_a_kernel_made_to_disagree_is_replaced_by_"
                "the_generic_path")
    (cases,) = [d.args[1] for d in test.decorator_list if isinstance(d, ast.Call) and len(d.args) == 2]
    return {tuple(ast.literal_eval(e)[:2]) for e in cases.elts}


def test_every_fused_piece_is_in_the_files_the_recipe_names():
    """The GPU recipe names six files: the kernel (.cu) and its record (.py) under kernels/, the layout's
    `kernels/` entry, kernel_counts.json, test_kernels_fused.py and test_selfcheck.py. Every piece went
    in through them: its two files side by side, its module in the layout, every RawKernel's counts
    kept, its module imported by the tests of its formulas; and each mutation names a piece's own kernel."""
    from minitensor.backends import cuda, fused_pieces

    recipe = section("Add a fused kernel")
    for path in ("minitensor/backends/kernels/", "tests/rules/test_layout.py", "andrea/run/kernel_counts.json",
                 "tests/gpu/test_kernels_fused.py", "tests/gpu/test_selfcheck.py"):
        assert path in recipe, path
    assert "\n6. " in recipe and "\n7. " not in recipe
    layout = section("The layout")
    entry = layout[layout.index("    kernels/"):layout.index("  checks/")]
    counts = json.loads((ROOT / "andrea" / "run" / "kernel_counts.json").read_text())
    fused_tests = ast.parse((ROOT / "tests" / "gpu" / "test_kernels_fused.py").read_text(encoding="utf-8"))
    imported = {a.name for n in fused_tests.body if isinstance(n, ast.ImportFrom)
                and n.module == "minitensor.backends.kernels" for a in n.names}
    pieces = fused_pieces()
    for name, piece in pieces.items():
        module = piece.sample.__module__.rsplit(".", 1)[1]
        assert (cuda.KERNEL_DIR / f"{module}.cu").is_file() and (cuda.KERNEL_DIR / f"{module}.py").is_file(), name
        assert f"{module}.py" in entry, name
        assert {s.name for s in piece.kernels if isinstance(s, cuda.RawSpec)} <= set(counts), name
        assert module in imported, name
    mutated = mutated_pieces()
    assert {name for name, _ in mutated} == set(pieces), set(pieces) - {name for name, _ in mutated}  # step 6
    for name, spec in mutated:  # the spec, an attribute of the piece's module, is one of its kernels
        assert getattr(sys.modules[pieces[name].sample.__module__], spec) in pieces[name].kernels, (name, spec)


# the recipe's piece, as its two new files (steps 1 and 2): ReLU(x + b), which no piece fuses yet
BIAS_RELU_CU = """// ReLU(x + b) over rows of C (fused piece bias_relu).

// @kernel bias_relu_fwd
const T h = x + b[(unsigned int)i % (unsigned int)C];
y = h > (T)0 ? h : (T)0;

// @kernel bias_relu_bwd
dh = x + b[(unsigned int)i % (unsigned int)C] > (T)0 ? dy : (T)0;
"""

BIAS_RELU_PY = '''"""ReLU(x + b) on the GPU: the kernels of kernels/bias_relu.cu, their wrappers and the fused piece
bias_relu's record."""

import numpy as np

from minitensor.backends import cuda
from minitensor.backends.cuda import draw


def _h(x, b, C):
    return x + b[np.arange(x.size) % int(C)]


BIAS_RELU_FWD = cuda.ElementwiseSpec("bias_relu_fwd", "T x, raw T b, int32 C", "T y", "bias_relu.cu",
                                     reference=lambda x, b, C: np.maximum(_h(x, b, C), 0.0), scalars=(("C", 7),))
BIAS_RELU_BWD = cuda.ElementwiseSpec("bias_relu_bwd", "T x, raw T b, int32 C, T dy", "T dh", "bias_relu.cu",
                                     reference=lambda x, b, C, dy: np.where(_h(x, b, C) > 0, dy, 0.0),
                                     scalars=(("C", 7),))


def bias_relu_forward_gpu(x, b):
    return BIAS_RELU_FWD.kernel()(x, b, np.int32(x.shape[-1]))


def bias_relu_backward_gpu(x, b, dy):
    return BIAS_RELU_BWD.kernel()(x, b, np.int32(x.shape[-1]), dy)


def _fused_bias_relu_forward(ops, x, b):
    if x.dtype.name not in BIAS_RELU_FWD.dtypes:
        return cuda.FALLBACK
    return bias_relu_forward_gpu(x, b)


def _fused_bias_relu_backward(ops, x, b, dy, recompute_output=False):
    if recompute_output or x.dtype.name not in BIAS_RELU_BWD.dtypes:
        return cuda.FALLBACK
    return bias_relu_backward_gpu(x, b, dy)


def _bias_relu_sample(ops, rng):
    xp = ops.xp
    x, b, dy = draw(xp, rng, 30, 9), draw(xp, rng, 9), draw(xp, rng, 30, 9)
    return ops.bias_relu_forward(x, b), ops.bias_relu_backward(x, b, dy)


def _bias_relu_timed(ops, sizes):
    xp = ops.xp
    x, b, dy = cuda.normals(xp, sizes.N, sizes.F), cuda.normals(xp, sizes.F), cuda.normals(xp, sizes.N, sizes.F)
    return lambda: (ops.bias_relu_forward(x, b), ops.bias_relu_backward(x, b, dy))


BIAS_RELU = cuda.fused_piece(
    "bias_relu",
    replaces={"bias_relu_forward": _fused_bias_relu_forward, "bias_relu_backward": _fused_bias_relu_backward},
    kernels=(BIAS_RELU_FWD, BIAS_RELU_BWD),
    sample=_bias_relu_sample,
    timed=_bias_relu_timed,
)
'''

# steps 3, 5 and 6, each an edit of the file the recipe names: (path, text after which, text added)
RECIPE_EDITS = (
    ("docs/architecture.md", "                       adamw.py", " bias_relu.py"),
    ("tests/gpu/test_kernels_fused.py", "from minitensor.backends.kernels import adamw, attention,",
     " bias_relu,"),
    ("tests/gpu/test_kernels_fused.py", "def test_a_new_piece_is_its_record_alone(monkeypatch):", ""),
    ("tests/gpu/test_selfcheck.py", '@pytest.mark.parametrize("piece, spec, wrong", [\n',
     '    ("bias_relu", "BIAS_RELU_BWD", ("? dy : (T)0", "? (T)0 : dy")),\n'),
)

# step 5's test, added at the end of test_kernels_fused.py
FORMULA_TEST = '''

@needs_cxx
@pytest.mark.parametrize("spec", [bias_relu.BIAS_RELU_FWD, bias_relu.BIAS_RELU_BWD])
def test_bias_relu_against_its_formula(spec):
    for dtype in ("float64", "float32"):
        assert kernelcheck.host_check(spec, dtype).ok, (spec.name, dtype)
'''

# run in the copy after the edits: the piece is listed, bound, self-checked and chosen, on the stand-in
RUN_THE_PIECE = """
import numpy as np
from minitensor.backends import cupy_ops, fused_pieces, selection
assert "bias_relu" in fused_pieces()
import cupy
ops = cupy_ops.CupyOps(cupy, fused=("bias_relu",))
x, b = cupy.asarray(np.array([[-1.0, 2.0], [0.5, -3.0]], np.float32)), cupy.asarray(np.array([0.25, 0.5], np.float32))
cupy.standin.reset()
assert cupy.asnumpy(ops.bias_relu_forward(x, b)).tolist() == [[0.0, 2.5], [0.75, 0.0]]
assert {name for _, name, _ in cupy.standin.kernels} == {"bias_relu_fwd"}
fused, line = selection.select_kernels("auto", cupy, {"bias_relu": fused_pieces()["bias_relu"].sample})
print(line)
assert fused == ("bias_relu",), line
"""


def copy_of_the_project(to):
    """The project's files as a checkout has them (what git tracks: no virtual environment, run or cache)."""
    import shutil

    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache", "*.egg-info")
    for folder in (".ci", "andrea", "configs", "docs", "minitensor", "scripts", "tests"):
        shutil.copytree(ROOT / folder, to / folder, ignore=skip)
    for name in (".gitignore", "BENCHMARKS.md", "README.md", "pyproject.toml"):
        shutil.copy2(ROOT / name, to / name)


@pytest.mark.slow
def test_the_recipe_followed_literally_adds_a_fused_piece(tmp_path):
    """In a copy of the project, a new piece (ReLU(x + b), two ElementwiseKernels: no RawKernel, so step
    4's counts do not apply) added by the recipe's steps and nothing else: its two files, then the layout
    entry, the formula test and the self-check's mutation. With only the two files the rules refuse it (the
    layout does not name it; it has no mutation); with the steps done the rules and its tests pass, it is
    listed, CupyOps runs its kernel on the stand-in and the self-check chooses it; and no other file of the
    copy differs from the project's."""
    import subprocess

    from minitensor.checks.standin import standin_env

    repo = tmp_path / "repo"
    in_copy = standin_env()  # the copy's code alone on the path (the stand-in's too, for the run below)
    in_copy["PYTHONPATH"] = str(repo)
    copy_of_the_project(repo)
    kernels = repo / "minitensor" / "backends" / "kernels"
    (kernels / "bias_relu.cu").write_text(BIAS_RELU_CU)
    (kernels / "bias_relu.py").write_text(BIAS_RELU_PY)
    rules = ["tests/rules/test_layout.py",
             "tests/e2e/test_recipes.py::test_every_fused_piece_is_in_the_files_the_recipe_names"]

    def pytest_in_copy(*args):
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                               "-o", "addopts=", *args], cwd=repo, capture_output=True, text=True,
                              env=in_copy, timeout=600)

    before = pytest_in_copy(*rules)
    assert before.returncode == 1, before.stdout[-3000:]
    assert "bias_relu.py" in before.stdout, before.stdout[-3000:]
    assert "FAILED tests/rules/test_layout.py::test_layout_names_every_module" in before.stdout
    assert "FAILED tests/e2e/test_recipes.py::test_every_fused_piece_is_in_the_files_the_recipe_names" in before.stdout
    for path, after, added in RECIPE_EDITS:
        text = (repo / path).read_text(encoding="utf-8")
        assert text.count(after) == 1, (path, after)
        (repo / path).write_text(text.replace(after, after + added), encoding="utf-8")
    with open(repo / "tests" / "gpu" / "test_kernels_fused.py", "a", encoding="utf-8") as f:
        f.write(FORMULA_TEST)
    done = pytest_in_copy(*rules, "tests/gpu/test_kernels_fused.py", "tests/gpu/test_selfcheck.py", "-rp", "-k",
                          "bias_relu or recipe_names or layout or module")
    assert done.returncode == 0 and "failed" not in done.stdout, done.stdout[-3000:]
    for test in ("test_layout_names_every_module", "test_every_fused_piece_is_in_the_files_the_recipe_names",
                 "test_bias_relu_against_its_formula[spec1]", "made_to_disagree_is_replaced_by_the_generic_path[bias_relu",
                 "test_every_pieces_timed_run_runs_with_the_piece_and_without[bias_relu]"):
        assert any(line.startswith("PASSED") and test in line for line in done.stdout.splitlines()), test
    ran = subprocess.run([sys.executable, "-c", RUN_THE_PIECE], cwd=repo, capture_output=True, text=True,
                         env={**in_copy, "PYTHONPATH": f"{repo / 'minitensor/checks/cupy_standin'}:{repo}"},
                         timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "bias_relu" in ran.stdout
    named = {"minitensor/backends/kernels/bias_relu.cu", "minitensor/backends/kernels/bias_relu.py",
             "docs/architecture.md", "tests/gpu/test_kernels_fused.py", "tests/gpu/test_selfcheck.py"}
    made_by_runs = {"__pycache__", ".hypothesis", ".pytest_cache"}
    changed = {str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file() and not made_by_runs & set(p.parts)
               and (not (ROOT / p.relative_to(repo)).is_file()
                    or (ROOT / p.relative_to(repo)).read_bytes() != p.read_bytes())}
    assert changed == named, changed ^ named
