"""The modules of andrea and minitensor import one another without a circle.

Every import counts, at the top of a module or inside a function: an import deferred into a
function hides a circle from Python but not from a reader, who must then know both modules to
understand either. The graph is read from the source (ast), so nothing is imported to check it.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("andrea", "minitensor")


def module_name(path: Path) -> str:
    return module_name_under(ROOT, path)


def module_name_under(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in its body. `from P import name` reaches P.name
    where that is a module (`from andrea.interop import hf`) and P itself where it is not: a name
    defined in P's module, its `__init__` for a package (`from minitensor.backends import get_ops`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                     for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports. A package is the module of its `__init__`, reached
    where a name defined there is imported: the code in an `__init__` counts as any module's. That
    importing andrea.run.x runs andrea/__init__.py first is no edge: a package's `__init__` may
    gather its members (andrea.experiments' EXPERIMENTS), and a member that takes nothing from it
    makes no circle with it."""
    paths = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) - {module_name(p)} for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "grey"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "grey":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "black"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_finder_finds_a_circle_and_reads_deferred_imports(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    source = tmp_path / "m.py"
    source.write_text("import andrea.x\ndef f():\n    from andrea.interop import hf\n"
                      "    from andrea.model.transformer import ANDREA\n")
    found = {"andrea.x", "andrea.interop.hf", "andrea.model.transformer"}
    assert imports_of(source, found) == found


def test_a_name_taken_from_a_package_is_an_edge_to_its_init(tmp_path):
    """`from P import name` reaches P's `__init__` where name is defined there, and only P.name where
    that is a module: the circle backends <-> checks.selfcheck went through get_ops, in an `__init__`."""
    source = tmp_path / "m.py"
    source.write_text("from minitensor.backends import fused_pieces, ops\nfrom andrea.experiments import paired\n")
    modules = {"minitensor.backends", "minitensor.backends.ops", "andrea.experiments", "andrea.experiments.paired"}
    assert imports_of(source, modules) == {"minitensor.backends", "minitensor.backends.ops",
                                           "andrea.experiments.paired"}
    init = tmp_path / "pkg" / "__init__.py"
    init.parent.mkdir()
    init.write_text('"""A package."""\n\ndef get():\n    from pkg import member\n    return member.f()\n')
    (tmp_path / "pkg" / "member.py").write_text("from pkg import get\n")
    assert module_name_under(tmp_path, init) == "pkg"
    graph = {module_name_under(tmp_path, p): imports_of(p, {"pkg", "pkg.member"}) - {module_name_under(tmp_path, p)}
             for p in (init, tmp_path / "pkg" / "member.py")}
    assert find_cycle(graph) == ["pkg", "pkg.member", "pkg"]


def test_no_module_imports_itself_back():
    graph = import_graph()
    # ANDREA.from_pretrained reads the Hugging Face format
    assert "andrea.interop.hf" in graph["andrea.model.transformer"]
    assert "andrea.model.transformer" not in graph["andrea.interop.hf"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


LAYERS = sorted(p.stem for p in (ROOT / "minitensor" / "layers").glob("*.py") if p.stem != "__init__")
NOT_FOR_A_LAYER = ("minitensor.backends.numpy_ops", "minitensor.backends.cpu",
                   "minitensor.backends.numba_jit", "minitensor.backends.cupy_ops", "minitensor.backends.cuda",
                   "minitensor.backends.kernels", "minitensor.backends.selection",
                   "minitensor.checks", "numba", "cupy")


def test_importing_a_layer_loads_no_backend_kernels_or_checks():
    """The layering of minitensor's tree: layers/ -> backends/ -> checks/. A layer is read (and
    imported) without the CPU's numba kernels, the GPU's kernel registry and selection or any check; the backend
    that computes it is built when a model is, or at a layer's first forward."""
    import subprocess
    import sys

    probe = ("import importlib, sys\n"
             f"for name in {LAYERS!r}:\n"
             "    importlib.import_module('minitensor.layers.' + name)\n"
             f"print(sorted(m for m in sys.modules if m.startswith({NOT_FOR_A_LAYER!r})))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert len(LAYERS) >= 8 and out.strip() == "[]", f"importing the layers loaded {out.strip()}"


def test_the_commands_train_and_prepare_do_not_import_the_hugging_face_module():
    """andrea's own tokenizer loads from andrea.data.tokenizer: the commands that train and prepare
    reach the Hugging Face format (andrea.interop.hf) only through the run's modules that need it
    (--init-from's weights and config), never directly."""
    graph = import_graph()
    for command in ("andrea.train", "andrea.prepare"):
        assert "andrea.interop.hf" not in graph[command], command
    # the data side never reaches into interop at all
    for module, imports in graph.items():
        if module.startswith("andrea.data."):
            assert not {m for m in imports if m.startswith("andrea.interop")}, module


def registries() -> dict[str, str]:
    """name -> module of every registry in andrea/: a module-level dict whose name is in capitals
    (NORMS, SCHEDULES, SINKS, FORMATS, ...)."""
    found = {}
    for path in sorted((ROOT / "andrea").rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Dict, ast.DictComp)):
                found |= {t.id: module_name(path) for t in node.targets if isinstance(t, ast.Name) and t.id.isupper()}
    return found


def test_the_config_takes_no_registry():
    """andrea/config.py checks model.norm, train.schedule and train.log_to through each registry's own
    check (andrea.model.block.check_norm, andrea.run.schedule.check_schedule,
    andrea.run.sinks.check_sink_names) and lists no member: it imports no registry, so a new member is
    its registry's entry alone."""
    known = registries()
    assert {"NORMS": "andrea.model.block", "SCHEDULES": "andrea.run.schedule", "SINKS": "andrea.run.sinks"}.items() \
        <= known.items()
    tree = ast.parse((ROOT / "andrea" / "config.py").read_text(encoding="utf-8"))
    taken = {(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             for alias in node.names}
    assert not {(module, name) for name, module in known.items()} & taken
