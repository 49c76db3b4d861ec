"""The source a preparation's request names: open_source(inputs, text_field) is a records.RecordSource
when a text field is given (each record a document), else a files.FilesSource (each file a document;
none given: the Python standard library's). A new kind of `Source` is chosen here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from andrea.data.sources import Source, files, records
from andrea.errors import UserError

COMPRESSED_SUFFIXES = {".gz", ".bz2", ".xz", ".zst", ".zip", ".7z"}


def open_source(inputs: list[str] | None, text_field: str | None = None,
                progress: Callable[[int], None] | None = None) -> Source:
    """The source the request names: records read from `text_field` when one is given, else files.
    A compressed file named as an input is refused with what to do (none is read)."""
    for spec in inputs or ():
        suffix = Path(spec).suffix.lower()
        if suffix in COMPRESSED_SUFFIXES and Path(spec).expanduser().is_file():
            raise UserError(f"{spec} is compressed ({suffix}): andrea reads files as stored; decompress it first "
                            "and give the decompressed file (a directory or glob input leaves such files out)")
    if text_field is None:
        return files.FilesSource.open(inputs, progress)
    return records.RecordSource.open(inputs, text_field, progress)
