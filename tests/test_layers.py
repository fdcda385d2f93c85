"""The import graph of ``multigpu/``: no circle, and no arrow from a layer to one above it.

Every ``import`` counts, those inside functions too (they hide circles from
Python but not from a reader).  The layers, bottom to top, are listed in
:data:`LAYERS`; a module may import its own folder and any layer below.
"""

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "multigpu"

# bottom to top; each entry is a top-level module or folder of multigpu/
LAYERS = [
    {"env", "_warn"},
    {"failure", "devices", "throttle", "planning", "datasets"},
    {"balancing", "_keras"},
    {"data", "backend"},
    {"runtime", "keras"},
    {"api"},
    {"__init__", "bench", "cli", "__main__"},
]


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
