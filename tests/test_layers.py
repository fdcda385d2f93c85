"""The import graph of ``multigpu/``: no circle, no arrow from a layer to one above it, frameworks in ``backend/``.

Every ``import`` counts, those inside functions too (they hide circles from
Python but not from a reader).  The layers, bottom to top, are listed in
:data:`LAYERS`; a module may import its own folder and any layer below.  Only
``backend/<name>/`` imports torch, JAX or TensorFlow (the readers of their
own input types and the benchmark harness excepted: :data:`FRAMEWORK_USERS`),
and each backend declares its facts there.
"""

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "multigpu"

# bottom to top; each entry is a top-level module or folder of multigpu/
LAYERS = [
    {"env", "_warn"},
    {"failure", "membership", "devices", "throttle", "planning"},
    {"balancing", "_keras"},
    {"data", "backend"},
    {"runtime", "keras"},
    {"api"},
    {"__init__", "bench", "cli", "__main__"},
]


FRAMEWORKS = {"torch", "jax", "jaxlib", "tensorflow"}
# Modules outside backend/ that may import a framework, and why.
FRAMEWORK_USERS = {
    "data/loader.py": "reads a torch DataLoader, torch's own input type",
    "data/tfdata.py": "reads a tf.data.Dataset, TensorFlow's own input type",
    "bench/worker.py": "the `multigpu bench` harness times each framework's own passes",
    "bench/breakdown.py": "the `multigpu bench` harness times torch's calls",
}


def _unit(module: str) -> str:
    """``multigpu.backend.torch.step`` -> ``backend``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = ["multigpu", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        modules[".".join(parts)] = path
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("multigpu"):
                for alias in node.names:  # `from multigpu import env` imports the module multigpu.env
                    full = f"{node.module}.{alias.name}"
                    targets.append(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("multigpu")]
            for target in targets:
                if _unit(target) != _unit(name):
                    edges[_unit(name)].add(_unit(target))
    return edges


def test_every_module_sits_in_a_layer():
    units = {p.stem if p.is_file() else p.name for p in ROOT.iterdir() if p.suffix == ".py" or
             (p.is_dir() and (p / "__init__.py").exists())}
    assert units == set().union(*LAYERS), sorted(units ^ set().union(*LAYERS))


def test_no_import_goes_up_or_sideways_except_among_the_entry_points():
    level = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    top = len(LAYERS) - 1  # the package's facade, the command line and the benchmarks use each other
    wrong = [f"{a} -> {b}" for a, targets in _graph().items() for b in targets
             if level[b] > level[a] or (level[b] == level[a] != top)]
    assert wrong == [], "imports that go up or sideways: " + ", ".join(sorted(wrong))


def test_no_circle_anywhere():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(unit: str, path: list[str]) -> list[str] | None:
        state[unit] = 1
        for nxt in sorted(graph.get(unit, ())):
            if state.get(nxt) == 1:
                return [*path, unit, nxt]
            if nxt not in state and (found := visit(nxt, [*path, unit])):
                return found
        state[unit] = 2
        return None

    for unit in sorted(graph):
        if unit not in state:
            circle = visit(unit, [])
            assert circle is None, " -> ".join(circle)


def _framework_imports(path: Path, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & FRAMEWORKS


def test_only_backends_import_a_framework():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("backend/") and relative.count("/") >= 2:
            continue  # backend/<name>/...
        if _framework_imports(path) and relative not in FRAMEWORK_USERS:
            wrong.append(f"{relative} imports {sorted(_framework_imports(path))}")
    assert wrong == [], "framework imports outside backend/<name>/: " + "; ".join(wrong)
    assert all((ROOT / p).exists() and _framework_imports(ROOT / p) for p in FRAMEWORK_USERS), \
        "an exception that no longer imports a framework: drop it"


def test_every_backend_declares_its_facts_in_its_own_folder():
    from multigpu.backend import SUPPORTED
    from multigpu.backend.facts import Facts

    folders = sorted(p.name for p in (ROOT / "backend").iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(SUPPORTED)
    for name in SUPPORTED:
        facts_file = ROOT / "backend" / name / "facts.py"
        assert not _framework_imports(facts_file, top_level_only=True), f"{name}'s facts import {name} eagerly"
        namespace: dict = {}  # run the file alone: importing it as a module would run its backend's __init__
        exec(compile(facts_file.read_text(), str(facts_file), "exec"), namespace)
        assert isinstance(namespace["FACTS"], Facts) and namespace["FACTS"].name == name
