"""The optimizer owns its state: no module outside minitensor/optim.py reads a state tensor of AdamW by
attribute (`opt.m`, `trainer.opt.v`, `opt._state`), so checkpoints, the start-up broadcast, the kernels'
checks and the scripts all go through `named_state()` / `state_dict()`, and a tensor added to
`AdamW.STATE` reaches each of them without an edit (issue 46: the state was once listed by hand in
three places, and a tensor left out of one would leave ranks diverged after a resume).

The names checked are AdamW.STATE itself and the private dict that holds them, read from the
optimizer, so a new state tensor is checked too. An attribute of that name on anything else (a `.m`
that is not the optimizer's) would be flagged as well: none exists, and a short name for something
else reads ambiguously beside the optimizer's anyway.
"""

import ast
from pathlib import Path

from minitensor.optim import AdamW

ROOT = Path(__file__).resolve().parents[2]
OWNER = ROOT / "minitensor" / "optim.py"
STANDIN = ROOT / "minitensor" / "checks" / "cupy_standin"
FOLDERS = ("andrea", "minitensor", "scripts", "tests")
PRIVATE = "_state"  # the dict AdamW keeps STATE's tensors in


def state_reads(source, names):
    """(line, attribute) of each attribute read `<anything>.<name>` for name in names."""
    return [(node.lineno, node.attr) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in names]


def modules():
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != OWNER and STANDIN not in path.parents:
                yield path


def test_the_optimizer_keeps_its_state_where_the_rule_looks():
    import numpy as np

    from minitensor.flat import Params

    opt = AdamW(Params({"w": (3, 4)}, xp=np))
    assert set(vars(opt)[PRIVATE]) == set(AdamW.STATE) == set(opt.named_state())
    assert not any(hasattr(opt, name) for name in AdamW.STATE)  # no second way in


def test_the_rule_flags_a_read_by_attribute():
    names = (*AdamW.STATE, PRIVATE)
    assert state_reads("x = trainer.opt.m + opt.v\nopt._state['m']\n", names) == [(1, "m"), (1, "v"), (2, "_state")]
    assert state_reads("x = opt.named_state()['m']\n", names) == []


def test_no_module_reads_the_optimizers_state_by_attribute():
    names = (*AdamW.STATE, PRIVATE)
    found = [f"{path.relative_to(ROOT)}:{line}: .{attr}" for path in modules()
             for line, attr in state_reads(path.read_text(), names)]
    assert len(list(modules())) > 100
    assert found == [], ("read the optimizer's state through opt.named_state() or opt.state_dict(), "
                         f"not by attribute: {found}")
