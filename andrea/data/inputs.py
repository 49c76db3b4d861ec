"""The corpus's files from what the user names: files, directories and glob patterns, or the default
corpus, the `.py` source of the running interpreter's standard library (which needs no download).

A corpus is a sorted list of files; each file is one document. A directory or glob input takes
every file but hidden ones, `SKIPPED_DIRS` and known binary formats (`BINARY_SUFFIXES`); a file
named explicitly is always taken. The listing streams: a large corpus is never held as a list of
`Path`s (andrea.data.corpus stores it compactly).
"""

from __future__ import annotations

import fnmatch
import glob
import heapq
import os
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from andrea.errors import UserError

# Directory and glob inputs take every file except these: hidden entries (.git, editor files) and
# formats that are never text. An explicitly named file is always taken.
SKIPPED_DIRS = {"__pycache__", "site-packages", "dist-packages", "node_modules"}
BINARY_SUFFIXES = (
    {".pyc", ".pyo", ".so", ".dll", ".dylib", ".o", ".a", ".exe", ".bin", ".whl", ".jar"}  # compiled
    | {".npy", ".npz", ".pkl", ".pt", ".safetensors", ".db", ".sqlite"}  # data
    | {".zip", ".gz", ".bz2", ".xz", ".zst", ".tar", ".7z"}  # archives
    | {".png", ".jpg", ".jpeg", ".gif", ".bmp", ".ico", ".webp", ".pdf", ".mp3", ".wav", ".mp4"}  # media
    | {".ttf", ".otf", ".woff", ".woff2"}  # fonts
)



def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus_files() -> list[Path]:
    """The `.py` files of this interpreter's standard library, sorted, without site-packages."""
    files = []
    for dirpath, dirnames, filenames in os.walk(stdlib_root()):
        # Pruned, not filtered: site-packages can be far larger than the stdlib itself.
        dirnames[:] = [d for d in dirnames if d not in {"site-packages", "dist-packages", "__pycache__"}]
        files.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    return sorted(p for p in files if p.is_file())


def resolve_inputs(specs: Iterable[str], progress: Callable[[int], None] | None = None) -> list[Path]:
    """Expand files, directories and glob patterns into a sorted, deduplicated list of files.

    A named file is taken as is. A directory is searched recursively for every file except
    hidden ones, those under `SKIPPED_DIRS` (`__pycache__`, ...) and known binary formats
    (`BINARY_SUFFIXES`). A pattern with `*`, `?` or `[` is a glob (`**` recurses): the files it
    matches are filtered the same way, the directories searched. A spec that yields no file is a
    UserError. `progress`, if given, is called with the number of files found so far as they are
    found (listing a large corpus takes a while).
    """
    return [Path(name) for name in iter_input_names(specs, progress)]



def iter_input_names(specs: Iterable[str], progress: Callable[[int], None] | None = None,
                     keep: Callable[[str], bool] | None = None, looked_for: str = "") -> Iterator[str]:
    """`resolve_inputs` one absolute path string at a time, without holding the list: a directory
    is walked one directory at a time (`_walk_text_files`), each spec's files come sorted, and the
    specs' streams are merged, a file named twice given once. Paths are ordered part by part, as
    `Path`s compare: a directory's files come at the place of its name among its siblings.

    A glob is the exception: its matches are expanded, sorted and held whole (the glob module
    returns them as a list anyway). A spec that yields no file raises when its stream ends.
    `keep`, if given, chooses among the files a directory or a glob yields (a source's suffixes,
    which `looked_for` names for the error when none is found); a file named explicitly is always taken.
    """
    progress = progress or (lambda n: None)
    previous, count = None, 0
    for name in heapq.merge(*(_spec_names(spec, keep, looked_for) for spec in specs), key=_part_key):
        if name != previous:
            count += 1
            progress(count)
            yield name
        previous = name


def _part_key(name: str) -> str:
    # Paths compare part by part: as strings whose separator sorts before every character.
    return name.replace(os.sep, "\0")


def _spec_names(spec: str, keep: Callable[[str], bool] | None = None, looked_for: str = "") -> Iterator[str]:
    """The files of one spec in `_part_key` order; a UserError once it is clear there are none."""
    path = os.path.expanduser(spec)
    if os.path.isfile(path):
        names: Iterable[str] = [os.path.abspath(path)]
    elif os.path.isdir(path):
        names = _walk_text_files(path)
    elif any(ch in spec for ch in "*?["):
        names = sorted(set(_glob_names(path)), key=_part_key)
    else:
        names = []
    if keep is not None and not os.path.isfile(path):
        names = filter(keep, names)
    found = False
    for name in names:
        found = True
        yield name
    if not found:
        raise UserError(_nothing_found(spec, path, looked_for if keep is not None else ""))


def _nothing_found(spec: str, path: str, looked_for: str) -> str:
    """What a spec that yields no file did look for."""
    if not (os.path.isdir(path) or any(ch in spec for ch in "*?[")):
        return f"input {spec!r} matches no file: no such file or directory"
    what = "the directory holds" if os.path.isdir(path) else "the glob pattern matches"
    wanted = looked_for or ("text file (hidden files and binary or compressed formats, .gz, .zip, .png, .pyc, ..., "
                            "are left out)")
    return f"input {spec!r} matches no file: {what} no {wanted}; a file named by itself is always read"


def _glob_names(pattern: str) -> Iterator[str]:
    for match in _glob(pattern):
        if os.path.isdir(match):
            yield from _walk_text_files(match)
        elif os.path.isfile(match) and _looks_like_text(Path(match)):
            yield os.path.abspath(match)


def _glob(pattern: str) -> Iterator[str]:
    """The paths `pattern` matches, as `glob.glob(pattern, recursive=True)` gives them, except that a
    wildcard (`**` included) never goes through a symbolic link to a directory, as the directory walk
    never enters one: `self -> .` or `up -> ..` would make `**` loop or take each file many times
    (glob follows them until the path is too long). A link written out in the pattern is followed."""
    parts = Path(os.path.expanduser(pattern)).parts
    fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    top = os.path.join(*parts[:fixed]) if fixed else os.curdir
    if fixed == len(parts):
        return iter([top] if os.path.lexists(top) else [])
    matches = _match(top, parts[fixed:], prefix=fixed > 0)
    if pattern.endswith(("/", os.sep)):  # as in glob: a trailing slash matches directories only
        return (m for m in matches if os.path.isdir(m))
    return matches


def _match(directory: str, parts: tuple[str, ...], prefix: bool = True) -> Iterator[str]:
    """The paths under `directory` that the pattern parts `parts` match (see `_glob`)."""
    head, rest = parts[0], parts[1:]
    name = (lambda entry: os.path.join(directory, entry)) if prefix else (lambda entry: entry)
    if head == "**":
        if not rest:  # every file and directory below: the directory itself, walked by the caller
            yield directory if prefix else os.curdir
            return
        yield from _match(directory, rest, prefix)
        for entry, is_dir in _wildcard_entries(directory, "*"):
            if is_dir:
                yield from _match(name(entry), parts)
        return
    if not glob.has_magic(head):
        path = name(head)
        if not rest:
            if os.path.lexists(path):
                yield path
        elif os.path.isdir(path):
            yield from _match(path, rest)
        return
    for entry, is_dir in _wildcard_entries(directory, head):
        if not rest:
            yield name(entry)
        elif is_dir:
            yield from _match(name(entry), rest)


def _wildcard_entries(directory: str, part: str) -> list[tuple[str, bool]]:
    """(name, is a real directory) of the entries of `directory` that the wildcard `part` matches:
    hidden names only for a part that starts with a dot, and no symbolic link to a directory."""
    entries = _scandir(directory)
    taken = []
    for entry in entries:
        if entry.name.startswith(".") and not part.startswith("."):
            continue
        if not fnmatch.fnmatchcase(entry.name, part):
            continue
        linked_dir = entry.is_symlink() and os.path.isdir(entry.path)
        if not linked_dir:
            taken.append((entry.name, _is_dir(entry)))
    return sorted(taken)


def _scandir(directory: str) -> list[os.DirEntry]:
    """The entries of `directory`, unsorted; none for one that cannot be listed (as `os.walk` skips it)."""
    try:
        with os.scandir(directory) as it:
            return list(it)
    except OSError:
        return []


def _walk_text_files(top: str) -> Iterator[str]:
    """The files a directory input takes under the directory `top`, as absolute paths in
    `_part_key` order.

    Depth first with each directory's entries sorted by name, files and subdirectories together,
    so the order is that of sorting every path at once, while only the entries of the directories
    on the current path are held. Hidden entries, `SKIPPED_DIRS` and binary suffixes are left out;
    a symbolic link to a directory is not followed (a link to a file is taken); a directory that
    cannot be listed is skipped, as `os.walk` does. Nothing when `top`, as written, passes through a
    skipped directory.
    """
    if SKIPPED_DIRS & set(Path(top).parts):
        return
    stack = [iter(_directory_entries(os.path.abspath(top)))]
    while stack:
        entry = next(stack[-1], None)
        if entry is None:
            stack.pop()
        elif entry[1]:
            stack.append(iter(_directory_entries(entry[0])))
        else:
            yield entry[0]


def _directory_entries(directory: str) -> list[tuple[str, bool]]:
    """(path, is a directory to enter) for the entries of `directory` a walk takes, sorted by name."""
    entries = _scandir(directory)
    taken = []
    for entry in entries:
        if entry.name.startswith(".") or entry.name in SKIPPED_DIRS:
            continue
        if _is_dir(entry):
            if not entry.is_symlink():
                taken.append((entry.name, True))
        elif not _binary_suffix(entry.name) and _is_file(entry):
            taken.append((entry.name, False))
    taken.sort()
    return [(os.path.join(directory, name), is_dir) for name, is_dir in taken]


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _is_file(entry: os.DirEntry) -> bool:
    try:
        return entry.is_file()
    except OSError:
        return False


def _binary_suffix(name: str) -> bool:
    return Path(name).suffix.lower() in BINARY_SUFFIXES


def _looks_like_text(path: Path) -> bool:
    return path.suffix.lower() not in BINARY_SUFFIXES and not SKIPPED_DIRS & set(path.parts)
