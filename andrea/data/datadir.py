"""Whose a data directory is and what it holds: complete (the manifest), partial (the state file of
an interrupted preparation, continued from its last finished shard) or empty.

A directory is written only when it is empty of andrea's file names or holds andrea's own files:
a meta.json, a state file or token files that andrea did not write are refused, never replaced.
A complete directory is kept as it is, but a shard whose size or header is not the manifest's is
an error naming it, never re-made in silence. Only files the manifest or the state file name are
ever removed, and only after every check has passed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from andrea.data.inputs import resolve_inputs
from andrea.data.manifest import DATA_FORMAT, check_shards, read_data_meta
from andrea.data.progress import Log
from andrea.data.shards import STATE_FILE
from andrea.data.tokenizer import Tokenizer, load_tokenizer
from andrea.errors import UserError
from andrea.files import read_json
from andrea.run.runlog import remove_stale_temporaries


def up_to_date(data_dir: Path, meta: dict, wanted: dict, given, force: bool, allow_smaller: bool) -> bool:
    """True when the complete directory `meta` describes answers the request as it is; a UserError
    when it holds another corpus or tokenizer than the one asked for."""
    _check_same_request(data_dir, meta, wanted, given, force)
    if force or not _same_settings(meta, wanted, allow_smaller):
        return False
    check_intact(data_dir, meta)  # a damaged directory is said, never re-made in silence
    return True


def claim(data_dir: Path, meta: dict | None, state: dict | None, settings: dict, existing: Tokenizer | None) -> bool:
    """Make `data_dir` ready to write: a killed run's unfinished shard, and the files of the last
    preparation that this one does not continue, removed. True when it continues a partial one:
    the same settings and the same tokenizer."""
    if not os.access(data_dir, os.W_OK | os.X_OK):
        raise UserError(f"{data_dir} needs preparing but cannot be written (no permission, or a read-only file "
                        "system): choose another --data-dir (or --set data.data_dir=... for train)")
    remove_stale_temporaries(data_dir)  # a killed run's unfinished shard
    resumable = state is not None and existing is not None and state.get("settings") == {
        **settings, "tokenizer_fingerprint": existing.fingerprint()}
    _remove_ours(data_dir, meta, None if resumable else state)
    return resumable


def resumed(state: dict, n_blocks: int, log: Log) -> dict:
    """The state file of the interrupted preparation this one continues, as it is (said on the log)."""
    log.line(f"resuming: {len(state['shards']['train'])} training shards were finished, continuing at block "
             f"{state['next_block']} of {n_blocks}")
    return state


def our_files(data_dir: Path) -> tuple[dict | None, dict | None]:
    """(complete manifest, partial state) of `data_dir`, refusing a directory that holds files of
    andrea's names which andrea did not write: those are never replaced."""
    meta_path, state_path = data_dir / "meta.json", data_dir / STATE_FILE
    meta = read_data_meta(data_dir)
    if meta is not None and meta.get("format") != DATA_FORMAT:
        meta = None
    damaged = meta is None and meta_path.exists()
    if damaged and not _is_damaged_ours(meta_path):
        raise UserError(f"{data_dir} holds a meta.json that is not an andrea data directory's: choose another "
                        "--data-dir (prepare writes only into an empty directory or one it made)")
    try:
        state = read_json(state_path) if state_path.exists() else None
    except UserError:  # cut short by a crash: as if it were not there
        state = None
    if state is not None and state.get("format") != DATA_FORMAT + "-partial":
        raise UserError(f"{data_dir} holds a {STATE_FILE} that andrea did not write: choose another --data-dir")
    if meta is not None:
        state = None  # left by a process killed between the manifest and removing the state: finished
    if meta is None and state is None and not damaged and data_dir.is_dir():
        clash = sorted(p.name for p in data_dir.iterdir() if re.fullmatch(r"(train|val)(-\d{5})?\.bin", p.name))
        if clash:
            raise UserError(f"{data_dir} holds {clash[0]} but no andrea manifest (meta.json): choose another "
                            "--data-dir, or move those files away")
    return meta, state


def _is_damaged_ours(path: Path) -> bool:
    """A meta.json that is not JSON (cut short by a crash) beside an andrea tokenizer.json: a damaged
    data directory, rebuilt. Any other meta.json (a checkpoint's, a model's) belongs to someone else."""
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        return False
    except (OSError, ValueError):
        return (path.parent / "tokenizer.json").is_file()
    return False


def _check_same_request(data_dir: Path, meta: dict, wanted: dict, given, force: bool) -> None:
    """A complete data directory serves only the corpus and the split it was prepared with (`force`:
    another corpus or fraction is re-encoded there with the directory's tokenizer, whose fit is
    checked later)."""
    if given is not None and meta.get("tokenizer_fingerprint") != given.fingerprint():
        raise UserError(f"{data_dir} already holds another tokenizer than the one given (its data is encoded with "
                        "it): choose another data directory (--data-dir, or --set data.data_dir=... for train)")
    if (meta.get("inputs"), meta.get("text_field")) != (wanted["inputs"], wanted.get("text_field")) and not force:
        if wanted["inputs"]:
            resolve_inputs(wanted["inputs"])  # an input that matches nothing is the first thing to say
        raise UserError(f"{data_dir} holds data prepared from another corpus ({meta.get('corpus')}): choose another "
                        "--data-dir (or --set data.data_dir=... for train), or pass --force to re-encode this "
                        "corpus there with its existing tokenizer.json")
    has, asked = meta.get("val_fraction"), wanted["val_fraction"]
    if has != asked and not force:  # the split decides what every later evaluation measures: never redone unasked
        raise UserError(f"{data_dir} was prepared with a validation fraction of {has}, not {asked:g}: a prepared "
                        "directory keeps its split; leave --val-fraction unset to use it as it is, or choose "
                        "another --data-dir for the new split")


def _same_settings(meta: dict, wanted: dict, allow_smaller: bool) -> bool:
    """The vocabulary asked for (or the one the directory has, or a larger one with allow_smaller,
    which the directory's tokenizer answers) and the validation fraction match."""
    vocab, has = wanted["requested_vocab_size"], meta.get("vocab_size")
    fits = vocab in (meta.get("requested_vocab_size"), has) or (allow_smaller and isinstance(has, int) and has < vocab)
    return fits and meta.get("val_fraction") == wanted["val_fraction"]


def check_intact(data_dir: Path, meta: dict) -> None:
    """Every shard the manifest names has the size and header it says, and tokenizer.json is the one
    it names (headers only, no ids read): a UserError naming the first file that is not."""
    tok = load_tokenizer(data_dir / "tokenizer.json")
    if tok.fingerprint() != meta.get("tokenizer_fingerprint"):
        raise UserError(f"{data_dir / 'tokenizer.json'} is not the tokenizer {data_dir / 'meta.json'} was encoded "
                        "with: the data directory was changed since it was prepared; prepare it again (--force)")
    try:
        check_shards(data_dir, meta, tok.fingerprint())
    except UserError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{data_dir / 'meta.json'} is damaged ({type(e).__name__}: {e}): prepare it again "
                        "(--force)") from e


def existing_tokenizer(data_dir: Path, vocab_size: int, allow_smaller: bool, given) -> Tokenizer | None:
    """The directory's tokenizer.json if it has one and it fits the request (else a UserError)."""
    path = data_dir / "tokenizer.json"
    if not path.exists():
        return None
    tok = load_tokenizer(path)
    if given is not None and tok.fingerprint() != given.fingerprint():
        raise UserError(f"{data_dir} already holds another tokenizer than the one given: choose another data "
                        "directory (--data-dir, or --set data.data_dir=... for train)")
    if tok.vocab_size != vocab_size and not (allow_smaller and tok.vocab_size < vocab_size):
        raise UserError(
            f"{path} has {tok.vocab_size} ids but {vocab_size} were asked for: choose another --data-dir, or "
            "delete it to train a new tokenizer"
        )
    return tok


def _remove_ours(data_dir: Path, meta: dict | None, state: dict | None) -> None:
    """Remove the files a manifest or state of this directory names (its shards), then meta.json."""
    names = set()
    if meta is not None:
        names |= {e["file"] for split in ("train", "val") for e in meta["shards"][split]}
        names |= {"meta.json", STATE_FILE}  # a state beside a manifest is a leftover of the finished run
    if state is not None:
        names |= {e["file"] for split in ("train", "val") for e in state["shards"][split]}
        names.add(STATE_FILE)
    if (data_dir / "meta.json").exists() and _is_damaged_ours(data_dir / "meta.json"):
        names.add("meta.json")
    if "meta.json" in names:
        (data_dir / "meta.json").unlink()  # first: the directory is incomplete from here
    for name in sorted(names):
        (data_dir / name).unlink(missing_ok=True)
