"""Bits per byte, in training's log and in andrea.eval, recomputed here from first principles: the
nats of every target from the model's logits in float64, over ln 2 x the bytes of text those
targets stand for, counted from the text itself (the data directory's recorded byte count, or
the tokens' bytes joined). andrea.eval reads every token once, gives the same figures from a data
directory and from the same text as files, and the same bytes of text under another tokenizer.
"""

import contextlib
import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from runs import tiny_run

from andrea import eval as evaluation
from andrea.cli import run_cli
from andrea.config import ModelConfig
from andrea.data.loader import iter_eval_batches
from andrea.data.manifest import open_split
from andrea.data.tokenizer import load_tokenizer
from andrea.model.transformer import ANDREA

LINE = re.compile(r"loss (\S+) nats/token \| (\S+) bits/byte \| ([\d,]+) tokens predicted \(([\d,]+) bytes of text\) "
                  r"in ([\d,]+) windows of up to (\d+)")


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir):
    return tiny_run(tmp_path_factory.mktemp("eval"), data_dir, steps=4)


def call(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        run_cli(evaluation.main, argv)
    return e.value.code, out.getvalue(), err.getvalue()


def figures(out):
    m = LINE.search(out)
    assert m, out
    loss, bpb = float(m[1]), float(m[2])
    return loss, bpb, *(int(m[i].replace(",", "")) for i in (3, 4, 5, 6))


def val_ids(data_dir):
    tok = load_tokenizer(data_dir / "tokenizer.json")
    shards = open_split(data_dir, "val", tok.vocab_size, tok.fingerprint())
    return tok, shards.windows(np.array([0]), len(shards))[0]


def nats_by_hand(model, ids, T):
    """The summed cross-entropy of ids[1:] in consecutive windows of T, from float64 log-softmax."""
    total = 0.0
    for s in range(0, len(ids) - 1, T):
        x, y = ids[s:s + T], ids[s + 1:s + T + 1]
        z = np.float64(model.logits(np.array([x[:len(y)]]))[0])
        lse = z.max(-1) + np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1))
        total += float((lse - z[np.arange(len(y)), y]).sum())
    return total


def test_a_splits_bytes_of_text_are_the_bytes_prepare_read(data_dir):
    tok, ids = val_ids(data_dir)
    meta = json.loads((data_dir / "meta.json").read_text())
    assert int(tok.text_bytes()[ids].sum()) == meta["val_bytes"]  # the corpus is UTF-8: text and file agree
    assert tok.text_bytes()[tok.eot_id] == 0 and tok.eot_id in ids


def test_eval_counts_every_token_once_in_nats_and_bits_per_byte(run, data_dir):
    code, out, err = call([str(run), "--data-dir", str(data_dir)])
    assert code == 0, err
    loss, bpb, targets, text_bytes, windows, T = figures(out)
    tok, ids = val_ids(data_dir)
    model, *_ = evaluation.load_any(run)
    assert T == 32 and targets == len(ids) - 1 and windows == math.ceil((len(ids) - 1) / T)
    meta = json.loads((data_dir / "meta.json").read_text())
    assert text_bytes == meta["val_bytes"] - len(tok.token_bytes(int(ids[0])))  # all but the first token's
    nats = nats_by_hand(model, ids, T)
    assert loss == pytest.approx(nats / targets, abs=6e-5)
    assert bpb == pytest.approx(nats / (math.log(2) * text_bytes), abs=6e-5)
    # the same text given as files: the same ids, the same figures
    files = [str(Path(meta["root"]) / name) for name in meta["val_file_names"]]
    code, again, err = call([str(run), "--input", *files])
    assert code == 0 and LINE.search(again)[0] == LINE.search(out)[0], err
    # a shorter window and a cap on the tokens: still every target once, its own bytes
    code, short, _ = call([str(run), "--data-dir", str(data_dir), "--seq-len", "7", "--max-tokens", "300",
                           "--batch-size", "5"])
    loss7, bpb7, targets7, bytes7, windows7, _ = figures(short)
    assert code == 0 and targets7 == 299 and windows7 == math.ceil(299 / 7)
    assert bytes7 == len(b"".join(tok.token_bytes(int(i)) for i in ids[1:300] if i != tok.eot_id))
    assert loss7 == pytest.approx(nats_by_hand(model, ids[:300], 7) / 299, abs=6e-5)


def test_another_tokenizer_reads_the_same_text_and_bytes(run, data_dir, tmp_path):
    """A GPT-2 directory whose tokenizer is not the data's: the split is decoded and encoded again."""
    from test_hf import STDLIB_JSON, foreign_tokenizer

    V = foreign_tokenizer(tmp_path, [p.read_text() for p in sorted(STDLIB_JSON.glob("*.py"))], 300)
    model = ANDREA(ModelConfig(vocab_size=V, context_length=24, d_model=16, n_layer=1, n_head=2), seed=2)
    model.save_pretrained(tmp_path)
    code, out, err = call([str(tmp_path), "--data-dir", str(data_dir)])
    assert code == 0, err
    assert "re-encoded" in err and "Hugging Face GPT-2" in err
    loss, bpb, targets, text_bytes, _, T = figures(out)
    theirs = load_tokenizer(tmp_path)
    _, ids = val_ids(data_dir)
    meta = json.loads((data_dir / "meta.json").read_text())
    text = (Path(meta["root"]) / meta["val_file_names"][0]).read_text()
    mine = theirs.encode(text) + [theirs.eot_id]
    assert T == 24 and targets == len(mine) - 1 != len(ids) - 1
    assert text_bytes == meta["val_bytes"] - len(theirs.token_bytes(mine[0]))
    assert bpb == pytest.approx(loss * targets / (math.log(2) * text_bytes), rel=1e-3)


def test_training_logs_bits_per_byte_of_the_targets_it_evaluated(run, data_dir):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_loss" in r]
    assert evals and all("val_bpb" in r for r in evals)
    tok, ids = val_ids(data_dir)
    n, nbytes = 0, 0
    for _, y in iter_eval_batches(ids, 4, 32, 2):  # the run's batch, seq_len and eval_batches
        n += y.size
        nbytes += sum(len(b"".join(tok.token_bytes(int(i)) for i in row if i != tok.eot_id)) for row in y)
    last = evals[-1]
    assert last["val_bpb"] == pytest.approx(last["val_loss"] * n / (math.log(2) * nbytes), rel=1e-12)
    summary = (run.parent / "train.out").read_text().splitlines()
    done = next(line for line in summary if line.startswith("done:"))
    assert f"val loss {last['val_loss']:.4f} ({last['val_bpb']:.4f} bits/byte, step 4)" in done
    assert f"val loss {last['val_loss']:.4f} ({last['val_bpb']:.4f} bits/byte)" in "\n".join(summary)


@pytest.mark.parametrize("flags, message", [
    ([], "give exactly one of --data-dir DIR and --input FILES"),
    (["--data-dir", "D", "--input", "x"], "give exactly one of --data-dir DIR and --input FILES"),
    (["--data-dir", "D", "--seq-len", "0"], "--seq-len must be a positive whole number"),
    (["--data-dir", "D", "--seq-len", "33"], "--seq-len 33 exceeds the model's context length 32"),
    (["--data-dir", "RUN"], "holds no complete prepared data"),
    (["--input", "A", "--max-tokens", "1"], "the text is 1 token(s): at least 2 are needed"),
    (["--input", "MISSING"], "MISSING"),
])
def test_bad_requests_are_one_line_errors(run, data_dir, tmp_path, flags, message):
    (tmp_path / "a.txt").write_text("hello world, hello world\n")
    paths = {"D": str(data_dir), "RUN": str(run), "A": str(tmp_path / "a.txt"), "MISSING": str(tmp_path / "nope")}
    code, out, err = call([str(run)] + [paths.get(f, f) for f in flags])
    message = message.replace("MISSING", paths["MISSING"])
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1 and out == "", err
