"""JSON Lines: one JSON object a line, each a document whose text is the string in a named field.

    {"id": 1, "text": "The first document.\\nIts second line."}
    {"id": 2, "text": "The second."}

`scan` streams a file in chunks (never whole) into blocks of whole lines; `documents` reads one
block's lines and parses them. A line that is blank (spaces only) is no document; a line that is
not a JSON object, lacks the field or holds something else than a string there is a one-line error
naming the file and the line number, and so is a line nested too deeply to decode. The text is the
field's string as JSON decodes it; a line holding bytes that are not UTF-8, or a lone surrogate escape
("\\ud800", which UTF-8 cannot hold), is read with U+FFFD in their place and counted as that one line
not UTF-8 (andrea.data.sources.Documents), never as its block. A compressed file (gzip, bzip2, xz,
zstd: told by its first bytes) is refused with what to do: decompress it first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from andrea.data import stream
from andrea.data.sources import Documents, Unit
from andrea.errors import UserError

CHUNK = 1 << 20  # bytes read at a time while scanning
BLANK = np.zeros(256, dtype=bool)
BLANK[[ord(" "), ord("\t"), ord("\r"), ord("\n")]] = True  # JSON's whitespace
SURROGATE = re.compile("[\ud800-\udfff]")


def scan(path: Path, size: int, U: int, progress: Callable[[int], None], text_field: str = "") -> Iterator[Unit]:
    """The blocks of the JSON Lines file at `path` (of `size` bytes): whole lines, a block starting
    at the first line that starts at or after a multiple of `U` (a `Unit` each). `progress(n)` is
    called with the bytes of each chunk read; the text field is read by `documents` only."""
    _not_compressed(path)
    unit_start, unit_first, documents, lines = 0, 1, [], 0  # the block being gathered; the lines so far
    for starts, numbers, full in _lines(path, size, progress):
        taken = 0
        for cut in np.flatnonzero(np.diff(np.concatenate([[unit_start // U], starts // U]))):
            # line `cut` of this batch starts a new block: the gathered one ends where that line starts
            documents.append(numbers[taken:cut][full[taken:cut]])
            yield Unit(unit_start, int(starts[cut]), unit_first, np.concatenate(documents),
                       int(numbers[cut]) - unit_first)
            unit_start, unit_first, documents, taken = int(starts[cut]), int(numbers[cut]), [], cut
        documents.append(numbers[taken:][full[taken:]])
        lines += len(numbers)
    if unit_start < size:
        yield Unit(unit_start, size, unit_first, np.concatenate(documents), lines + 1 - unit_first)


COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


def _not_compressed(path: Path) -> None:
    """A UserError when the file at `path` starts as a compressed file does: JSON Lines are read as stored."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from e
    for magic, kind in COMPRESSED.items():
        if head.startswith(magic):
            raise UserError(f"{path} is compressed ({kind}): JSON Lines files are read uncompressed; decompress it "
                            "first (gzip -dk, bunzip2 -k, xz -dk or zstd -d) and give the decompressed file")


def _lines(path: Path, size: int, progress) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(starts, numbers, not blank) of the lines of the file, a batch per chunk read: the lines that
    end in that chunk (a last line without a newline ends with the file)."""
    start, number, seen = 0, 1, False  # the line read so far: where it starts, its number, any non-blank byte
    try:
        with open(path, "rb") as f:
            pos = 0
            while chunk := f.read(CHUNK):
                data = np.frombuffer(chunk, dtype=np.uint8)
                ends = np.flatnonzero(data == 0x0A)
                begins = np.concatenate([[0], ends + 1])  # of each line's bytes in this chunk, the open one's last
                full = _not_blank(data, begins, np.append(ends, len(data)))
                full[0] |= seen
                starts = np.concatenate([[start], pos + ends[:-1] + 1]) if len(ends) else np.zeros(0, np.int64)
                if len(ends):
                    start = pos + int(ends[-1]) + 1
                seen = bool(full[-1])
                yield starts.astype(np.int64), number + np.arange(len(ends), dtype=np.int64), full[:len(ends)]
                number += len(ends)
                pos += len(chunk)
                progress(len(chunk))
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from e
    if start < size:
        yield np.array([start], np.int64), np.array([number], np.int64), np.array([seen])


def _not_blank(data: np.ndarray, begins: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Whether each piece data[begins[k]:ends[k]] holds a byte that is not JSON whitespace. A JSON
    line starts with its object's brace: only a piece that starts with whitespace is looked through."""
    nonempty = ends > begins
    first_blank = BLANK[data[np.minimum(begins, len(data) - 1)]]
    full = nonempty & ~first_blank
    for k in np.flatnonzero(nonempty & first_blank).tolist():
        full[k] = not BLANK[data[begins[k]:ends[k]]].all()
    return full


def documents(path: Path, start: int, end: int, first: int, count: int, text_field: str,
              skip_bad: bool = False) -> Documents:
    """The documents of the block [start, end) of the file at `path`, whose first line is line `first`;
    with `skip_bad`, a line that cannot be read is left out, its error kept in `skipped`."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            raw = f.read(end - start)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from e
    text, where, bad_bytes = stream.decode_lines(raw)
    bad = {raw.count(b"\n", 0, k) for k in where}  # the block's lines that are not UTF-8
    if start == 0:
        text = text.removeprefix("\ufeff")  # a byte-order mark some tools write before the first line
    out = Documents(len(raw), True)
    for k, line in enumerate(text.split("\n")):
        if line.strip(" \t\r"):
            try:
                value = _field(line, path, first + k, text_field)
            except UserError as e:
                if not skip_bad:
                    raise UserError(f"{e}; or leave out every such line, counted, with prepare --skip-bad-records") \
                        from None
                out.skipped.append(str(e))
                continue
            try:
                size = len(value.encode("utf-8"))
            except UnicodeEncodeError:  # a lone surrogate escape: not representable in UTF-8
                value = SURROGATE.sub("\ufffd", value)
                size = len(value.encode("utf-8"))
                if k not in bad:
                    bad.add(k)
                    bad_bytes += len(line.encode("utf-8", errors="replace")) + 1
            out.records.append(first + k)
            out.texts.append(value)
            out.sizes.append(size)
    out.bad_records, out.bad_bytes, out.valid_utf8 = [first + k for k in sorted(bad)], bad_bytes, not bad
    return out


def _field(line: str, path: Path, number: int, text_field: str) -> str:
    """The string in `text_field` of the JSON object on line `number`; a UserError naming the line."""
    where = f"{path}, line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e.msg}, column {e.colno}): a JSON Lines file holds one JSON object "
                        "a line; fix or remove that line") from None
    except RecursionError:
        raise UserError(f"{where}: nested too deeply to read (arrays or objects inside each other beyond "
                        f"Python's recursion limit): a record holds its text in a string field; fix or remove "
                        "that line") from None
    if not isinstance(record, dict):
        raise UserError(f"{where}: a JSON {type(record).__name__}, not an object with a {text_field!r} field")
    if text_field not in record:
        fields = ", ".join(repr(k) for k in list(record)[:8]) or "none"
        raise UserError(f"{where}: no field {text_field!r} (its fields: {fields}): name the field that holds the "
                        "text with --text-field")
    value = record[text_field]
    if not isinstance(value, str):
        raise UserError(f"{where}: the field {text_field!r} holds {_kind(value)}, not a string of text")
    return value


def _kind(value) -> str:
    return "null" if value is None else f"a JSON {type(value).__name__}"
