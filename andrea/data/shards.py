"""Encoding a planned corpus (andrea/data/stream.py's blocks) into token shards, resumably.

`Encoder.run` encodes blocks from `state["next_block"]` on, on several threads, and takes their ids
in corpus order: each part of a block (a source's text on one side of the split, andrea.data.sources)
goes to the open shard of its split (`train-NNNNN.bin` or `val-NNNNN.bin`), an EOT ends each document
(a record, a file, or each part of a file that the split cut in two), and the ids are counted per
split for the unigram baseline. When the open training shard
holds `shard_tokens`, both open shards are finished and the state (the next block, the finished
shards with their counts and largest ids, the running counts) is saved to prepare-state.json: a
later run on the same corpus and tokenizer continues from there and writes the same shards as an
uninterrupted one. Each shard goes through `token_writer`, so it appears complete or not at all.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from andrea.data import stream
from andrea.data.manifest import DATA_FORMAT, shard_name
from andrea.data.sources import BlockText
from andrea.data.tokenfile import token_writer
from andrea.files import write_json

STATE_FILE = "prepare-state.json"


def unigram_entropy(train_counts: np.ndarray, val_counts: np.ndarray) -> float:
    """Cross-entropy in nats/token of the val tokens under the train unigram distribution.

    Both arguments are (V,) id counts. Add-one smoothing over all V ids keeps ids unseen in
    train finite. This is the loss of a model that ignores context: the first bar to beat.
    """
    V = len(train_counts)
    log_p = np.log((np.asarray(train_counts, dtype=np.float64) + 1.0) / (np.sum(train_counts) + V))  # (V,)
    return float(-(np.asarray(val_counts, dtype=np.float64) @ log_p) / max(np.sum(val_counts), 1))


def new_state(settings: dict, V: int) -> dict:
    return {
        "format": DATA_FORMAT + "-partial",
        "settings": settings,
        "next_block": 0,
        "shards": {"train": [], "val": []},
        "counts": {"train": [0] * V, "val": [0] * V},
        "bytes": {"train": 0, "val": 0},
        "not_utf8_files": 0,
        "documents": 0,
        "open_document": None,  # the split the current file's text went to last, at a block boundary
        "file_not_utf8": False,
        "empty_documents": 0,
    }


@dataclass
class Piece:
    """A block read and encoded: the ids of each of its parts."""

    block: stream.Block
    text: BlockText
    ids: list[np.ndarray]


class ShardWriter:
    """The shards of one split: ids go to the open shard; `close()` finishes it and records it."""

    def __init__(self, data_dir: Path, split: str, vocab_size: int, fingerprint: str, done: list):
        self.data_dir, self.split, self.V, self.fingerprint = data_dir, split, vocab_size, fingerprint
        self.done = done  # the manifest entries of the finished shards (the state's list)
        self._stack = None
        self._sink = None
        self.max_id = -1

    @property
    def count(self) -> int:
        return self._sink.count if self._sink is not None else 0

    def write(self, ids: np.ndarray) -> None:
        if len(ids) == 0:
            return
        if self._sink is None:
            self._stack = contextlib.ExitStack()
            name = shard_name(self.split, len(self.done))
            self._sink = self._stack.enter_context(token_writer(self.data_dir / name, self.V, self.fingerprint))
        self._sink.write(ids)  # refuses an id outside 0..V-1: checked once, when written
        self.max_id = max(self.max_id, int(ids.max()))

    def close(self) -> None:
        if self._sink is None:
            return
        count, digest, stack = self._sink.count, self._sink.sha256.hexdigest(), self._stack
        self._sink = self._stack = None
        stack.close()  # header written, file renamed into place
        self.done.append({"file": shard_name(self.split, len(self.done)), "tokens": count, "max_id": self.max_id,
                          "sha256": digest})
        self.max_id = -1

    def abandon(self) -> None:
        """Remove the unfinished shard (after an error or Ctrl-C)."""
        if self._stack is not None:
            stack, self._sink, self._stack = self._stack, None, None
            stack.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)


class Encoder:
    """Encodes the planned blocks from `state["next_block"]` on, writing shards and recording
    progress in `state` (saved to prepare-state.json each time a training shard is finished)."""

    def __init__(self, tok, plan, data_dir: Path, state: dict, shard_tokens: int, log):
        self.tok, self.plan, self.blocks = tok, plan, plan.blocks
        self.data_dir, self.state, self.shard_tokens, self.log = data_dir, state, shard_tokens, log
        self.eot = np.array([tok.eot_id])
        self.counts = {k: np.array(v, dtype=np.int64) for k, v in state["counts"].items()}
        fp = tok.fingerprint()
        self.writers = {s: ShardWriter(data_dir, s, tok.vocab_size, fp, state["shards"][s]) for s in ("train", "val")}

    def _work(self, j: int) -> Piece:
        block = self.plan.read(j)
        return Piece(self.blocks[j], block, [self._encode(part.texts) for part in block.parts])

    def _encode(self, texts: list[str]) -> np.ndarray:
        """The ids of `texts`, an EOT between each two (a part's last document is ended by `_take`)."""
        ids = []
        for k, text in enumerate(texts):
            if k:
                ids.append(self.eot)
            ids.append(self.tok.encode_array(text) if text else np.zeros(0, np.int64))
        return ids[0] if len(ids) == 1 else np.concatenate(ids) if ids else np.zeros(0, np.int64)

    def run(self, workers: int) -> dict:
        st = self.state
        start = st["next_block"]
        todo = range(start, len(self.blocks))
        total = self.blocks.nominal_bytes()
        self.log.line(f"encoding {len(self.blocks) - start} blocks "
                      f"({self.blocks.nominal_bytes(start) / 1e6:.1f} MB) "
                      f"on {workers} threads...")
        bar = self.log.progress("encoding", len(self.blocks), total, unit="blocks")
        bar.files = start
        bar.bytes = self.blocks.nominal_bytes(0, start)
        bar.resumed = bar.bytes
        try:
            for j, piece in zip(todo, stream.ordered_map(self._work, todo, workers)):
                self._take(piece)
                bar.update(j + 1, piece.text.n_bytes)
                if self.writers["train"].count >= self.shard_tokens:
                    self._checkpoint(j + 1)
            self._checkpoint(len(self.blocks))
        except BaseException:
            for w in self.writers.values():
                w.abandon()
            raise
        bar.done()
        return self._stats()

    def _take(self, piece: Piece) -> None:
        st, b = self.state, piece.block
        st["file_not_utf8"] = st["file_not_utf8"] or not piece.text.valid_utf8
        st["empty_documents"] = st.get("empty_documents", 0) + piece.text.empty_documents
        if piece.text.skipped:
            st["skipped_records"] = st.get("skipped_records", 0) + piece.text.skipped
            st["first_skipped_record"] = st.get("first_skipped_record") or piece.text.first_skipped
        if piece.text.bad_lines:
            st["not_utf8_lines"] = st.get("not_utf8_lines", 0) + piece.text.bad_lines
            st["first_not_utf8_line"] = st.get("first_not_utf8_line") or str(piece.text.first_bad)
        for part, ids in zip(piece.text.parts, piece.ids):
            split = "val" if part.val else "train"
            if len(ids):
                if st["open_document"] not in (None, split):
                    self._end_document(st["open_document"])  # a file split across train and val: two documents
                self.writers[split].write(ids)
                self.counts[split] += np.bincount(ids, minlength=self.tok.vocab_size)
                st["documents"] += len(part.texts) - 1  # the EOTs between its documents
                st["open_document"] = split
            st["bytes"][split] += part.n_bytes
            if part.ends and st["open_document"] is not None:
                self._end_document(st["open_document"])
                st["open_document"] = None
        if b.last:
            st["not_utf8_files"] += st["file_not_utf8"]
            st["file_not_utf8"] = False

    def _end_document(self, split: str) -> None:
        self.writers[split].write(self.eot)
        self.counts[split][self.tok.eot_id] += 1
        self.state["documents"] += 1

    def _checkpoint(self, next_block: int) -> None:
        """Finish both open shards and save the state: a rerun continues from `next_block`."""
        for w in self.writers.values():
            w.close()
        self.state["next_block"] = next_block
        self.state["counts"] = {k: v.tolist() for k, v in self.counts.items()}
        write_json(self.data_dir / STATE_FILE, self.state)

    def _stats(self) -> dict:
        st, counts = self.state, self.counts
        n_tokens = {k: int(c.sum()) for k, c in counts.items()}
        total_bytes = sum(st["bytes"].values())
        not_utf8 = st["not_utf8_files"]
        n_files = len(self.plan.source.files)
        if not_utf8 > max(10, n_files // 10):
            self.log.line(f"note: {not_utf8} of {n_files} files are not UTF-8: is the corpus binary in part?")
        bad_lines, skipped = st.get("not_utf8_lines", 0), st.get("skipped_records", 0)
        if skipped:
            self.log.line(f"note: {skipped:,} record{'s' if skipped > 1 else ''} left out (--skip-bad-records), "
                          f"the first: {st['first_skipped_record']}")
        if bad_lines:
            self.log.line(f"note: {bad_lines:,} line{'s' if bad_lines > 1 else ''} not UTF-8 (the first: "
                          f"{st['first_not_utf8_line']}), read with U+FFFD for the bytes that are not: convert the "
                          "file to UTF-8 to keep its text as written (e.g. iconv -f latin1 -t utf-8)")
        return {
            "bytes": total_bytes,
            "train_bytes": st["bytes"]["train"],
            "val_bytes": st["bytes"]["val"],
            "not_utf8_files": not_utf8,
            "not_utf8_lines": bad_lines,
            "skipped_records": skipped,
            "first_skipped_record": st.get("first_skipped_record"),
            "first_not_utf8_line": st.get("first_not_utf8_line"),
            "empty_files": int(np.count_nonzero(np.asarray(self.plan.sizes) == 0)),
            "train_tokens": n_tokens["train"],
            "val_tokens": n_tokens["val"],
            "shards": st["shards"],
            "bytes_per_token": round(total_bytes / max(sum(n_tokens.values()) - st["documents"], 1), 4),
            "unigram_val_nats": round(unigram_entropy(counts["train"], counts["val"]), 4),
            "documents": {k: int(c[self.tok.eot_id]) for k, c in counts.items()},
            "empty_documents": st.get("empty_documents", 0),
        }
