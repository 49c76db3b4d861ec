"""scripts/gpu_coverage.py: every rule of its GPU-only list still names code (a renamed function or
a rewritten branch fails here, so the list is edited with the engine), and the rules select what
they say."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_coverage", ROOT / "scripts" / "gpu_coverage.py")
gpu_coverage = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_coverage)


def test_every_rule_names_code_and_every_file_has_gpu_only_statements():
    for path, rules in gpu_coverage.GPU_ONLY.items():
        lines = gpu_coverage.gpu_lines(path, rules)  # exits with an error naming a rule that matches nothing
        assert not rules or lines & gpu_coverage.statements(path), path


def test_the_rules_select_the_cupy_side_of_a_branch(tmp_path, monkeypatch):
    source = ("def f(xp, x):\n"                   # 1
              "    if xp is np:\n"                 # 2
              "        return x\n"                 # 3
              "    y = x + 1\n"                    # 4  after a CPU branch that returns: GPU-only
              "    if xp is not np:\n"             # 5
              "        y = y * 2\n"                # 6  GPU-only
              "    return y\n"                     # 7
              "\n"
              "def g():\n"                         # 9
              "    return 1\n")                    # 10
    (tmp_path / "m.py").write_text(source)
    monkeypatch.setattr(gpu_coverage, "ROOT", tmp_path)
    assert gpu_coverage.gpu_lines("m.py", [("unless", r"^xp is np$")]) == {4, 5, 6, 7}
    assert gpu_coverage.gpu_lines("m.py", [("if", r"^xp is not np$")]) == {6}
    assert gpu_coverage.gpu_lines("m.py", [("def", "g")]) == {9, 10}
