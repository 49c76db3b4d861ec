"""scripts/fast_tier_mutants.py: its mutants are one change each, parse, are the same for a seed and
spread over its targets; what is never mutated is left alone; and its verdicts follow the test
command (planted commands here: no fast-tier run)."""

import ast
import copy
import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("fast_tier_mutants", ROOT / "scripts" / "fast_tier_mutants.py")
mutation = importlib.util.module_from_spec(spec)
sys.modules["fast_tier_mutants"] = mutation  # its dataclass looks its module up by name
spec.loader.exec_module(mutation)

SAMPLE = '''"""A sample module: 1 + 2 in its docstring is text."""
import logging

log = logging.getLogger("sample")


def f(a: int = 3, b=0) -> int:
    """Docstring 1 < 2."""
    if a < b and not a:
        return a + 1
    log.info("a is %d", a + 5)
    assert a, f"{a - 1} left"
    raise ValueError(f"bad {a * 2}" + str(a - 1))
'''
PYTHON = sys.executable
PASSES, FAILS = f"{PYTHON} -c pass", f"{PYTHON} -c 'raise SystemExit(1)'"


def replaced(tree, mutant):
    """`tree` with the node the mutant names replaced by its `after`, parsed on its own: the change the
    mutant claims, made on the tree rather than on the text."""
    new = ast.parse(mutant.after).body[0]
    new = new.value if isinstance(new, ast.Expr) else new
    span = (mutant.line, mutant.col, mutant.end_line, mutant.end_col)
    hits = []

    class Swap(ast.NodeTransformer):
        def generic_visit(self, node):
            if getattr(node, "end_lineno", None) and (node.lineno, node.col_offset, node.end_lineno,
                                                      node.end_col_offset) == span and not hits:
                hits.append(node)
                return new
            return super().generic_visit(node)

    out = Swap().visit(copy.deepcopy(tree))
    assert hits, f"no node at {span} for {mutant.change()}"
    return out


def test_every_default_mutant_parses_and_replaces_one_node():
    mutants = mutation.choose(ROOT, mutation.TARGETS, 40, 0)
    assert len(mutants) == 40
    for m in mutants:
        source = (ROOT / m.path).read_text(encoding="utf-8")
        tree = ast.parse(source)
        mutated = ast.parse(mutation.apply(m, source))
        assert ast.dump(mutated) == ast.dump(replaced(tree, m)), m.change()
        assert ast.dump(mutated) != ast.dump(tree), f"#{m.id} changes nothing: {m.change()}"


def test_the_list_is_the_same_for_a_seed_and_spread_over_the_targets():
    first = mutation.choose(ROOT, mutation.TARGETS, 40, 0)
    again = mutation.choose(ROOT, mutation.TARGETS, 40, 0)
    other = mutation.choose(ROOT, mutation.TARGETS, 40, 1)
    assert [m.change() + m.where() for m in first] == [m.change() + m.where() for m in again]
    assert [m.where() for m in first] != [m.where() for m in other]
    per_module = [sum(m.path == path for m in first) for path, _ in mutation.TARGETS]
    assert per_module == [40 // len(mutation.TARGETS)] * len(mutation.TARGETS)
    assert [m.id for m in first] == list(range(1, 41))
    assert sum(m.path == mutation.TARGETS[0][0] for m in mutation.choose(ROOT, mutation.TARGETS, 9, 0)) == 2


def test_a_sample_module_gets_exactly_its_mutants_and_no_text_is_mutated():
    found = [(m.line, m.kind, m.before, m.after) for m in mutation.mutants_of("sample.py", SAMPLE)]
    assert found == [
        (7, "constant", "3", "4"),             # a default; not the annotations
        (7, "constant", "0", "1"),
        (9, "compare", "a < b", "(a <= b)"),
        (9, "boolean", "a < b and not a", "(a < b or not a)"),
        (9, "not removed", "not a", "a"),
        (10, "return None", "return a + 1", "return None"),
        (10, "arithmetic", "a + 1", "(a - 1)"),
        (10, "drop a term", "a + 1", "a"),
        (10, "constant", "1", "0"),
    ]  # nothing from the docstrings, the logging call, the assert's message or the raise
    compare = next(m for m in mutation.mutants_of("sample.py", SAMPLE) if m.kind == "compare")
    assert mutation.apply(compare, SAMPLE).splitlines()[8] == "    if (a <= b) and not a:"


def test_a_scope_keeps_to_its_definitions_and_a_wrong_name_is_refused():
    two = SAMPLE + "\n\ndef g(x):\n    return x * 2\n"
    assert {m.line for m in mutation.mutants_of("s.py", two, scope=("g",))} == {17}
    with pytest.raises(SystemExit, match="does not define"):
        mutation.mutants_of("s.py", two, scope=("h",))


def test_columns_are_bytes_so_a_line_with_other_letters_is_cut_right():
    source = 'def f(x):\n    return "é" if x > 1 else "ü"\n'
    m = next(m for m in mutation.mutants_of("u.py", source) if m.kind == "compare")
    assert mutation.apply(m, source) == 'def f(x):\n    return "é" if (x >= 1) else "ü"\n'


def planted_repository(tmp_path):
    repo = tmp_path / "planted"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "sample.py").write_text(SAMPLE)
    (repo / ".git").mkdir()                     # left out of the copy, as runs/ and the caches are
    return repo, (("pkg/sample.py", None),)


def test_an_always_passing_command_lets_every_mutant_survive(tmp_path):
    repo, targets = planted_repository(tmp_path)
    out = tmp_path / "out.json"
    result = mutation.main(["--root", str(repo), "--count", "4", "--command", PASSES, "--json", str(out)],
                           targets=targets, out=io.StringIO())
    assert result["overall"] == {"killed": 0, "total": 4, "ratio": 0.0}
    assert len(result["survivors"]) == 4 and "survivors" in result["note"]
    assert json.loads(out.read_text())["per_module"]["pkg/sample.py"]["total"] == 4


def test_an_always_failing_command_kills_every_mutant_and_fails_the_unmutated_run(tmp_path):
    repo, targets = planted_repository(tmp_path)
    mutants = mutation.choose(repo, targets, 3, 0)
    copied = mutation.copy_tree(repo, tmp_path / "copy")
    assert not (copied / ".git").exists()
    mutation.run_mutants(mutants, copied, ["sh", "-c", "exit 1"], timeout=30, out=io.StringIO())
    assert [m.outcome for m in mutants] == ["killed"] * 3
    assert (copied / "pkg" / "sample.py").read_text() == SAMPLE          # restored after each
    with pytest.raises(SystemExit, match="unmutated tree fails"):
        mutation.main(["--root", str(repo), "--count", "2", "--command", FAILS], targets=targets)


def test_a_command_that_tells_a_mutant_apart_kills_it_and_only_it(tmp_path):
    """The mutant reaches the command through the copy on PYTHONPATH: a check of f(0, 1) == 1 kills
    the mutants that change its value, and not those that leave it alone (the defaults, < -> <=, or)."""
    repo, targets = planted_repository(tmp_path)
    check = f"{PYTHON} -c 'from pkg.sample import f; raise SystemExit(f(0, 1) != 1)'"
    result = mutation.main(["--root", str(repo), "--count", "9", "--command", check], targets=targets,
                           out=io.StringIO())
    outcome = {m["after"]: m["outcome"] for m in result["mutants"]}
    assert outcome == {"4": "survived", "1": "survived", "(a <= b)": "survived", "(a < b or not a)": "survived",
                       "a": "killed", "return None": "killed", "(a - 1)": "killed", "0": "killed"}


def test_a_run_past_its_timeout_is_killed(tmp_path):
    repo, targets = planted_repository(tmp_path)
    mutants = mutation.choose(repo, targets, 1, 0)
    slow = [PYTHON, "-c", "import time; time.sleep(30)"]
    mutation.run_mutants(mutants, mutation.copy_tree(repo, tmp_path), slow, 0.5, io.StringIO())
    assert mutants[0].outcome == "killed (timeout)" and mutants[0].seconds < 10


def test_only_picks_ids_of_the_same_list_and_refuses_others(tmp_path, capsys):
    repo, targets = planted_repository(tmp_path)
    mutation.main(["--root", str(repo), "--count", "5", "--only", "2,4", "--list"], targets=targets)
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["2", "4"]
    with pytest.raises(SystemExit, match="no mutant \\[6\\]"):
        mutation.main(["--root", str(repo), "--count", "5", "--only", "6", "--list"], targets=targets)
    with pytest.raises(SystemExit, match="ids separated by commas"):
        mutation.main(["--root", str(repo), "--only", "two", "--list"], targets=targets)
