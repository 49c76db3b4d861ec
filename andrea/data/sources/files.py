"""The files source: files, directories and globs of UTF-8 text, or the Python standard library.

A file is a document. The files are listed by andrea.data.corpus (the default corpus's generated
tables left out) and cut into blocks at line ends by andrea.data.stream, which also chooses the
validation blocks: by a hash of each block's path and index, or a one-file corpus's tail. A file
larger than a block may so have text on both sides of the split: each side's text is then a
document of its own, ended by an end-of-text id, which is what lets a few large files (or one book)
give a validation split of the fraction asked for.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from andrea.data import stream
from andrea.data.corpus import load_corpus
from andrea.data.request import MAX_VAL_FRACTION
from andrea.data.sources import BlockText, Part, Place, Plan, Source
from andrea.errors import UserError


class FilesSource(Source):
    @classmethod
    def open(cls, inputs: list[str] | None, progress: Callable[[int], None] | None = None) -> FilesSource:
        corpus = load_corpus(inputs, progress)
        return cls(corpus.files, corpus.description, corpus.left_out)

    def plan(self, sizes: np.ndarray, val_fraction: float, log=None) -> FilesPlan:
        return FilesPlan(self, sizes, stream.plan_blocks(self.files, sizes, self.root, val_fraction), val_fraction)


class FilesPlan(Plan):
    def __init__(self, source: FilesSource, sizes: np.ndarray, blocks: stream.Blocks, val_fraction: float):
        self.source, self.sizes, self.blocks, self.val_fraction = source, sizes, blocks, val_fraction
        self.reader = stream.BlockReader(source.files, sizes, blocks)

    def read(self, j: int) -> BlockText:
        n, text, bad, bad_bytes = self.reader.read_lines(j)
        b = self.blocks[j]
        first_bad = Place(self.source.files[b.file], offset=bad[0]) if bad else None
        return BlockText(n, not bad, [Part(b.val, [text], n, ends=b.last)], 0, len(bad), bad_bytes, first_bad)

    def check(self) -> None:
        """Both splits hold text (a corpus of one line has no validation: a cut falls only at a line's
        end), else a UserError with what gives them some. Only the cuts are read, and only until a
        block with bytes is found, which is at once for all but very long lines."""
        files, sizes, blocks = self.source.files, self.sizes, self.blocks
        for name, side in (("validation", True), ("training", False)):
            if any(self.reader.n_bytes(int(j)) for j in np.flatnonzero(blocks.val == side)):
                continue
            nonempty = np.flatnonzero(sizes)
            if len(nonempty) > 1:
                raise UserError(f"the {name} split of this corpus holds no text (its blocks are empty pieces of long "
                                "lines): give more text, more files, or another --val-fraction")
            raise UserError(_one_file_advice(files[int(nonempty[0])], int(sizes[nonempty[0]]), name,
                                             self.val_fraction))

    def manifest(self, documents: dict) -> dict:
        files, blocks, root = self.source.files, self.blocks, self.source.root
        val_names = sorted({files.relative(i) for i in np.unique(blocks.file[blocks.val]).tolist()})
        left_out = self.source.left_out
        return {
            "files": len(files),
            "val_file_names": val_names,
            "left_out_generated": {
                "files": len(left_out),
                "bytes": sum(p.stat().st_size for p in left_out),
                "names": [p.relative_to(root).as_posix() for p in left_out],
            },
            "val_files": len(val_names),
            "train_files": len(np.unique(blocks.file[~blocks.val])),
        }


def _one_file_advice(path: Path, size: int, name: str, val_fraction: float) -> str:
    """Why a one-file corpus gives the split `name` no text, and the --val-fraction that gives it some."""
    with open(path, "rb") as f:  # the last newline with text after it
        f.seek(max(size - (1 << 20), 0))
        tail = f.read()
    last = tail.rfind(b"\n", 0, len(tail) - 1)
    line = max(size - (1 << 20), 0) + last if last >= 0 else -1
    why = (f"the {name} split of {path} ({size} bytes) would hold no text: a one-file corpus validates on its "
           f"last --val-fraction ({val_fraction:g}), starting at a line's start")
    if name == "validation" and line > 0:
        wanted = math.ceil(1000 * (1 - line / size) + 1e-9) / 1000  # moves the cut before the last line
        if wanted < MAX_VAL_FRACTION:
            return f"{why}, and the last line begins before that: use --val-fraction {wanted:g} or more"
    return f"{why}: give text of several lines (at least two), or several files"
