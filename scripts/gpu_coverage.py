"""The share of GPU-only statements that the test suite executes (coverage.py, statements).

    python scripts/gpu_coverage.py run --data DIR [-- PYTEST ARGS]   # the tests under coverage
    python scripts/gpu_coverage.py report --data DIR [--data DIR ...] [--missing]

`run` runs pytest (the whole suite unless told otherwise) under coverage with every Python
subprocess measured too (the CLI runs, gpu_check.sh's phases), and combines the data in DIR.
`report` reads one or more such folders (their union: several runs of parts of the suite) and
prints, per file, how many of its GPU-only statements ran, then the total; --missing lists the
lines that did not.

GPU-only statements are those that run in production only when the model is on CuPy. They are
named below, per file, by rules that survive edits better than line numbers:

    ("def", "Name")          a whole function or class (a method: "Class.method")
    ("if", regex)            the body of every `if`/`elif` whose condition matches regex
                             (e.g. `xp is not np`)
    ("unless", regex)        the `else` of every `if` whose condition matches regex (e.g. `xp is
                             np`, `isinstance(x, np.ndarray)`) and, when its body ends in return
                             or raise, the statements after it in the same block

Not counted, though GPU-only: the CuPy half of a conditional expression on one line (`a if xp is
np else b`: coverage.py counts lines, and the line runs on the CPU too). Edit GPU_ONLY as the
engine changes: tests/gpu/test_gpu_coverage.py fails when a rule names code that no longer exists.
"""

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

KERNEL_DIR = ROOT / "minitensor" / "backends" / "kernels"


def kernel_rules():
    """{path: rules} for the GPU kernels' modules (minitensor/backends/kernels/NAME.py), derived, not
    listed: in each, its launch wrappers and argument checks (named `*_gpu`, the convention) and the
    functions its fused piece's record names (the self-check's sample and the functions that run the
    methods it replaces), which run only to build or in a CupyOps. Their module-level kernel specs and
    host references (`reference`s, `model`s, `traffic`, `column`, ...) run without a GPU too (`python -m
    minitensor.checks --check | --host-check | --counts`) and are not counted."""
    from minitensor.backends import fused_pieces

    named = {}
    for piece in fused_pieces().values():
        for fn in (piece.sample, *piece.replaces.values()):
            named.setdefault(fn.__module__.rsplit(".", 1)[1], set()).add(fn.__qualname__)
    rules = {}
    for path in sorted(KERNEL_DIR.glob("*.py")):
        if path.stem == "__init__":
            continue
        defined = [node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)]
        gpu = sorted({name for name in defined if name.endswith("_gpu")} | named.get(path.stem, set()))
        rules[path.relative_to(ROOT).as_posix()] = [("def", name) for name in gpu]
    return rules


# The GPU backend (minitensor/backends/cupy_ops.py: CupyOps), its kernels' modules (kernel_rules above) and
# the GPU-only parts of the modules that serve both devices.
GPU_ONLY = {
    "minitensor/backends/cupy_ops.py": [("def", name) for name in ("CupyOps", "_with_piece", "_gpu_memory", "_ones")],
    **kernel_rules(),
    "minitensor/backends/cublas.py": [("def", name) for name in ("layout", "_layout", "_scalar", "gemm", "colsum",
                                                                  "_bf16", "_cuda_type", "_gemm_bf16", "matmul")],
    "minitensor/backends/cuda.py": [("def", "_elementwise_kernel"), ("def", "_raw_kernel"), ("def", "launch"),
                                    ("def", "draw")],
    "minitensor/device.py": [("unless", r"^n == 0$"), ("if", r"^ok$"), ("if", r"__module__\.startswith\(\"cupy\"\)"),
                              ("unless", r"^xp is np$")],
    "minitensor/backends/__init__.py": [("unless", r"^xp is np$")],                   # get_ops: building CupyOps
    "minitensor/backends/selection.py": [("def", "compare"), ("def", "choose"), ("unless", r"^xp is np$")],
    "andrea/run/perf.py": [("if", r"^xp is not np$"), ("if", r"^gpu$"), ("unless", r"^xp is np$")],
    "andrea/run/preflight.py": [("if", r'^device == "gpu"$')],
    "andrea/run/distributed.py": [("def", "use_local_gpu"), ("unless", r"^xp is np$")],
    "andrea/run/nccl.py": [("def", "NcclReducer"), ("def", "load_nccl")],
    "andrea/run/allreduce.py": [("def", "nccl_self_test"), ("if", r"^gpu$")],
    "andrea/bench.py": [("if", r'^device == "gpu"$')],
}


# --- which lines the rules name --------------------------------------------------------------------


def _lines(nodes):
    lines = set()
    for node in nodes:
        lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def _definitions(tree):
    """{qualified name: node} of every function and class."""
    found = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = prefix + child.name
                found[name] = child
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def _blocks(tree):
    """Every statement list (a body, an orelse, ...) in the tree."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block
        for handler in getattr(node, "handlers", []):
            yield handler.body


def gpu_lines(path, rules):
    """The source lines of `path` (relative to the repository) that the rules name."""
    source = (ROOT / path).read_text()
    tree = ast.parse(source)
    lines = set()
    definitions = _definitions(tree)
    for kind, pattern in rules:
        if kind == "def":
            if pattern not in definitions:
                raise SystemExit(f"error: {path} has no function or class {pattern}: edit GPU_ONLY in {__file__}")
            lines |= _lines([definitions[pattern]])
            continue
        matched = False
        for block in _blocks(tree):
            for k, stmt in enumerate(block):
                if not isinstance(stmt, ast.If) or not re.search(pattern, ast.get_source_segment(source, stmt.test)):
                    continue
                matched = True
                if kind == "if":
                    lines |= _lines(stmt.body)
                else:
                    lines |= _lines(stmt.orelse)
                    if isinstance(stmt.body[-1], ast.Return | ast.Raise):
                        lines |= _lines(block[k + 1:])
        if not matched:
            raise SystemExit(f"error: no `if` in {path} matches {pattern!r}: edit GPU_ONLY in {__file__}")
    return lines


# --- run and report -------------------------------------------------------------------------------


def run(data, pytest_args):
    data = Path(data).resolve()
    data.mkdir(parents=True, exist_ok=True)
    rc = data / "coveragerc"
    rc.write_text(f"[run]\nsource = minitensor, andrea\nparallel = true\npatch = subprocess\n"
                  f"data_file = {data / '.coverage'}\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    status = subprocess.run([sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest",
                             "-p", "no:cacheprovider", *pytest_args], cwd=ROOT, env=env).returncode
    subprocess.run([sys.executable, "-m", "coverage", "combine", f"--rcfile={rc}", "--keep"], cwd=ROOT, env=env,
                   check=True, capture_output=True)
    return status


def executed_lines(folders):
    """{repository path: executed line numbers}, the union over the folders' combined data."""
    import coverage

    executed = {}
    for folder in folders:
        data = coverage.CoverageData(str(Path(folder).resolve() / ".coverage"))
        data.read()
        for filename in data.measured_files():
            try:
                rel = Path(filename).resolve().relative_to(ROOT).as_posix()
            except ValueError:
                continue
            executed.setdefault(rel, set()).update(data.lines(filename) or ())
    return executed


def statements(path):
    """The executable statement lines coverage.py sees in a file."""
    import coverage

    cov = coverage.Coverage(data_file=None)
    _, stmts, _, _, _ = cov.analysis2(str(ROOT / path))
    return set(stmts)


def report(folders, missing):
    executed = executed_lines(folders)
    total = ran = 0
    for path, rules in GPU_ONLY.items():
        wanted = gpu_lines(path, rules) & statements(path)
        done = wanted & executed.get(path, set())
        total, ran = total + len(wanted), ran + len(done)
        if wanted:
            print(f"{path:<28} {len(done):>4} of {len(wanted):>4}")
            if missing and wanted - done:
                print(f"    not run: {_ranges(sorted(wanted - done))}")
    print(f"{'GPU-only statements run':<28} {ran:>4} of {total:>4} ({100 * ran / max(total, 1):.0f}%)")


def _ranges(lines):
    out, start = [], None
    for i, n in enumerate(lines):
        if start is None:
            start = n
        if i + 1 == len(lines) or lines[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="pytest under coverage (subprocesses included)")
    r.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "gpu-coverage"))
    r.add_argument("pytest_args", nargs="*")
    p = sub.add_parser("report", help="the share of GPU-only statements run")
    p.add_argument("--data", action="append", required=True, help="a folder `run` wrote (repeat for a union)")
    p.add_argument("--missing", action="store_true", help="list the GPU-only lines that did not run")
    args = ap.parse_args(argv)
    if args.command == "run":
        return run(args.data, args.pytest_args)
    report(args.data, args.missing)
    return 0


if __name__ == "__main__":
    sys.exit(main())
