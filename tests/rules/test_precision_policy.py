"""One precision policy (issue 47): no list of float dtypes outside minitensor/precision.py.

Which float dtypes an array may hold, which a kernel is built for and what each is summed in are the
policy's to say (minitensor.precision: FLOATS, is_float, check_float, resolve, kernel_dtypes,
accumulate_of, c_type); a module that keeps its own `dtype in (np.float32, np.float64)` goes stale the
day a dtype is added. The rule reads the Python sources of minitensor/, andrea/ and scripts/ by their
syntax trees and flags, naming file:line:

- a tuple, list, set or dict literal (a dict's keys, or its values) holding two or more different float
  dtypes, named as strings ("float32", "float64", "bfloat16", "float16"), as attributes (np.float32,
  cupy.float64, ml_dtypes.bfloat16, np.double, ...), or as np.dtype(...) of either;
- a chain of comparisons naming two or more of them, `dt == np.float32 or dt == np.float64`.

A list of other things that happen to name two dtypes is kept out only by a narrow, explained exemption
below (EXEMPT: a file and the function holding the literal or the name it is assigned to).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("minitensor", "andrea", "scripts")
POLICY = "minitensor/precision.py"

FLOAT_NAMES = {"float16", "float32", "float64", "bfloat16"}
FLOAT_ATTRIBUTES = FLOAT_NAMES | {"half", "single", "double", "float_", "longdouble"}

# (file, where) -> why it is not a dtype allow-list; `where` is the function (Class.method) holding the
# literal, and the name it is assigned to (Class.method.name, or a module's NAME)
EXEMPT = {
    ("andrea/run/ordercheck.py", "DTYPES"):
        "a wire format: the tag names the order check sends as integers, of every dtype a collective moves "
        "(uint8 and int64 too), not the dtypes the engine computes in",
    ("andrea/run/checkpoint.py", "_DTYPES"):
        "a file format: the dtypes a checkpoint's .npz may hold (ints, bools, complex too), refused before "
        "a byte is trusted; not what the engine computes in",
    **{("minitensor/backends/kernels/attention.py", name):
       "a tuning table: the TF32 and float64 flash kernels' tiles (attention.cu's constants) per dtype; which "
       "dtypes the wrappers take is the policy's (precision.is_float), the table only sizes their launches"
       for name in ("FLASH_FWD_TILE", "FLASH_DQ_TILE", "FLASH_DKV_TILE", "FLASH_HS_MAX")},
}

# Lines in other engineers' areas that the rule flags today (issue 47's owners fix them; each entry goes
# when its owner's change lands). Not exemptions: allow-lists the policy must replace.
PENDING = {}  # lines in files whose owners are still moving them to the policy: none left


def dtype_named(node):
    """The float dtype a node names ("float32"), or None: a string, an attribute (np.float64), or a
    np.dtype(...) call of either."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in FLOAT_NAMES:
        return node.value
    if isinstance(node, ast.Attribute) and node.attr in FLOAT_ATTRIBUTES:
        return {"half": "float16", "single": "float32", "double": "float64", "float_": "float64"}.get(node.attr,
                                                                                                     node.attr)
    if (isinstance(node, ast.Call) and node.args and len(node.args) == 1
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "dtype"):
        return dtype_named(node.args[0])
    return None


def _named(nodes):
    return {d for d in map(dtype_named, nodes) if d is not None}


def _compared(node):
    """The dtypes the comparisons directly under a BoolOp name."""
    names = set()
    for value in node.values:
        if isinstance(value, ast.Compare):
            names |= _named([value.left, *value.comparators])
    return names


def allow_lists(tree):
    """[(line, where, dtypes), ...]: every dtype allow-list in a module's syntax tree."""
    found = []

    def visit(node, where):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            where = f"{where}.{node.name}" if where else node.name
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if names:
                where = f"{where}.{names[0]}" if where else names[0]
        hit = set()
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            hit = _named(node.elts)
        elif isinstance(node, ast.Dict):
            keys, values = _named(k for k in node.keys if k is not None), _named(node.values)
            hit = keys if len(keys) >= 2 else values
        elif isinstance(node, ast.BoolOp):
            hit = _compared(node)
        if len(hit) >= 2:
            found.append((node.lineno, where, tuple(sorted(hit))))
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(tree, "")
    return found


def findings(root=ROOT, skip=()):
    """[(file, line, where, dtypes), ...] over the scanned sources, the policy itself and `skip` left out."""
    out = []
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == POLICY or "/tests/" in f"/{rel}" or (rel.split("/")[0], rel) in skip:
                continue
            for line, where, dtypes in allow_lists(ast.parse(path.read_text(), rel)):
                if (rel, where) not in EXEMPT and (rel, where) not in PENDING:
                    out.append((rel, line, where, dtypes))
    return out


def test_the_sources_were_scanned():
    sources = [p for top in SCANNED for p in (ROOT / top).rglob("*.py")]
    assert len(sources) > 100 and (ROOT / POLICY).exists()


def test_no_dtype_allow_list_outside_the_policy():
    bad = findings()
    assert not bad, ("dtype allow-lists outside minitensor/precision.py (ask the policy: precision.FLOATS, "
                     "is_float, resolve, kernel_dtypes, accumulate_of, c_type):\n"
                     + "\n".join(f"  {f}:{line} ({where or 'module'}): {', '.join(d)}" for f, line, where, d in bad))


def test_the_policy_itself_holds_the_list():
    """The one list the rule allows is where it should be: the scan would flag precision.py's FLOATS."""
    hits = allow_lists(ast.parse((ROOT / POLICY).read_text()))
    assert any(where == "FLOATS" for _, where, _ in hits)


def test_every_exemption_and_pending_entry_still_matches_something():
    """An exemption or pending entry whose code has gone is removed, not kept as a hole in the net."""
    seen = {(path.relative_to(ROOT).as_posix(), where)
            for top in SCANNED for path in (ROOT / top).rglob("*.py")
            for _, where, _ in allow_lists(ast.parse(path.read_text()))}
    stale = sorted(k for k in (*EXEMPT, *PENDING) if k not in seen)
    assert not stale, f"exemptions or pending entries that match nothing (remove them): {stale}"


PLANTED = {
    "membership": ("def f(x):\n    return x.dtype in (np.float32, np.float64)\n", 2),
    "names": ('OK = ["float32", "bfloat16"]\n', 1),
    "set": ("def f(x):\n    if x.dtype.name not in {'float64', 'float32'}:\n        raise TypeError\n", 2),
    "dict": ('C = {"float32": "float", "float64": "double"}\n', 1),
    "dtypes": ("T = {np.dtype(np.float32): 1, np.dtype(np.float64): 2}\n", 1),
    "chain": ("def f(d):\n    return d == np.float32 or d == cupy.float64\n", 2),
    "bf16": ("import ml_dtypes\nALLOWED = (np.float32, ml_dtypes.bfloat16)\n", 2),
}


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_the_rule_flags_an_allow_list_planted_in_a_source(tmp_path, kind):
    """A temporary tree like the project's, one source with an allow-list planted: the scan names its
    file and line."""
    code, line = PLANTED[kind]
    (tmp_path / "minitensor" / "backends").mkdir(parents=True)
    (tmp_path / "andrea").mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "minitensor" / "precision.py").write_text('FLOATS = ("float32", "float64")\n')
    (tmp_path / "minitensor" / "backends" / "planted.py").write_text("import numpy as np\n\n" + code)
    (tmp_path / "andrea" / "fine.py").write_text('DTYPE = "float32"\nif dtype == np.float64:\n    pass\n')
    bad = findings(tmp_path)
    assert [(f, n) for f, n, _, _ in bad] == [("minitensor/backends/planted.py", line + 2)]


def test_one_dtype_and_other_lists_are_not_flagged():
    """A single dtype, a dtype beside other things (a case table of one dtype each), ints: not allow-lists."""
    code = ('CASES = [("tiny", "float32"), ("small", "float64")]\n'
            "x = np.zeros(3, np.float32)\n"
            "INTS = (np.int32, np.int64)\n"
            "rtol = 1e-12 if dtype == np.float64 else 1e-6\n")
    assert allow_lists(ast.parse(code)) == []
