"""The import graph of ``multigpu/``: no circle, no arrow from a layer to one above it, frameworks in ``backend/``.

Every ``import`` counts, those inside functions too (they hide circles from
Python but not from a reader).  The layers, bottom to top, are listed in
:data:`LAYERS`; a module may import its own folder and any layer below.  Only
``backend/<name>/`` imports torch, JAX or TensorFlow (the readers of their
own input types and the benchmark harness excepted: :data:`FRAMEWORK_USERS`),
and ``engine/``, the torch.distributed engine that the torch and TensorFlow
backends both sum on, imports torch alone; no backend folder imports another,
and each backend declares its facts there.  Every Keras internal the package
reaches is declared where ``compat.check`` looks it up.
"""

import ast
import collections
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "multigpu"

# bottom to top; each entry is a top-level module or folder of multigpu/
LAYERS = [
    {"env", "_warn"},
    {"log"},
    {"failure", "membership", "devices", "throttle", "planning"},
    {"balancing", "_keras", "engine"},
    {"data", "backend"},
    {"runtime", "keras"},
    {"arguments"},
    {"api"},
    {"__init__", "bench", "cli", "__main__"},
]


FRAMEWORKS = {"torch", "jax", "jaxlib", "tensorflow"}
# Modules outside backend/ that may import a framework, and why.
FRAMEWORK_USERS = {
    "data/loader.py": "reads a torch DataLoader, torch's own input type",
    "data/tfdata.py": "reads a tf.data.Dataset, TensorFlow's own input type",
    "bench/worker.py": "the `multigpu bench` harness times each framework's own passes",
    "bench/breakdown.py": "the `multigpu bench` harness times torch's calls and TensorFlow's traced step",
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
        if relative.startswith("engine/") and _framework_imports(path) <= {"torch"}:
            continue  # torch.distributed, the engine of the torch and TensorFlow backends
        if _framework_imports(path) and relative not in FRAMEWORK_USERS:
            wrong.append(f"{relative} imports {sorted(_framework_imports(path))}")
    assert wrong == [], "framework imports outside backend/<name>/: " + "; ".join(wrong)
    assert all((ROOT / p).exists() and _framework_imports(ROOT / p) for p in FRAMEWORK_USERS), \
        "an exception that no longer imports a framework: drop it"


def test_no_backend_folder_imports_another():
    """A backend is one folder: what two backends share lives below them (``backend/steps.py``, ``engine/``)."""
    wrong = []
    for path in sorted((ROOT / "backend").glob("*/**/*.py")):
        own = path.relative_to(ROOT / "backend").parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[:2] == ["multigpu", "backend"] and len(parts) > 2 and (ROOT / "backend" / parts[2]).is_dir() \
                        and parts[2] != own:
                    wrong.append(f"backend/{path.relative_to(ROOT / 'backend').as_posix()} imports {name}")
    assert wrong == [], wrong


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


# ------------------------------------------------------------------ Keras internals
_ADDED = {"_initialize_ddp"}  # set on the model where Keras has it (3.16) or not: nothing of Keras's is needed


def test_every_keras_internal_the_package_reaches_is_declared_for_the_compat_check():
    """Every ``obj._name`` (and ``getattr(obj, "_name")``) in ``_keras/compat.py`` and every name any module sets
    through a ledger is in ``compat.INTERNALS`` (so ``compat.check`` looks it up at ``parallelize``), a public
    Keras name, or multigpu's own (``_multigpu_*``)."""
    import keras

    from multigpu._keras import compat

    declared = {a for _, a, _ in compat.INTERNALS}
    text = (ROOT / "_keras" / "compat.py").read_text()
    reached = set(re.findall(r"\b(?:model|layer|optimizer|callback|metric|_optimizer)\.(_[a-z]\w*)", text))
    reached |= set(re.findall(r"getattr\(\w+, \"(_[a-z]\w*)\"", text))
    reached -= {"_multigpu_blockwise", "_multigpu_sync"}
    assert reached and reached <= declared, sorted(reached - declared)
    set_names = set()
    for path in ROOT.rglob("*.py"):
        set_names |= set(re.findall(r"ledger\.set\([\w.]+, \"(\w+)\"", path.read_text()))
    private = {n for n in set_names if n.startswith("_") and not n.startswith("_multigpu_")} - _ADDED
    assert private <= declared, sorted(private - declared)
    public = {n for n in set_names if not n.startswith("_")}
    assert all(hasattr(keras.Model, n) or hasattr(keras.optimizers.Optimizer, n)
               or hasattr(keras.callbacks.BackupAndRestore("x"), n) for n in public), public


def test_the_compat_check_names_a_missing_internal_and_the_keras_version(monkeypatch):
    import keras

    from multigpu._keras import compat

    monkeypatch.setattr(compat, "_CHECKED", False)
    compat.check()  # this Keras has them all
    monkeypatch.setattr(compat, "_CHECKED", False)
    monkeypatch.setattr(compat, "INTERNALS", [*compat.INTERNALS, ("BatchNormalization", "_moments_gone", None)])
    with pytest.raises(RuntimeError, match=rf"Keras {re.escape(keras.__version__)} does not have: "
                                           r"BatchNormalization\._moments_gone\. multigpu is tested with Keras"):
        compat.check()


# ------------------------------------------------------------------ the layout CONTRIBUTING.md describes
def _layout_sections() -> dict[str, str]:
    """CONTRIBUTING.md's layout block, by entry: ``api.py``, ``backend/``, ``backend/torch/``, ..."""
    text = (ROOT.parent / "CONTRIBUTING.md").read_text()
    block = text.split("```\nmultigpu/\n", 1)[1].split("```", 1)[0]
    sections: dict[str, str] = {}
    name = ""
    for line in block.splitlines():
        head = re.match(r"^  (\S+)", line)
        words = line
        if head:
            name = head.group(1)
            words = line[len(head.group(0)):]
        elif not line.startswith("   "):
            name = ""  # the next top-level entry of the repository (benchmarks/, examples/, ...)
        if name:
            sections[name] = sections.get(name, "") + " " + words
    # backend/'s entry names each backend's folder as `name/:`, followed by its modules
    parts = re.split(r"\b(torch|jax|tensorflow)/:", sections.get("backend/", ""))
    for i in range(1, len(parts) - 1, 2):
        sections[f"backend/{parts[i]}/"] = parts[i + 1]
    sections["backend/"] = parts[0]
    return sections


def test_the_layout_in_contributing_names_every_module_where_it_is():
    """Every module of the package is named in CONTRIBUTING.md's layout, in its folder's entry, and every
    module the layout names exists: the layout cannot drift from the tree again."""
    sections = _layout_sections()
    missing, gone = [], []
    modules = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if p.name != "__init__.py")
    for relative in modules:
        folder, _, name = relative.rpartition("/")
        entry = f"{folder}/" if folder else name
        named = entry in sections and (not folder or re.search(rf"(?<![\w.]){re.escape(name)}\b", sections[entry]))
        if not named:
            missing.append(relative)
    for entry, words in sections.items():
        if entry.endswith("/"):
            for name in set(re.findall(r"(?<![\w./])(\w+\.py)\b", words)):
                if not (ROOT / entry / name).exists() and name != "__init__.py":
                    gone.append(f"{entry}{name}")
    assert missing == [] and gone == [], f"not in CONTRIBUTING.md's layout: {missing}; named there, absent: {gone}"


def test_no_test_of_a_backend_name_outside_backend():
    """What differs between backends is a fact of the backend (``Facts``), not a test of its name: outside
    ``backend/`` no code compares a name with ``"torch"``, ``"jax"`` or ``"tensorflow"`` (the benchmark
    harness, which times each framework's own passes, excepted: :data:`FRAMEWORK_USERS`)."""
    name = r"""["'](?:torch|jax|tensorflow)["']"""
    pattern = re.compile(rf"(?:==|!=)\s*{name}|{name}\s*(?:==|!=)|\bin\s*[(\[{{]\s*{name}")
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("backend/") or relative in FRAMEWORK_USERS:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                wrong.append(f"{relative}:{number}: {line.strip()}")
    assert wrong == [], wrong


def _retries(text: str) -> list[str]:
    """The lines of ``text`` that take a step again: an ``except`` of a lost peer or an out-of-memory step that
    does not raise again, a recovery's ``keep`` or ``after_loss``, a memory's ``cut_again``."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if re.search(r"\.after_loss\(|\.cut_again\(|recovery\.keep\(", line):
            found.append(line.strip())
        if re.match(r"\s*except\b.*\b(PeerLostError|OutOfMemoryStepError)\b", line):
            indent = len(line) - len(line.lstrip())
            block = []
            for after in lines[i + 1:]:
                if after.strip() and len(after) - len(after.lstrip()) <= indent:
                    break
                block.append(after.strip())
            if "raise" not in block:
                found.append(line.strip())
    return found


def test_only_the_step_driver_takes_a_step_again():
    """One retry loop in the package (:mod:`multigpu.backend.driver`): no backend folder takes a step again
    after a lost peer or an out-of-memory step itself, nor keeps a step's state for it."""
    wrong = {path.relative_to(ROOT).as_posix(): _retries(path.read_text())
             for path in sorted((ROOT / "backend").glob("*/*.py"))}
    assert {k: v for k, v in wrong.items() if v} == {}
    assert _retries((ROOT / "backend" / "driver.py").read_text())  # the check sees the one loop


def test_no_module_is_over_400_lines():
    """A module that grows past 400 lines holds more than one concern: it is split, not let grow."""
    long = {path.relative_to(ROOT).as_posix(): n for path in sorted(ROOT.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > 400}
    assert long == {}, long
