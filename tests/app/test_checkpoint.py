"""Checkpoint store: bit-exact round trips, and every protection against crashes, full disks and damage.

Each test is written to fail if the protection it names were removed. A crash is simulated two ways:
in-process, by copying the directory at the instant of the fault (what a kill would leave on disk);
and for real, by SIGKILLing a subprocess parked inside a save.
"""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from andrea.errors import UserError
from andrea.run import checkpoint
from andrea.run.checkpoint import (
    META_FILE,
    TENSORS_FILE,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]


def _tensors(step):
    return {"w": np.full((2, 3), step, np.float32), "step": np.array(step, np.int64)}


def _save(out, step, keep_last=10):
    return save_checkpoint(out, step, _tensors(step), {"step": step}, keep_last=keep_last)


def _steps(out):
    return [int(path.name.removeprefix("ckpt-")) for path in list_checkpoints(out)]


def _scratch(out):
    return sorted(p.name for p in out.iterdir() if p.name.startswith(".tmp-"))


def _assert_holds_step(path, step):
    tensors, meta = load_checkpoint(path)
    assert meta == {"step": step}
    assert tensors["w"].tobytes() == _tensors(step)["w"].tobytes()


def _ckpt(out, step):
    return out / f"ckpt-{step:08d}"


def _rewrite_record(path, **fields):
    record = json.loads((path / META_FILE).read_text())
    record.update(fields)
    (path / META_FILE).write_text(json.dumps(record))


# ------------------------------------------------------------------------------------------- round trip

def test_round_trip_is_bit_exact(tmp_path):
    special = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45, 3.4e38], np.float32)
    special_bits = special.view(np.uint32).copy()
    special_bits[0] = 0x7FC0_1234  # a NaN with a payload: only a byte-exact store keeps it
    tensors = {
        "f32": np.random.default_rng(0).standard_normal((4, 5), dtype=np.float32),
        "f32_special": special_bits.view(np.float32),
        "f64": np.array([np.pi, -1e308, 5e-324]),
        "i64": np.array([np.iinfo(np.int64).min, -1, np.iinfo(np.int64).max]),
        "u16": np.arange(0, 65536, 4099, dtype=np.uint16),
        "f16": np.array([0.1, 65504], np.float16),
        "i8": np.array([-128, 127], np.int8),
        "mask": np.array([True, False]),
        "c64": np.array([1 + 2j], np.complex64),
        "scalar": np.array(7, np.int32),
        "empty": np.zeros((0, 4), np.float32),
        "big_endian": np.array([1.5, -2.25], ">f4"),
        "transposed": np.arange(6.0).reshape(2, 3).T,  # not C-contiguous: saved scrambled if not copied
    }
    rng = np.random.default_rng(12345)
    rng.random(3)
    meta = {"rng": rng.bit_generator.state, "huge": 2**200, "negative": -(2**70), "name": "ändrea",
            "loss": 2.5, "nested": {"lr": [3e-4, None, True]}}
    expected_draws = rng.random(5)

    save_checkpoint(tmp_path, 7, tensors, meta)
    loaded, loaded_meta = load_checkpoint(_ckpt(tmp_path, 7))

    assert loaded.keys() == tensors.keys()
    for name, array in tensors.items():
        got = loaded[name]
        assert got.shape == array.shape, name
        assert got.dtype == array.dtype.newbyteorder("="), name
        assert got.tobytes() == array.astype(got.dtype).tobytes(), name
        assert got.flags.writeable, name
    assert loaded_meta == meta
    assert meta["rng"]["state"]["state"] > 2**64  # PCG64 state really needs big ints
    restored = np.random.Generator(np.random.PCG64())
    restored.bit_generator.state = loaded_meta["rng"]
    assert np.array_equal(restored.random(5), expected_draws)


def test_tensors_file_gets_the_same_permissions_as_meta(tmp_path):
    path = _save(tmp_path, 1)
    assert (path / TENSORS_FILE).stat().st_mode == (path / META_FILE).stat().st_mode


def test_every_file_and_directory_is_fsynced_before_publishing(tmp_path, monkeypatch):
    synced = []
    real = checkpoint._fsync
    monkeypatch.setattr(checkpoint, "_fsync", lambda path: (synced.append(Path(path)), real(path)))
    _save(tmp_path, 1)
    scratch = synced[0].parent
    assert scratch.name.startswith(".tmp-ckpt-")
    assert synced == [scratch / TENSORS_FILE, scratch / META_FILE, scratch, tmp_path]


# ----------------------------------------------------------------------------------------------- saving

def test_keep_last_keeps_the_newest(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep_last=2)
    assert _steps(tmp_path) == [5, 4]
    assert _scratch(tmp_path) == []


@pytest.mark.parametrize("keep_last", [0, -1, 1.5, True])
def test_keep_last_is_validated_before_writing(tmp_path, keep_last):
    with pytest.raises(CheckpointError, match="keep_last"):
        _save(tmp_path / "out", 1, keep_last=keep_last)
    assert not (tmp_path / "out").exists()


def test_pruning_after_a_resume_from_an_older_step_keeps_the_new_run(tmp_path):
    for step in (10, 20, 30):
        _save(tmp_path, step, keep_last=3)
    _save(tmp_path, 15, keep_last=3)  # resumed from 10: 20 and 30 are an abandoned future
    assert _steps(tmp_path) == [30, 20, 15]
    _save(tmp_path, 25, keep_last=3)
    assert _steps(tmp_path) == [30, 25, 15]  # by step order, 15 would have gone and stale 20 stayed


def test_resaving_a_step_replaces_it(tmp_path):
    _save(tmp_path, 4)
    save_checkpoint(tmp_path, 5, _tensors(1), {"step": 1})
    save_checkpoint(tmp_path, 5, _tensors(5), {"step": 5})
    _assert_holds_step(_ckpt(tmp_path, 5), 5)
    assert _steps(tmp_path) == [5, 4]
    assert _scratch(tmp_path) == []


def test_failed_resave_keeps_the_old_copy(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 5, _tensors(5), {"step": 5})
    real_rename, failed = os.rename, []

    def rename(src, dst):  # the new copy cannot be moved into place; everything else works
        if not failed and Path(src).name.startswith(".tmp-ckpt-") and Path(dst).name.startswith("ckpt-"):
            failed.append(src)
            raise OSError(errno.EIO, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(CheckpointError, match="input/output error"):
        save_checkpoint(tmp_path, 5, _tensors(6), {"step": 6})
    _assert_holds_step(_ckpt(tmp_path, 5), 5)
    assert _scratch(tmp_path) == []


@pytest.mark.parametrize("fail_at", [TENSORS_FILE, META_FILE])
def test_full_disk_leaves_previous_intact_and_no_scratch(tmp_path, monkeypatch, fail_at):
    _save(tmp_path, 1)
    real = checkpoint._write_file

    def full_disk(path, write):
        if path.name == fail_at:
            path.write_bytes(b"\0" * 100)  # a partial file, as a real full disk leaves
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, write)

    monkeypatch.setattr(checkpoint, "_write_file", full_disk)
    with pytest.raises(CheckpointError, match="no space left on device") as caught:
        _save(tmp_path, 2)
    assert str(_ckpt(tmp_path, 2)) in str(caught.value)
    assert _steps(tmp_path) == [1]
    assert _scratch(tmp_path) == []
    _assert_holds_step(_ckpt(tmp_path, 1), 1)

    monkeypatch.setattr(checkpoint, "_write_file", real)  # space freed: the run carries on
    _save(tmp_path, 2)
    assert _steps(tmp_path) == [2, 1]


@pytest.mark.parametrize(
    ("tensors", "meta", "step", "match"),
    [
        ([np.zeros(2)], {}, 1, "dict of name"),
        ({"w": [1.0, 2.0]}, {}, 1, "not a NumPy array"),
        ({"w": np.zeros(2, np.complex128)}, {}, 1, "complex128"),
        ({"w": np.array([object()])}, {}, 1, "object"),
        ({"__metadata__": np.zeros(2)}, {}, 1, "tensor name"),
        ({"w": np.zeros(2)}, {"loss": np.float32(1.0)}, 1, "JSON"),
        ({"w": np.zeros(2)}, [], 1, "meta must be a dict"),
        ({"w": np.zeros(2)}, {}, -1, "step"),
        ({"w": np.zeros(2)}, {}, 1.0, "step"),
        ({"w": np.zeros(2)}, {}, True, "step"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(tmp_path, tensors, meta, step, match):
    with pytest.raises(CheckpointError, match=match):
        save_checkpoint(tmp_path / "out", step, tensors, meta)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ crashes mid-save

@pytest.mark.parametrize("when", ["before tensors", "before meta", "after meta"])
def test_crash_mid_save_leaves_previous_as_latest(tmp_path, monkeypatch, when):
    out, frozen = tmp_path / "out", tmp_path / "frozen"
    _save(out, 1)
    real = checkpoint._write_file

    def crash(path, write):
        if when == "after meta" and path.name == META_FILE:
            real(path, write)
        if (when, path.name) in {("before tensors", TENSORS_FILE), ("before meta", META_FILE),
                                 ("after meta", META_FILE)}:
            shutil.copytree(out, frozen)  # the disk as a kill at this instant would leave it
            raise KeyboardInterrupt
        real(path, write)

    monkeypatch.setattr(checkpoint, "_write_file", crash)
    with pytest.raises(KeyboardInterrupt):
        _save(out, 2)
    monkeypatch.undo()

    assert len(_scratch(frozen)) == 1
    assert not _ckpt(frozen, 2).exists()
    assert _steps(frozen) == [1]
    path, _, meta = latest_checkpoint(frozen, warn=pytest.fail)
    assert (path, meta) == (_ckpt(frozen, 1), {"step": 1})
    _save(frozen, 3)
    assert _scratch(frozen) == []
    assert _steps(frozen) == [3, 1]


_STALLED_SAVE = """
import sys, time
from pathlib import Path
import numpy as np
from andrea.run import checkpoint
out, stall_at, ready = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
real = checkpoint._write_file

def stalling(path, write):
    if path.name == stall_at == "tensors.safetensors":
        write(path)  # the data is written but not yet fsynced
    if path.name == stall_at:
        ready.touch()
        time.sleep(60)
    real(path, write)

checkpoint._write_file = stalling
checkpoint.save_checkpoint(out, 2, {"w": np.full(4_000_000, 2.0, np.float32)}, {"step": 2})
"""


def _python(*args, **kwargs):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", *args], env=env, **kwargs)


@pytest.mark.skipif(sys.platform == "win32", reason="needs SIGKILL")
@pytest.mark.parametrize("stall_at", [TENSORS_FILE, META_FILE])
def test_sigkill_mid_save_leaves_previous_loadable(tmp_path, stall_at):
    out, ready = tmp_path / "out", tmp_path / "ready"
    _save(out, 1)
    child = _python(_STALLED_SAVE, str(out), stall_at, str(ready))
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert child.poll() is None, "the saving process exited early"
            assert time.monotonic() < deadline, "the saving process never reached the stall point"
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()

    assert len(_scratch(out)) == 1  # the kill really landed inside the save
    assert _steps(out) == [1]
    path = latest_checkpoint(out, warn=pytest.fail)[0]
    assert path == _ckpt(out, 1)
    _assert_holds_step(path, 1)
    _save(out, 3)
    assert _scratch(out) == []
    assert _steps(out) == [3, 1]


_SAVE_OVER_FILE_SIZE_LIMIT = """
import resource, signal, sys
import numpy as np
from andrea.run import checkpoint
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so write() fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    checkpoint.save_checkpoint(sys.argv[1], 2, {"w": np.ones(1 << 20, np.float32)}, {"step": 2})
except checkpoint.CheckpointError as err:
    print(err)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="needs RLIMIT_FSIZE")
def test_real_write_error_inside_safetensors_is_a_clean_failure(tmp_path):
    """A real kernel write error, raised inside safetensors' own writer (as SafetensorError, not OSError)."""
    _save(tmp_path, 1)
    child = _python(_SAVE_OVER_FILE_SIZE_LIMIT, str(tmp_path), stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
    stdout, stderr = child.communicate(timeout=60)
    assert child.returncode == 0, stderr
    assert "failed: file too large" in stdout
    assert _steps(tmp_path) == [1]
    assert _scratch(tmp_path) == []
    _assert_holds_step(_ckpt(tmp_path, 1), 1)


# ------------------------------------------------------------------------------------- damage on disk

def test_truncated_tensors_file_is_refused(tmp_path):
    path = _save(tmp_path, 2) / TENSORS_FILE
    size = path.stat().st_size
    os.truncate(path, size // 2)
    with pytest.raises(CheckpointError, match=rf"truncated \({size // 2} of {size} bytes\)") as caught:
        load_checkpoint(path.parent)
    assert str(path) in str(caught.value)


def test_flipped_byte_is_refused(tmp_path):
    path = _save(tmp_path, 2) / TENSORS_FILE
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # inside the tensor data: the safetensors header still parses
    path.write_bytes(data)
    assert safetensors.numpy.load_file(path)["w"].shape == (2, 3)
    with pytest.raises(CheckpointError, match="corrupt: sha256") as caught:
        load_checkpoint(path.parent)
    assert str(path) in str(caught.value)


def test_grown_or_missing_tensors_file_is_refused(tmp_path):
    path = _save(tmp_path, 2) / TENSORS_FILE
    with path.open("ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointError, match="were saved"):
        load_checkpoint(path.parent)
    path.unlink()
    with pytest.raises(CheckpointError, match=f"{path} is missing"):
        load_checkpoint(path.parent)


def test_unparsable_safetensors_with_matching_checksum_is_refused(tmp_path):
    ckpt = _save(tmp_path, 2)
    garbage = b"not a safetensors file at all"
    (ckpt / TENSORS_FILE).write_bytes(garbage)
    size, sha256 = checkpoint._file_digest(ckpt / TENSORS_FILE)
    _rewrite_record(ckpt, tensors_bytes=size, tensors_sha256=sha256)
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        load_checkpoint(ckpt)


def _drop_meta(ckpt):
    (ckpt / META_FILE).unlink()


def _garbage_meta(ckpt):
    (ckpt / META_FILE).write_bytes(b"\xff\xfe garbage")


def _cut_meta(ckpt):
    text = (ckpt / META_FILE).read_text()
    (ckpt / META_FILE).write_text(text[: len(text) // 2])


def _list_meta(ckpt):
    (ckpt / META_FILE).write_text("[1, 2]")


def _future_meta(ckpt):
    _rewrite_record(ckpt, format_version=99)


def _meta_without_sha(ckpt):
    record = json.loads((ckpt / META_FILE).read_text())
    del record["tensors_sha256"]
    (ckpt / META_FILE).write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (_drop_meta, "is missing"),
        (_garbage_meta, "not valid JSON"),
        (_cut_meta, "not valid JSON"),
        (_list_meta, "no format_version"),
        (_future_meta, "format version 99"),
        (_meta_without_sha, "'tensors_sha256'"),
    ],
)
def test_missing_or_corrupt_meta_is_refused(tmp_path, damage, match):
    ckpt = _save(tmp_path, 2)
    damage(ckpt)
    with pytest.raises(CheckpointError, match=match) as caught:
        load_checkpoint(ckpt)
    assert str(ckpt / META_FILE) in str(caught.value)


def test_checkpoint_without_meta_is_not_listed(tmp_path):
    _save(tmp_path, 1)
    _drop_meta(_save(tmp_path, 2))
    assert _steps(tmp_path) == [1]


def test_stale_scratch_is_ignored_by_readers_and_removed_by_the_next_save(tmp_path):
    _save(tmp_path, 1)
    stale = tmp_path / ".tmp-ckpt-00000009-deadbeef"
    stale.mkdir()
    for name in (TENSORS_FILE, META_FILE):  # even a complete-looking one is not published
        (stale / name).write_bytes((_ckpt(tmp_path, 1) / name).read_bytes())
    assert _steps(tmp_path) == [1]
    assert latest_checkpoint(tmp_path, warn=pytest.fail)[0] == _ckpt(tmp_path, 1)
    _save(tmp_path, 2)
    assert not stale.exists()


# ------------------------------------------------------------------------------------------- resuming

def test_latest_falls_back_past_damaged_ones_and_warns_about_each(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step)
    zeroed = _ckpt(tmp_path, 4) / TENSORS_FILE
    zeroed.write_bytes(b"\0" * zeroed.stat().st_size)
    os.truncate(_ckpt(tmp_path, 3) / TENSORS_FILE, 10)
    _drop_meta(_ckpt(tmp_path, 2))
    warnings = []

    path, tensors, meta = latest_checkpoint(tmp_path, warn=warnings.append)

    assert path == _ckpt(tmp_path, 1)
    assert meta == {"step": 1} and tensors["w"][0, 0] == 1
    assert len(warnings) == 3
    for warning, step, why in zip(warnings, (4, 3, 2), ("corrupt", "truncated", "missing"), strict=True):
        assert f"ckpt-{step:08d}" in warning and why in warning


def test_latest_falls_back_past_checkpoints_the_run_rejects(tmp_path):
    save_checkpoint(tmp_path, 1, {"w": np.zeros(3, np.float32)}, {})
    save_checkpoint(tmp_path, 2, {"w": np.zeros(4, np.float32)}, {})

    def validate(tensors, meta):
        if tensors["w"].shape != (3,):
            raise UserError(f"w has shape {tensors['w'].shape}, the config needs (3,)")

    warnings = []
    path, tensors, _ = latest_checkpoint(tmp_path, validate=validate, warn=warnings.append)
    assert path == _ckpt(tmp_path, 1) and tensors["w"].shape == (3,)
    assert len(warnings) == 1
    assert "ckpt-00000002" in warnings[0] and "the config needs (3,)" in warnings[0]


def test_a_bug_in_validate_is_not_mistaken_for_a_bad_checkpoint(tmp_path):
    _save(tmp_path, 1)
    with pytest.raises(KeyError):
        latest_checkpoint(tmp_path, validate=lambda tensors, meta: tensors["missing"], warn=pytest.fail)


def test_no_usable_checkpoint_is_a_user_error_naming_the_directory(tmp_path):
    for step in (1, 2):
        _drop_meta(_save(tmp_path, step))
    warnings = []
    with pytest.raises(CheckpointError, match=r"no usable checkpoint in .*ckpt-00000002, ckpt-00000001"):
        latest_checkpoint(tmp_path, warn=warnings.append)
    assert len(warnings) == 2
    assert issubclass(CheckpointError, UserError)  # the CLI turns it into exit code 2
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoints"):
        latest_checkpoint(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="does not exist"):
        latest_checkpoint(tmp_path / "nowhere")


def test_default_warning_goes_to_stderr(tmp_path, capsys):
    _save(tmp_path, 1)
    _drop_meta(_save(tmp_path, 2))
    latest_checkpoint(tmp_path)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("warning: skipping") and "ckpt-00000002" in captured.err
