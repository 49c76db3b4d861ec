"""docs/architecture.md's layout names every module of andrea/ and minitensor/, and nothing that is not there.

The layout is the ```text block under "## The layout". A line indented less than the description
column is an entry: its names (before the first run of two spaces) and its words after them and on
its continuation lines are read in one folder. An entry that is a single folder (`layers/`) opens it:
its words are read in that folder, and the entries indented two spaces deeper beneath it are its
contents; any other entry's words are read in the folder it is under. A word that is a path ending
in `/` or in a known suffix (`.py`, `.cu`, ...) is a name, and must exist; `NAME.*` is a
placeholder, not a name. A module is named when its path is, or, for a package's `__init__.py` and
`__main__.py`, when its folder is (the folder's line says what they hold).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("andrea", "minitensor")
DESCRIPTION_COLUMN = 23
NAME = re.compile(r"[\w-]+(?:[./][\w-]+)*(?:/|\.(?:py|cu|cuh|sh|json|yaml|md|toml))")
PLACEHOLDER = "NAME."
NAMED_BY_FOLDER = ("__init__.py", "__main__.py")


def layout_block(text):
    """The ```text block under "## The layout"."""
    m = re.search(r"^## The layout\n\n```text\n(.*?)^```", text, re.S | re.M)
    assert m, "docs/architecture.md: no ```text block right under '## The layout'"
    return m.group(1)


def entries(block):
    """(folder its words are read in, its words) for each entry of the layout, in order; an entry
    that opens a folder gives that folder as its first word, as the path from the repository."""
    stack, out = [], []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip():
            continue
        if indent >= DESCRIPTION_COLUMN:
            assert out, f"layout: a continuation line before any entry: {line.strip()!r}"
            out[-1][1].extend(line.split())
            continue
        depth = indent // 2
        assert indent % 2 == 0 and depth <= len(stack), f"layout: {line.strip()!r} is indented under no folder"
        del stack[depth:]
        left, _, rest = line.strip().partition("  ")
        names = left.split()
        if len(names) == 1 and names[0].endswith("/"):
            stack.append(names[0].rstrip("/"))
            names = ["/" + "/".join(stack) + "/"]
        out.append(("/".join(stack), names + rest.split()))
    return out


def named_paths(block):
    """Every path the layout names, relative to the repository; a folder's ends in `/`."""
    paths = set()
    for folder, words in entries(block):
        for word in words:
            name = word.strip("`'\"()[],;:.")
            if NAME.fullmatch(name.lstrip("/")) and not name.startswith(PLACEHOLDER):
                paths.add(name.lstrip("/") if name.startswith("/") else f"{folder}/{name}".lstrip("/"))
    return paths


def problems(block, modules, exists):
    """(modules the layout does not name, names in it that do not exist), each sorted. A folder
    named as a path (`cupy_backends/cuda/libs/`) names each folder on that path."""
    paths = named_paths(block)
    folders = {str(f) for p in paths if p.endswith("/") for f in (Path(p), *Path(p).parents)}
    missing = [m for m in modules if m not in paths
               and not (Path(m).name in NAMED_BY_FOLDER and str(Path(m).parent) in folders)]
    return sorted(missing), sorted(p for p in paths if not exists(p))


def real_modules():
    return sorted(str(p.relative_to(ROOT)) for d in PACKAGES for p in (ROOT / d).rglob("*.py")
                  if "__pycache__" not in p.parts)


def _exists(path):
    return (ROOT / path).is_dir() if path.endswith("/") else (ROOT / path).is_file()


BLOCK = layout_block(DOC.read_text())
MODULES = real_modules()


def test_modules_were_found():
    assert len(MODULES) > 100 and "minitensor/flat.py" in MODULES


def test_layout_names_every_module():
    missing, _ = problems(BLOCK, MODULES, _exists)
    assert missing == [], f"docs/architecture.md's layout does not name: {', '.join(missing)}"


def test_layout_names_nothing_that_is_not_there():
    _, stale = problems(BLOCK, MODULES, _exists)
    assert stale == [], f"docs/architecture.md's layout names what does not exist: {', '.join(stale)}"


def test_a_module_left_out_is_reported():
    planted = ["minitensor/layers/planted.py", "andrea/planted/__init__.py"]
    missing, _ = problems(BLOCK, MODULES + planted, _exists)
    assert missing == sorted(planted)


def test_a_name_is_read_in_its_own_folder():
    # cpu/ and kernels/ name a linear.py too: neither stands for the layer's
    block = BLOCK.replace("its maths in the opening docstring: linear.py", "its maths in the opening docstring:", 1)
    assert block != BLOCK
    missing, stale = problems(block, MODULES, _exists)
    assert (missing, stale) == (["minitensor/layers/linear.py"], [])


def test_a_name_that_is_not_there_is_reported():
    block = BLOCK.replace("loss.py;", "loss.py planted.py;", 1).replace("  device.py  ", "  device.py planted/", 1)
    assert block.count("planted") == 2
    _, stale = problems(block, MODULES, _exists)
    assert stale == ["minitensor/layers/planted.py", "minitensor/planted/"]


def test_an_entry_under_no_folder_is_refused():
    with pytest.raises(AssertionError, match="indented under no folder"):
        entries("docs/                  these guides\n      stray.py         nowhere\n")
