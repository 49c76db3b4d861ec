"""A data directory that kills, a second preparation, damage, permissions, links and dry runs do not
corrupt or misjudge (issue 30, classes 1-5 and 7): one finished state honoured by every entry point,
a lock, shards checked against their headers and checksums, splits that hold text, the permissions
each operation needs, `**` globs that do not follow links, and a dry run that checks what the run does.

Each preparation encodes with a small tokenizer trained once per module (`tok_path`), so it takes a
fraction of a second; the commands run in-process through the shared shell (andrea/cli.py).
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from runs import small_config
from test_prepare_scale import all_ids, lines, make_corpus, snapshot
from together import started_together

from andrea import prepare, train
from andrea.cli import run_cli
from andrea.config import load_config
from andrea.data import preparation, shards
from andrea.data.inputs import resolve_inputs
from andrea.data.tokenfile import HEADER_SIZE, TokenSink, open_tokens, read_token_header
from andrea.data.tokenizer import Tokenizer
from andrea.errors import UserError


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    tok = Tokenizer.train([lines(np.random.default_rng(0), 200_000)], vocab_size=600, allow_smaller=True)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(path)
    return path


def cli(main, argv, capsys):
    """(exit code, stderr) of a command run through the shared shell."""
    with pytest.raises(SystemExit) as info:
        run_cli(main, argv)
    return info.value.code, capsys.readouterr().err


def one_line(err):
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def prepared(tmp_path, tok_path, name="d", n_files=6, **kwargs):
    corpus = tmp_path / "c" if (tmp_path / "c").exists() else make_corpus(tmp_path / "c", n_files, 20_000)
    out = tmp_path / name
    meta = preparation.prepare([str(corpus)], out, progress=False, tokenizer=tok_path, **kwargs)
    return corpus, out, meta


def train_config(corpus, out):
    """The tiny config on this corpus and data directory, as `train` prepares it."""
    return load_config("tiny", [f"data.inputs={corpus}", f"data.data_dir={out}", "data.allow_smaller_vocab=true"])


# ----------------------------------------------------------------------------- class 1: one finished state


def test_a_kill_between_the_state_and_the_manifest_is_finished_by_prepare_and_train(tmp_path, tok_path, monkeypatch):
    """All shards written and recorded in prepare-state.json, killed before meta.json: the next
    prepare (or train, which prepares) writes the manifest, equal to an uninterrupted run's."""
    corpus, whole, expected = prepared(tmp_path, tok_path, "whole", shard_tokens=20_000)
    write = preparation.write_json

    def killed_before_the_manifest(path, obj):
        if path.name == "meta.json":
            raise KeyboardInterrupt
        write(path, obj)

    for entry in ("prepare", "train"):
        out = tmp_path / entry
        monkeypatch.setattr(preparation, "write_json", killed_before_the_manifest)
        with pytest.raises(KeyboardInterrupt):
            preparation.prepare([str(corpus)], out, progress=False, tokenizer=tok_path, shard_tokens=20_000)
        monkeypatch.setattr(preparation, "write_json", write)
        state = json.loads((out / shards.STATE_FILE).read_text())
        assert state["next_block"] == state["settings"]["blocks"] and not (out / "meta.json").exists()
        if entry == "prepare":
            meta = preparation.prepare([str(corpus)], out, progress=False, tokenizer=tok_path, shard_tokens=20_000)
        else:  # train's own preparation: its default shard size is another setting, so it starts again
            train.prepare_data(train_config(corpus, out))
            meta = json.loads((out / "meta.json").read_text())
        assert not (out / shards.STATE_FILE).exists()
        assert meta["train_tokens"] == expected["train_tokens"] and meta["val_tokens"] == expected["val_tokens"]
        if entry == "prepare":
            assert meta["shards"] == expected["shards"]


def test_a_kill_between_the_manifest_and_removing_the_state_leaves_a_complete_directory(tmp_path, tok_path,
                                                                                       monkeypatch):
    """meta.json written, prepare-state.json not yet removed: complete for prepare and train, and
    prepare --force re-encodes it from the start, deleting no shard it then lacks."""
    write, states = shards.write_json, []
    monkeypatch.setattr(shards, "write_json", lambda path, obj: states.append(json.dumps(obj)) or write(path, obj))
    corpus, killed, expected = prepared(tmp_path, tok_path, "killed", shard_tokens=20_000)
    (killed / shards.STATE_FILE).write_text(states[-1])  # as the kill left it
    assert json.loads(states[-1])["next_block"] == expected["blocks"]
    for entry in ("prepare", "prepare --force", "train"):
        out = tmp_path / entry.replace(" ", "")
        shutil.copytree(killed, out)
        if entry == "train":
            tok, train_ids, _ = train.prepare_data(train_config(corpus, out))
            assert len(train_ids) == expected["train_tokens"]
            continue
        meta = preparation.prepare([str(corpus)], out, progress=False, tokenizer=tok_path, shard_tokens=20_000,
                                   force=entry.endswith("--force"))
        assert meta["skipped"] == (entry == "prepare") and meta["shards"] == expected["shards"]
        if not meta["skipped"]:
            assert not (out / shards.STATE_FILE).exists()
        for e in meta["shards"]["train"] + meta["shards"]["val"]:
            assert open_tokens(out / e["file"]).size == e["tokens"]


def test_a_complete_directory_keeps_its_split_whatever_fraction_is_asked(tmp_path, tok_path, capsys):
    """Prepared at a validation fraction of 0.2: a train that leaves data.val_fraction unset uses the
    directory as it is (not the default 0.01's split), one that asks for another fraction is refused
    with the real reason, by the dry run and the run alike, and the directory is not touched; only
    prepare --force with the new fraction re-encodes it."""
    corpus, out, meta = prepared(tmp_path, tok_path, val_fraction=0.2)
    before = snapshot(out)
    tok, train_ids, val_ids = train.prepare_data(train_config(corpus, out))
    assert (len(train_ids), len(val_ids)) == (meta["train_tokens"], meta["val_tokens"]) and snapshot(out) == before
    assert preparation.prepare([str(corpus)], out, progress=False, tokenizer=tok_path)["skipped"]
    with pytest.raises(UserError, match="prepared with a validation fraction of 0.2, not 0.1"):
        train.prepare_data(load_config("tiny", [f"data.inputs={corpus}", f"data.data_dir={out}",
                                                "data.allow_smaller_vocab=true", "data.val_fraction=0.1"]))
    argv = ["--set", f"data.inputs={corpus}", "--set", f"data.data_dir={out}", "--set", "data.allow_smaller_vocab=true",
            "--set", "data.val_fraction=0.1"]
    capsys.readouterr()
    for extra in (["--dry-run"], ["--max-steps", "1", "--set", "train.warmup_steps=0"]):
        code, err = cli(train.main, ["--out", str(tmp_path / "run"), *argv, *extra], capsys)
        assert code == 2 and "leave --set data.val_fraction unset" in one_line(err)
    assert snapshot(out) == before and not (tmp_path / "run").exists()
    again = preparation.prepare([str(corpus)], out, val_fraction=0.01, progress=False, force=True, tokenizer=tok_path)
    assert not again["skipped"] and again["val_fraction"] == 0.01 and again["val_tokens"] < meta["val_tokens"]


# ----------------------------------------------------------------------------- class 2: one writer at a time


def test_a_second_preparation_waits_for_the_first_then_finds_it_complete(tmp_path, tok_path, capsys):
    """While a process holds the data directory, prepare writes nothing and waits (saying so); once
    the holder is done, it finds the directory complete and keeps it."""
    from andrea.data import lock

    corpus, out, first = prepared(tmp_path, tok_path)
    other = tmp_path / "other"
    result = {}
    with lock.writing(other):
        waiting = threading.Thread(target=lambda: result.update(
            meta=preparation.prepare([str(corpus)], other, progress=True, tokenizer=tok_path)))
        waiting.start()
        time.sleep(1.0)
        assert waiting.is_alive() and list(other.iterdir()) == []  # it waits, having written nothing
        shutil.copytree(out, other, dirs_exist_ok=True)  # what the holder prepared
    waiting.join(30)
    assert result["meta"]["skipped"] and "waiting: another process is preparing" in capsys.readouterr().err


def test_train_opens_the_data_only_when_no_preparation_is_writing_it(tmp_path, tok_path):
    from andrea.data import lock

    corpus, out, first = prepared(tmp_path, tok_path)
    opened = {}
    with lock.writing(out):
        reader = threading.Thread(target=lambda: opened.update(
            data=train.prepare_data(train_config(corpus, out), build=False)))
        reader.start()
        time.sleep(0.5)
        assert reader.is_alive() and not opened  # it waits for the writer
    reader.join(30)
    assert len(opened["data"][1]) == first["train_tokens"]


def test_two_preparations_with_different_tokenizers_leave_one_consistent_directory(tmp_path, tok_path):
    corpus = make_corpus(tmp_path / "c", 6, 60_000)
    other = tmp_path / "other.json"
    Tokenizer.train([lines(np.random.default_rng(5), 100_000)], vocab_size=500, allow_smaller=True).save(other)
    out, results = tmp_path / "d", {}

    def run(name, tok):
        try:
            results[name] = preparation.prepare([str(corpus)], out, progress=False, tokenizer=tok, workers=1)
        except UserError as e:
            results[name] = e

    threads = [threading.Thread(target=run, args=(n, t)) for n, t in (("a", tok_path), ("b", other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    errors = [r for r in results.values() if isinstance(r, UserError)]
    assert len(errors) == 1 and "another tokenizer" in str(errors[0])
    tok = Tokenizer.load(out / "tokenizer.json")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer_fingerprint"] == tok.fingerprint()
    for entry in meta["shards"]["train"] + meta["shards"]["val"]:
        assert read_token_header(out / entry["file"]).fingerprint == tok.fingerprint()


# ----------------------------------------------------------------------------- class 3: damage is said


def test_a_truncated_shard_is_an_error_naming_it_never_a_silent_re_make(tmp_path, tok_path, capsys):
    corpus, out, _ = prepared(tmp_path, tok_path)
    shard = out / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    before = snapshot(out)
    with pytest.raises(UserError, match="train-00000.bin is truncated or corrupt"):
        train.prepare_data(train_config(corpus, out))
    shutil.move(corpus, tmp_path / "gone")  # the corpus gone: still the shard is named, not the corpus
    with pytest.raises(UserError, match="train-00000.bin is truncated or corrupt"):
        preparation.prepare([str(corpus)], out, progress=False, tokenizer=tok_path)
    code, err = cli(train.main, ["--config", "tiny", "--set", f"data.inputs={corpus}", "--set",
                                 f"data.data_dir={out}", "--set", "data.allow_smaller_vocab=true", "--dry-run",
                                 "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "train-00000.bin is truncated" in one_line(err)
    assert snapshot(out) == before


def test_verify_reads_every_shard_against_its_checksum(tmp_path, tok_path, capsys):
    corpus, out, meta = prepared(tmp_path, tok_path, shard_tokens=5_000)
    assert all(len(e["sha256"]) == 64 for s in ("train", "val") for e in meta["shards"][s])
    with pytest.raises(SystemExit) as info:
        run_cli(prepare.main, ["--verify", "--data-dir", str(out)])
    assert info.value.code == 0 and "every checksum matches" in capsys.readouterr().out
    assert len(meta["shards"]["train"]) > 1
    shard = out / meta["shards"]["train"][-1]["file"]
    raw = bytearray(shard.read_bytes())
    raw[HEADER_SIZE + 10] ^= 1  # an id still in range: trains in silence, but is found here
    shard.write_bytes(bytes(raw))
    code, err = cli(prepare.main, ["--verify", "--data-dir", str(out)], capsys)
    assert code == 2 and f"{shard}: its ids' checksum" in one_line(err)


def test_verify_refuses_a_directory_that_is_not_complete(tmp_path, capsys):
    code, err = cli(prepare.main, ["--verify", "--data-dir", str(tmp_path / "nothing")], capsys)
    assert code == 2 and "no complete prepared data" in one_line(err)


def test_a_corpus_whose_validation_split_would_be_empty_is_refused_with_advice_that_works(tmp_path, tok_path):
    one_line_file = tmp_path / "one.txt"
    one_line_file.write_text("alpha beta gamma " * 50 + "\n")
    with pytest.raises(UserError, match="several lines"):
        preparation.prepare([str(one_line_file)], tmp_path / "d1", progress=False, tokenizer=tok_path)
    assert not (tmp_path / "d1").exists()
    few = tmp_path / "few.txt"
    few.write_text("a short first line\n" + "delta epsilon zeta " * 200 + "\n")  # the last line: 99% of it
    with pytest.raises(UserError, match="several lines"):  # no fraction in range (below 0.5) would do
        preparation.prepare([str(few)], tmp_path / "d2", progress=False, tokenizer=tok_path)
    few.write_text("a short first line\n" * 100 + "delta epsilon zeta " * 50 + "\n")  # the last line: a third
    with pytest.raises(UserError, match=r"use --val-fraction (\S+) or more") as info:
        preparation.prepare([str(few)], tmp_path / "d2", progress=False, tokenizer=tok_path)
    advised = float(str(info.value).split("--val-fraction ")[-1].split()[0])
    meta = preparation.prepare([str(few)], tmp_path / "d2", progress=False, tokenizer=tok_path, val_fraction=advised)
    assert meta["val_tokens"] > 0 and meta["train_tokens"] > 0


def test_a_one_file_corpus_is_never_cut_inside_a_line_between_the_splits(tmp_path, tok_path):
    """A file whose last line has no final newline: one line alone is refused as the same line with a
    newline is; a longer last line than --val-fraction's share is refused with a fraction that works,
    and that fraction's validation holds the last line whole, from a line's start (several blocks long)."""
    one_line_file = tmp_path / "one.txt"
    one_line_file.write_text("alpha beta gamma " * 2000)
    with pytest.raises(UserError, match="several lines"):
        preparation.prepare([str(one_line_file)], tmp_path / "d1", progress=False, tokenizer=tok_path)
    assert not (tmp_path / "d1").exists()
    head, last = lines(np.random.default_rng(3), 200_000), "delta epsilon zeta " * 8_000  # 152 KB, no newline
    unfinished = tmp_path / "unfinished.txt"
    unfinished.write_text(head + last)
    with pytest.raises(UserError, match=r"use --val-fraction (\S+) or more") as info:
        preparation.prepare([str(unfinished)], tmp_path / "d2", progress=False, tokenizer=tok_path)
    advised = float(str(info.value).split("--val-fraction ")[-1].split()[0])
    preparation.prepare([str(unfinished)], tmp_path / "d2", progress=False, tokenizer=tok_path, val_fraction=advised)
    tok = Tokenizer.load(tok_path)
    train_text, val_text = (tok.decode(all_ids(tmp_path / "d2", split).tolist()).removesuffix(tok.EOT_TEXT)
                            for split in ("train", "val"))
    assert train_text + val_text == head + last and train_text.endswith("\n") and val_text.endswith(last)


def test_a_tokenizer_sample_too_small_is_said_to_be_the_sample(tmp_path, capsys):
    corpus = make_corpus(tmp_path / "c", 4, 500_000)  # 2 MB: enough text, when the sample takes it
    code, err = cli(prepare.main, ["--input", str(corpus), "--data-dir", str(tmp_path / "d"), "--quiet",
                                   "--tokenizer-sample", "1"], capsys)
    assert code == 2 and "the tokenizer sample is too small" in one_line(err) and "raise --tokenizer-sample" in err
    assert "corpus is too small" not in err


# ----------------------------------------------------------------------------- class 4: what each operation needs


def _mount_tmpfs(path, size):
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_complete_directory_on_a_read_only_mount_trains(tmp_path, tok_path, capsys):
    disk = tmp_path / "ro"
    if not _mount_tmpfs(disk, "8m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        corpus, out, _ = prepared(tmp_path, tok_path, "ro/d")
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        assert not os.access(out, os.W_OK)
        assert preparation.prepare([str(corpus)], out, progress=False, tokenizer=tok_path)["skipped"]
        cfg = small_config(tmp_path, out, max_steps=2, eval_interval=2, checkpoint_interval=2)
        code, err = cli(train.main, ["--config", str(cfg), "--out", str(tmp_path / "run"),
                                     "--set", f"data.inputs={corpus}"], capsys)
        assert code == 0, err
        code, err = cli(prepare.main, ["--input", str(corpus), "--data-dir", str(out), "--force", "--quiet",
                                      "--tokenizer", str(tok_path)], capsys)
        assert code == 2 and "cannot be written" in one_line(err)  # what writes is refused, naming it
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_full_file_system_during_prepare_names_the_path(tmp_path, tok_path, capsys):
    disk = tmp_path / "full"
    if not _mount_tmpfs(disk, "48k"):
        pytest.skip("cannot mount a tmpfs here (needs root); the simulated one below still runs")
    try:
        corpus = make_corpus(tmp_path / "c", 6, 40_000)
        code, err = cli(prepare.main, ["--input", str(corpus), "--data-dir", str(disk / "d"), "--quiet",
                                       "--tokenizer", str(tok_path)], capsys)
        assert code == 1 and f"{disk / 'd'}/" in one_line(err) and "No space left on device" in err
        assert not [p for p in (disk / "d").iterdir() if p.name.endswith(".tmp") or p.name == "meta.json"]
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_failed_write_names_the_file_it_was_writing(tmp_path, tok_path, monkeypatch, capsys):
    import errno

    class Full:  # the shard's file on a full disk: its writes fail, as they do, naming no file
        def __init__(self, f):
            self.f = f

        def write(self, raw):
            raise OSError(errno.ENOSPC, "No space left on device")

    init = TokenSink.__init__
    monkeypatch.setattr(TokenSink, "__init__", lambda self, f, *args: init(self, Full(f), *args))
    corpus = make_corpus(tmp_path / "c", 3, 20_000)
    code, err = cli(prepare.main, ["--input", str(corpus), "--data-dir", str(tmp_path / "d"), "--quiet",
                                   "--tokenizer", str(tok_path)], capsys)
    assert code == 1 and f"error: {tmp_path / 'd' / 'train-00000.bin'}: No space left" in one_line(err)


# ----------------------------------------------------------------------------- class 5: globs and links


def test_a_recursive_glob_follows_no_symbolic_link(tmp_path):
    root = make_corpus(tmp_path / "c", 20, 200)
    (root / "self").symlink_to(".")
    (root / "d0" / "up").symlink_to("..")
    (root / "d1" / "file-link.txt").symlink_to(root / "d2" / "f002.txt")  # a link to a file is taken
    walked = resolve_inputs([str(root)])
    t0 = time.perf_counter()
    globbed = resolve_inputs([f"{root}/**/*.txt"])
    assert time.perf_counter() - t0 < 5
    assert globbed == walked and len(globbed) == 21
    assert resolve_inputs([f"{root}/*"]) == walked  # a wildcard matches no link to a directory
    assert resolve_inputs([f"{root}/**"]) == walked
    named = resolve_inputs([f"{root}/self/d0/*.txt"])  # a link named in full is followed
    assert named == [root / "self" / "d0" / p.name for p in walked if p.parent.name == "d0"]


# --------------------------------------------------------------- class 7: the dry run checks what the run checks


def dry_run(tmp_path, capsys, *argv):
    return cli(train.main, ["--config", "tiny", "--out", str(tmp_path / "run"), "--dry-run", *argv], capsys)


def test_the_dry_run_refuses_what_the_run_refuses_about_the_data(tmp_path, tok_path, capsys):
    corpus, out, _ = prepared(tmp_path, tok_path)
    base = ["--set", f"data.data_dir={out}", "--set", "data.allow_smaller_vocab=true"]
    code, err = dry_run(tmp_path, capsys, *base, "--set", f"data.inputs={corpus / 'd0'}")
    assert code == 2 and "prepared from another corpus" in one_line(err)
    code, err = dry_run(tmp_path, capsys, *base, "--set", f"data.inputs={tmp_path / 'none*.txt'}")
    assert code == 2 and "matches no file" in one_line(err)
    code, err = dry_run(tmp_path, capsys, "--set", f"data.data_dir={tmp_path / 'new'}",
                        "--set", f"data.inputs={tmp_path / 'none*.txt'}")
    assert code == 2 and "matches no file" in one_line(err)
    code, _ = dry_run(tmp_path, capsys, *base, "--set", f"data.inputs={corpus}")
    assert code == 0


def _gpt2_directory(tmp_path):
    from andrea.config import ModelConfig
    from andrea.interop import hf
    from andrea.model.transformer import ANDREA

    model = ANDREA(ModelConfig(vocab_size=300, context_length=16, d_model=16, n_layer=1, n_head=2), device="cpu")
    directory = tmp_path / "gpt2"
    hf.save_pretrained(model, directory)
    return directory


def test_the_dry_run_checks_init_from_weights_as_loading_does(tmp_path, capsys, monkeypatch):
    from andrea.interop import hf

    good = _gpt2_directory(tmp_path)
    monkeypatch.setattr(train, "prepare_data", lambda *a, **k: pytest.fail("the dry run prepared data"))
    missing = tmp_path / "missing"
    shutil.copytree(good, missing)
    tensors = {k: np.asarray(v) for k, v in hf.read_safetensors(missing / "model.safetensors").items()}
    name = next(k for k in tensors if k.endswith("ln_f.bias"))
    tensors.pop(name)
    from safetensors.numpy import save_file
    save_file(tensors, missing / "model.safetensors")
    code, err = dry_run(tmp_path, capsys, "--init-from", str(missing))
    assert code == 2 and "missing" in one_line(err) and "ln_f.bias" in err
    damaged = tmp_path / "damaged"
    shutil.copytree(good, damaged)
    raw = bytearray((damaged / "model.safetensors").read_bytes())
    raw[8:12] = b"{{{{"  # the header is no longer JSON
    (damaged / "model.safetensors").write_bytes(bytes(raw))
    code, err = dry_run(tmp_path, capsys, "--init-from", str(damaged))
    assert code == 2 and "not a complete safetensors file" in one_line(err)


# ----------------------------------------------------------------------------- class 6: Ctrl-C from outside

ROOT = Path(__file__).resolve().parents[2]
STDLIB = Path(json.__file__).parent.parent
SIGINT_CORPUS = [str(STDLIB / name) for name in ("email", "unittest")]  # 1.3 MB of Python


def _sigint_as_from_a_terminal():
    """In the child, before it runs Python: SIGINT's default action. A suite started in the background
    (`... &` in a script) passes SIGINT on ignored, and Python then leaves it ignored (no
    KeyboardInterrupt): the prepare would finish instead of stopping, as test_prepare_scale.py says too."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_until_importing_numpy(pid):
    """Returns as soon as the process has loaded NumPy's core library, a fraction of a second after it
    started: it runs andrea.prepare's imports then. (Sooner, the interpreter is still starting
    itself, and a SIGINT is Python's own business: its site module fails to import.)"""
    maps = Path(f"/proc/{pid}/maps")
    if not maps.exists():
        pytest.skip("no /proc: the moment the imports run cannot be seen from outside")
    t0 = time.perf_counter()
    while "_multiarray_umath" not in maps.read_text():
        assert time.perf_counter() - t0 < 30
        time.sleep(0.002)


@pytest.mark.parametrize("moment, delay", [("start", 0), ("tokenizer reading", 0), ("tokenizer reading", 0.02),
                                           ("tokenizer merges", 0.05), ("encoding", 0.05)])
def test_ctrl_c_from_outside_at_any_moment_exits_130_leaving_nothing_half_written(tmp_path, moment, delay):
    """SIGINT sent to a `python -m andrea.prepare` process, as a terminal's Ctrl-C is: as it starts
    (its imports, see _wait_until_importing_numpy), while the tokenizers trainer reads (a Rust library on a
    thread of its own), while it merges, while the shards are written. Each ends with `interrupted` and exit code 130,
    no traceback and no abort, and the data directory holds no temporary file and no manifest."""
    import signal

    out = tmp_path / "d"
    proc = subprocess.Popen([sys.executable, "-m", "andrea.prepare", "--input", *SIGINT_CORPUS, "--data-dir",
                             str(out), "--vocab-size", "3000", "--allow-smaller-vocab", "--workers", "1"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_sigint_as_from_a_terminal)
    marker = {"start": None, "tokenizer reading": "training a ", "tokenizer merges": "tokenizer: computing",
              "encoding": "encoding "}[moment]
    seen = []
    try:
        if marker is None:
            _wait_until_importing_numpy(proc.pid)
        else:
            for line in proc.stderr:
                seen.append(line)
                if line.startswith(marker):
                    break
            time.sleep(delay)  # at the reading's very start (the thread starting) the old code aborted most
        assert proc.poll() is None, f"it ended before {moment}: {''.join(seen)}"
        os.kill(proc.pid, signal.SIGINT)
        sent = time.perf_counter()
        _, err = proc.communicate(timeout=60)
        took = time.perf_counter() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    err = "".join(seen) + err
    assert proc.returncode == 130, err
    assert err.rstrip().endswith("interrupted"), err
    print(f"{moment} +{delay} s: exit {proc.returncode} {took:.2f} s after SIGINT")
    assert took < 5, f"{took:.1f} s"  # the README says within a second; 5 on a loaded machine
    assert "Traceback" not in err and "FATAL" not in err and "panicked" not in err, err
    left = [p.name for p in out.iterdir()] if out.exists() else []
    assert "meta.json" not in left and not [n for n in left if n.endswith(".tmp")], left


# ----------------------------------------------------------------------------- issue 30, class 14: memory


def test_the_prepare_command_holds_mallocs_mmap_threshold(monkeypatch):
    """What kept prepare's peak memory growing with the corpus (the block size does, up to 1 MiB, and
    glibc's dynamic mmap threshold followed it): the command holds the threshold, unless the user set it."""
    import platform

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "")
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    assert prepare.fixed_mmap_threshold() == {"mmap_threshold": 128 << 10}
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert prepare.fixed_mmap_threshold() == {}


def test_two_prepares_started_together_with_other_tokenizers_one_is_refused(tmp_path, tok_path):
    """Issue 48, class 7: two `prepare --tokenizer` of other tokenizers into one new data directory,
    started at the same instant: one prepares it, the other is refused as it is one after the other
    (never both exit 0, one's --tokenizer dropped). 60 tries. Before the path check that makes and
    removes the new directory (andrea.run.paths) left alone one that a preparation had locked, and
    before the lock was taken again on a directory removed before it was opened, 4, 2 and 1 of 60
    tries failed in three runs here (both "ok": two preparations writing one directory; or a
    FileNotFoundError); none in three runs since."""
    corpus = make_corpus(tmp_path / "c", 3, 20_000)
    other = tmp_path / "other.json"
    Tokenizer.train([lines(np.random.default_rng(5), 100_000)], vocab_size=500, allow_smaller=True).save(other)
    setup = ("import contextlib, io\nfrom andrea import prepare\nfrom andrea.errors import UserError\n"
             "tok, corpus, root = arg.split('|')")
    body = ("try:\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        prepare.main(['--input', corpus, '--data-dir', f'{root}/d{k}', '--tokenizer', tok, '--quiet',\n"
            "                      '--workers', '1'])\n"
            "    return 'ok'\n"
            "except UserError as e:\n"
            "    return 'refused' if 'another tokenizer' in str(e) else f'refused: {e}'")
    outcomes = started_together(setup, body, tuple(f"{t}|{corpus}|{tmp_path}" for t in (tok_path, other)),
                                tries=60, slot=0.4)
    failed = {k: o for k, o in outcomes.items() if sorted(o) != ["ok", "refused"]}
    assert not failed, f"{len(failed)} of 60 tries: {list(failed.items())[:3]}"
    for k in range(60):  # each directory one preparation's: its manifest, its tokenizer, its shards
        meta = json.loads((tmp_path / f"d{k}" / "meta.json").read_text())
        assert meta["tokenizer_fingerprint"] == Tokenizer.load(tmp_path / f"d{k}" / "tokenizer.json").fingerprint()
