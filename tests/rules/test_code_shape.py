"""Every function in andrea/, minitensor/ and scripts/ is short enough to read: at most 60 lines and a
cyclomatic complexity of at most 20 (issue 18, item 4).

A function's lines run from its `def` to its last line, docstring and nested functions included
(a reader reads them all). Its complexity is 1 plus its decision points, counted here from the
source with `ast` so that the check needs no tool beyond Python:

    if / elif, conditional expression (a if c else b)       +1 each
    for, while (async for too)                              +1 each
    except clause                                           +1 each
    with (async with too)                                   +1 each
    assert                                                  +1 each
    comprehension: each `for` and each of its `if`s         +1 each
    and / or: each operand after the first                  +1 each
    match: each case                                        +1 each

A nested function or class is measured as a function of its own: its decisions are not its
parent's (a lambda's are, as it has no name to be reported under). This is McCabe's count as
radon computes it, except that radon adds nothing for `with` and one for the `else` of a loop or
a `try`; on this repository the two agree within a few points.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("andrea", "minitensor", "scripts")
MAX_LINES = 60
MAX_COMPLEXITY = 20

# Functions left over a limit on purpose, with their size when they were left: (lines, complexity).
# attention_backward_cpu is one numba kernel whose body is the derivation, step by step ("forward
# was: ..."); a piece split out would have to be a numba overload (see minitensor/backends/numba_jit.py's
# causal_exp_row), more code around less maths. It may not grow.
LEFT_AS_THEY_ARE = {"minitensor/backends/numba_kernels.py:attention_backward_cpu": (62, 18)}

FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
SCOPES = (*FUNCTIONS, ast.ClassDef)
ONE_EACH = (ast.If, ast.IfExp, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler, ast.With, ast.AsyncWith,
            ast.Assert, ast.match_case)


def decision_points(node: ast.AST) -> int:
    """The decisions inside `node`, not counting those of nested functions and classes."""
    count = 0
    for child in ast.iter_child_nodes(node):
        if isinstance(child, SCOPES):
            continue
        if isinstance(child, ONE_EACH):
            count += 1
        elif isinstance(child, ast.comprehension):
            count += 1 + len(child.ifs)
        elif isinstance(child, ast.BoolOp):
            count += len(child.values) - 1
        count += decision_points(child)
    return count


def complexity(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return 1 + decision_points(function)


def line_count(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return function.end_lineno - function.lineno + 1


def functions_in(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) for every function in `tree`, methods and nested functions included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, SCOPES):
            name = f"{prefix}{node.name}"
            if isinstance(node, FUNCTIONS):
                yield name, node
            yield from functions_in(node, name + ".")
        else:
            yield from functions_in(node, prefix)


def too_big(source: str, where: str, left=LEFT_AS_THEY_ARE) -> list[str]:
    """One line per function of `source` over MAX_LINES or MAX_COMPLEXITY (or, if it is in `left`,
    over the size it was left at), saying which and by how much."""
    found = []
    for name, function in functions_in(ast.parse(source)):
        lines, cc = line_count(function), complexity(function)
        most_lines, most_cc = left.get(f"{where}:{name}", (MAX_LINES, MAX_COMPLEXITY))
        if lines > most_lines or cc > most_cc:
            found.append(f"{where}:{function.lineno} {name}: {lines} lines, complexity {cc}")
    return found


def sources():
    paths = [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(paths) > 50, "the source folders were not found"
    return {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in paths}


def test_no_function_is_too_long_or_too_complex():
    found = [line for where, source in sources().items() for line in too_big(source, where)]
    assert not found, (f"functions over {MAX_LINES} lines or complexity {MAX_COMPLEXITY}; split them into "
                       "named steps:\n" + "\n".join(found))


def test_a_function_left_as_it_is_is_still_over_a_limit():
    """An entry of LEFT_AS_THEY_ARE for a function now within both limits, or gone, is removed."""
    sizes = {f"{where}:{name}": (line_count(f), complexity(f))
             for where, source in sources().items() for name, f in functions_in(ast.parse(source))}
    for key in LEFT_AS_THEY_ARE:
        assert key in sizes, f"{key} is gone: remove it from LEFT_AS_THEY_ARE"
        lines, cc = sizes[key]
        assert lines > MAX_LINES or cc > MAX_COMPLEXITY, f"{key} is within the limits now: remove it from the list"


# ----------------------------------------------------------------------------- the counter itself

EXAMPLE = '''
def f(xs, flag):
    """Decisions: if, elif, and (one extra operand), for, comprehension with one if, while,
    two excepts, with, assert, a conditional expression: 12, so complexity 13."""
    if flag and xs:
        pass
    elif not xs:
        pass
    for x in xs:
        pass
    ys = [x for x in xs if x]
    while False:
        pass
    try:
        pass
    except ValueError:
        pass
    except KeyError:
        pass
    with open("f") as fh:
        pass
    assert ys
    z = 1 if flag else 2

    def inner():
        if flag:
            return 1
        return 2

    return lambda: 3 if z else 4  # a lambda's decision is its parent's: 14 in all
'''


def test_the_counter_counts_each_kind_of_decision_once():
    tree = ast.parse(EXAMPLE)
    found = dict(functions_in(tree))
    assert set(found) == {"f", "f.inner"}
    assert complexity(found["f"]) == 14
    assert complexity(found["f.inner"]) == 2
    assert line_count(found["f"]) == len(EXAMPLE.strip().splitlines())


@pytest.mark.parametrize("lines, branches, reported", [(60, 19, False), (61, 0, True), (41, 20, True)])
def test_a_function_over_either_limit_is_reported(lines, branches, reported):
    body = [f"    if x == {i}:\n        return {i}" for i in range(branches)]
    body += ["    pass"] * (lines - 1 - 2 * branches)
    source = "def f(x):\n" + "\n".join(body) + "\n"
    assert line_count(next(iter(dict(functions_in(ast.parse(source))).values()))) == lines
    assert bool(too_big(source, "x.py")) == reported


def test_a_function_left_as_it_is_may_not_grow():
    source = "def f(x):\n" + "    pass\n" * 70
    assert not too_big(source, "x.py", left={"x.py:f": (71, 1)})
    assert too_big(source, "x.py", left={"x.py:f": (70, 1)}) == ["x.py:1 f: 71 lines, complexity 1"]


# A module is short enough to find one's way in: at most MAX_MODULE_LINES lines, unless it holds one
# concern that splitting would scatter (issue 27: "no andrea/ or minitensor/ module over ~400 lines
# unless it is one concern"). Each one left longer, with its size when it was left, may not grow.
MAX_MODULE_LINES = 400
ONE_CONCERN = {
    "minitensor/backends/numpy_ops.py": (506, "the NumPy backend: each Ops override beside its numba call"),
    "andrea/data/tokenizer.py": (447, "the byte-level BPE tokenizer: its id layout, encode and decode"),
    "minitensor/backends/cuda.py": (486, "the kernel registry: specs, records, the sizes they run at, the .cu files"),
    "minitensor/backends/cupy_ops.py": (412, "the CuPy backend: each Ops override beside its kernel call"),
    "andrea/interop/hf.py": (411, "the Hugging Face GPT-2 format, both directions"),
    "andrea/bench.py": (403, "the benchmark command"),
}


def module_sizes():
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
            for p in sorted((ROOT / "andrea").rglob("*.py")) + sorted((ROOT / "minitensor").rglob("*.py"))}


def test_every_module_is_short_or_one_concern_that_does_not_grow():
    sizes = module_sizes()
    over = [f"{path}: {n} lines" for path, n in sizes.items()
            if n > ONE_CONCERN.get(path, (MAX_MODULE_LINES, ""))[0]]
    assert not over, (f"modules over {MAX_MODULE_LINES} lines (or over the size they were left at); split them "
                      f"by concern: {over}")
    stale = [path for path, (most, _) in ONE_CONCERN.items() if sizes.get(path, 0) <= MAX_MODULE_LINES]
    assert not stale, f"{stale} are within {MAX_MODULE_LINES} lines now (or gone): remove them from ONE_CONCERN"
