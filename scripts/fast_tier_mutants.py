"""Mutation test of the fast tier on andrea's own logic: how many one-change mutants it kills.

    python scripts/fast_tier_mutants.py                        # 40 mutants, seed 0, the fast tier
    python scripts/fast_tier_mutants.py --count 60 --seed 1 --json mutants.json
    python scripts/fast_tier_mutants.py --list                 # the mutants only, nothing run
    python scripts/fast_tier_mutants.py --only 3,17            # rerun mutants 3 and 17 of the same list

The mutants come from TARGETS (outside minitensor/: the LR schedules, the data sources, the
experiments' paired statistics, sampling, the server's engine). Each is one change to one node of a
module's executable code, of the usual kinds: a comparison swapped (< <=, > >=, == !=, is / is not,
in / not in), arithmetic swapped (+ -, * /, // /, augmented assignments too), a constant moved
(0 -> 1, 1 -> 0, n -> n + 1, True <-> False), and / or swapped, a `not` removed, a term of a sum or
difference dropped, a returned value replaced by None. Docstrings, f-strings, annotations, what a
`raise` or an `assert` says, and printing and logging calls are not mutated. A seed picks `count`
of them, spread evenly over TARGETS, so that the list is the same for the same seed and count.

Each mutant is written into one copy of the repository (its tree without .git, virtual
environments, runs/ and caches), the test command runs there (the fast tier: `python -m pytest -q
--fast -x -p no:cacheprovider`, PYTHONPATH the copy) and the mutant counts as killed when the
command fails or outlives its timeout (3x the unmutated run's time, at least 10 s), survived when it passes. The
unmutated run comes first, and a failure there stops everything. Equivalent mutants (a change no
test could tell apart) are counted as survivors like any other: the ratio is a lower bound.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (module, the top-level names mutated in it, None for all): andrea's own logic that the fast tier should cover
TARGETS = (
    ("andrea/run/schedule.py", None),                 # the LR schedules
    ("andrea/data/sources/__init__.py", None),        # the sources: blocks, parts, plans
    ("andrea/data/sources/records.py", None),         # records: the split by document, the blocks
    ("andrea/data/sources/jsonl.py", None),           # JSON Lines
    ("andrea/data/sources/parquet.py", None),         # Parquet
    ("andrea/experiments/paired.py", None),           # the experiments' paired statistics
    ("andrea/sample.py", ("sample_next", "nucleus", "Decoder", "generate")),  # sampling (not its command)
    ("andrea/serve/engine.py", None),                 # the server's engine: jobs, stops, logprobs
)
FAST_TIER = ("{python} -m pytest -q --fast -x -p no:cacheprovider")
LEFT_OUT_OF_COPY = (".git", ".venv*", "runs", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache",
                    "*.egg-info", "build", "dist")
TIMEOUT_FACTOR = 3   # a mutant's run may take this times the unmutated run's seconds, and at least MIN_TIMEOUT
MIN_TIMEOUT = 10.0
EQUIVALENT_NOTE = ("equivalent mutants (no test could tell them from the original) are counted as survivors: "
                   "none was removed by hand")

COMPARE_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                 ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
ARITHMETIC_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div}
LOGGERS = ("log", "logger", "logging", "warnings")
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass
class Mutant:
    """One change: the source from (line, col) to (end_line, end_col) of `path` (columns in UTF-8
    bytes, as ast counts them) replaced by `after`."""

    path: str
    line: int
    col: int
    end_line: int
    end_col: int
    kind: str
    before: str
    after: str
    id: int = 0
    outcome: str = ""    # killed, killed (timeout) or survived, after a run
    seconds: float = 0.0

    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def change(self, width: int = 60) -> str:
        def cut(text):
            text = " ".join(text.split())
            return text if len(text) <= width else text[:width - 3] + "..."
        return f"{self.kind}: `{cut(self.before)}` -> `{cut(self.after)}`"


def _offsets(source: bytes) -> list[int]:
    """The byte offset of each line's start (line 1 at index 0)."""
    starts = [0]
    for i, b in enumerate(source):
        if b == 0x0A:
            starts.append(i + 1)
    return starts


def apply(mutant: Mutant, source: str) -> str:
    """`source` with the mutant's change; a ValueError if the result does not parse."""
    raw = source.encode("utf-8")
    starts = _offsets(raw)
    a, b = starts[mutant.line - 1] + mutant.col, starts[mutant.end_line - 1] + mutant.end_col
    out = (raw[:a] + mutant.after.encode("utf-8") + raw[b:]).decode("utf-8")
    try:
        ast.parse(out)
    except SyntaxError as e:
        raise ValueError(f"mutant {mutant.id} ({mutant.where()}) does not parse: {e}") from e
    return out


def _is_text_or_chatter(node: ast.AST) -> bool:
    """Nodes whose insides are messages, not logic: f-strings, raise and assert statements (the
    conditions around them are mutated, not what they say), print and logging calls."""
    if isinstance(node, (ast.JoinedStr, ast.Raise)):
        return True
    if isinstance(node, ast.Call):
        f = node.func
        return (isinstance(f, ast.Name) and f.id == "print") or (
            isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in LOGGERS)
    return False


def _left_alone(tree: ast.Module) -> set[int]:
    """ids of the nodes never mutated: docstrings, annotations, messages and chatter, `if __name__`."""
    roots = []
    for node in ast.walk(tree):
        if _is_text_or_chatter(node):
            roots.append(node)
        elif isinstance(node, ast.Assert) and node.msg is not None:
            roots.append(node.msg)
        elif isinstance(node, DEFINITIONS) and node.returns is not None:
            roots.append(node.returns)
        elif isinstance(node, (ast.arg, ast.AnnAssign)) and node.annotation is not None:
            roots.append(node.annotation)
        elif isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
            roots.append(node)
        if isinstance(node, (ast.Module, ast.ClassDef, *DEFINITIONS)) and ast.get_docstring(node):
            roots.append(node.body[0])
    return {id(n) for root in roots for n in ast.walk(root)}


def _in_scope(tree: ast.Module, scope) -> set[int] | None:
    """ids of the nodes under the top-level definitions named in `scope` (None: every node)."""
    if scope is None:
        return None
    chosen = [node for node in tree.body if getattr(node, "name", None) in scope]
    missing = set(scope) - {node.name for node in chosen}
    if missing:
        raise SystemExit(f"TARGETS names {sorted(missing)}, which the module does not define: fix TARGETS")
    return {id(n) for node in chosen for n in ast.walk(node)}


def _compare(node: ast.Compare):
    for i, op in enumerate(node.ops):
        if type(op) in COMPARE_SWAPS:
            ops = [*node.ops[:i], COMPARE_SWAPS[type(op)](), *node.ops[i + 1:]]
            yield "compare", ast.Compare(node.left, ops, node.comparators)


def _arithmetic(node: ast.BinOp):
    if type(node.op) in ARITHMETIC_SWAPS and not _text_operand(node):
        yield "arithmetic", ast.BinOp(node.left, ARITHMETIC_SWAPS[type(node.op)](), node.right)
        if isinstance(node.op, (ast.Add, ast.Sub)):
            yield "drop a term", node.left


def _augmented(node: ast.AugAssign):
    if type(node.op) in ARITHMETIC_SWAPS:
        yield "arithmetic", ast.AugAssign(node.target, ARITHMETIC_SWAPS[type(node.op)](), node.value)


def _boolean(node: ast.BoolOp):
    yield "boolean", ast.BoolOp(ast.Or() if isinstance(node.op, ast.And) else ast.And(), node.values)


def _not(node: ast.UnaryOp):
    if isinstance(node.op, ast.Not):
        yield "not removed", node.operand


def _constant(node: ast.Constant):
    v = node.value
    if type(v) in (bool, int, float):
        yield "constant", ast.Constant((not v) if isinstance(v, bool) else (1 - v) if v in (0, 1) else v + 1)


def _return(node: ast.Return):
    if node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None):
        yield "return None", ast.Return(ast.Constant(None))


# the node type -> its mutations: (kind, replacement node) for each
OPERATORS = {ast.Compare: _compare, ast.BinOp: _arithmetic, ast.AugAssign: _augmented, ast.BoolOp: _boolean,
             ast.UnaryOp: _not, ast.Constant: _constant, ast.Return: _return}


def _replacements(node: ast.AST):
    """(kind, replacement node) for each mutation of `node` itself."""
    operator = OPERATORS.get(type(node))
    return operator(node) if operator else ()


def _text_operand(node: ast.BinOp) -> bool:
    return any(isinstance(side, ast.JoinedStr) or (isinstance(side, ast.Constant) and isinstance(side.value, str))
               for side in (node.left, node.right))


def _text(replacement: ast.AST) -> str:
    """The source of a replacement, parenthesised when it is an expression that could bind otherwise."""
    text = ast.unparse(replacement)
    if isinstance(replacement, ast.expr) and not isinstance(replacement, (ast.Constant, ast.Name)):
        return f"({text})"
    return text


def mutants_of(path: str, source: str, scope=None) -> list[Mutant]:
    """Every mutant of the module `path` (its text `source`), in the order of the source."""
    tree = ast.parse(source)
    skipped, allowed = _left_alone(tree), _in_scope(tree, scope)
    raw = source.encode("utf-8")
    starts = _offsets(raw)
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped or (allowed is not None and id(node) not in allowed) or not hasattr(node, "lineno"):
            continue
        before = raw[starts[node.lineno - 1] + node.col_offset:starts[node.end_lineno - 1] + node.end_col_offset]
        for kind, replacement in _replacements(node):
            found.append(Mutant(path, node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, kind,
                                before.decode("utf-8"), _text(replacement)))
    return sorted(found, key=lambda m: (m.line, m.col, m.end_line, m.end_col, m.kind, m.after))


def choose(root: Path, targets, count: int, seed: int) -> list[Mutant]:
    """`count` mutants, spread evenly over `targets` (the first modules one more when count does not
    divide), drawn by `seed`; numbered from 1 in the order of the targets."""
    rng = random.Random(seed)
    chosen = []
    for i, (path, scope) in enumerate(targets):
        every = mutants_of(path, (root / path).read_text(encoding="utf-8"), scope)
        share = count // len(targets) + (i < count % len(targets))
        picked = sorted(rng.sample(range(len(every)), min(share, len(every))))
        chosen += [every[j] for j in picked]
    for number, mutant in enumerate(chosen, 1):
        mutant.id = number
    return chosen


def copy_tree(root: Path, into: Path) -> Path:
    """The repository's tree at `root`, without LEFT_OUT_OF_COPY, under `into`."""
    copy = into / "repo"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns(*LEFT_OUT_OF_COPY), symlinks=True)
    return copy


def run_command(command: list[str], cwd: Path, timeout: float | None) -> tuple[str, float]:
    """("passed", "failed" or "timeout", its seconds) of `command` run in `cwd` with PYTHONPATH the
    copy; on a timeout its whole process group is killed."""
    env = dict(os.environ, PYTHONPATH=str(cwd))
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        verdict = "passed" if proc.wait(timeout=timeout) == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        verdict = "timeout"
    return verdict, time.monotonic() - start


def _forget_bytecode(module: Path) -> None:
    """Remove the module's cached bytecode, so that the next run compiles the text now there (a
    mutant of the same size written within the second of the cache would otherwise be missed)."""
    for cached in (module.parent / "__pycache__").glob(f"{module.stem}.*.pyc"):
        cached.unlink()


def run_mutants(mutants: list[Mutant], copy: Path, command: list[str], timeout: float | None, out=None):
    """Runs `command` in `copy` once per mutant, with the mutant written in; sets each one's outcome
    and seconds and prints a line for it (to `out`, default stdout). The copy's files are restored after each."""
    out = out or sys.stdout
    for done, m in enumerate(mutants, 1):
        module = copy / m.path
        original = module.read_text(encoding="utf-8")
        try:
            module.write_text(apply(m, original), encoding="utf-8")
            _forget_bytecode(module)
            verdict, m.seconds = run_command(command, copy, timeout)
        finally:
            module.write_text(original, encoding="utf-8")
            _forget_bytecode(module)
        m.outcome = {"passed": "survived", "failed": "killed", "timeout": "killed (timeout)"}[verdict]
        print(f"#{m.id:<3d} ({done}/{len(mutants)}) {m.where():40s} {m.change():80s} {m.outcome:16s} "
              f"{m.seconds:6.1f} s", file=out, flush=True)
    return mutants


def summary(mutants: list[Mutant]) -> dict:
    """The kill ratio overall and per module."""
    def ratio(group):
        killed = sum(m.outcome.startswith("killed") for m in group)
        return {"killed": killed, "total": len(group), "ratio": killed / len(group) if group else None}
    modules = dict.fromkeys(m.path for m in mutants)
    return {"overall": ratio(mutants), "per_module": {p: ratio([m for m in mutants if m.path == p]) for p in modules},
            "survivors": [f"#{m.id} {m.where()} {m.change()}" for m in mutants if m.outcome == "survived"],
            "note": EQUIVALENT_NOTE}


def report(result: dict, out) -> None:
    o = result["overall"]
    print(f"\nkilled {o['killed']} of {o['total']} mutants ({o['ratio']:.0%}); {EQUIVALENT_NOTE}", file=out)
    for path, r in result["per_module"].items():
        print(f"  {path:40s} {r['killed']:3d} / {r['total']:<3d} ({r['ratio']:.0%})", file=out)
    for line in result["survivors"]:
        print(f"  survived: {line}", file=out)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=40, help="how many mutants (default 40)")
    ap.add_argument("--seed", type=int, default=0, help="the seed that picks them (default 0)")
    ap.add_argument("--only", help="comma-separated mutant ids of the list the seed and count give: run just those")
    ap.add_argument("--list", action="store_true", help="print the mutants and stop")
    ap.add_argument("--json", help="write the mutants, their outcomes and the ratios to this file")
    ap.add_argument("--command", help="the test command (default: the fast tier, with this Python)")
    ap.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)  # tests: a planted repository
    args = ap.parse_args(argv)
    if args.count < 1:
        ap.error(f"--count must be at least 1, got {args.count}")
    return args


def _selected(mutants: list[Mutant], only: str | None) -> list[Mutant]:
    if not only:
        return mutants
    try:
        wanted = {int(part) for part in only.split(",")}
    except ValueError:
        raise SystemExit(f"--only takes ids separated by commas (e.g. 3,17), got {only!r}") from None
    unknown = wanted - {m.id for m in mutants}
    if unknown:
        raise SystemExit(f"--only: no mutant {sorted(unknown)} in this list of {len(mutants)} "
                         "(give the same --seed and --count as the run that numbered them)")
    return [m for m in mutants if m.id in wanted]


def main(argv=None, targets=TARGETS, out=None) -> dict | None:
    args, out = parse_args(argv), out or sys.stdout
    root = Path(args.root)
    command = shlex.split(args.command or FAST_TIER.format(python=shlex.quote(sys.executable)))
    mutants = _selected(choose(root, targets, args.count, args.seed), args.only)
    if args.list:
        for m in mutants:
            print(f"{m.id:3d} {m.where():40s} {m.change(100)}", file=out)
        return None
    with tempfile.TemporaryDirectory(prefix="andrea-mutants-") as tmp:
        copy = copy_tree(root, Path(tmp))
        verdict, baseline = run_command(command, copy, None)
        if verdict != "passed":
            raise SystemExit(f"the unmutated tree fails the test command ({shlex.join(command)}) in {baseline:.0f} s: "
                             "fix that first, a mutant's failure would mean nothing")
        timeout = max(TIMEOUT_FACTOR * baseline, MIN_TIMEOUT)
        print(f"unmutated: passed in {baseline:.1f} s; each mutant's timeout {timeout:.0f} s", file=out, flush=True)
        run_mutants(mutants, copy, command, timeout, out)
    result = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "seed": args.seed, "count": args.count,
              "command": shlex.join(command), "baseline_seconds": round(baseline, 1), "timeout_seconds": round(timeout),
              **summary(mutants), "mutants": [asdict(m) for m in mutants]}
    report(result, out)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
