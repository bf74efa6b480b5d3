"""The package layering of docs/architecture.md, read from the source with `ast`: no import cycle
between moerun's packages, no layer importing one above it, ipc importing nothing of moerun but
itself and the errors' base, backends knowing nothing of engine, rig or server, and no
architecture branch outside models/."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"moerun": REPO / "moerun", "moerun.ipc": REPO / "ipc", "moerun.daemons": REPO / "daemons"}
# Top to bottom; a package may import only from its own layer's lower entries and the layers below.
LAYERS = [
    ("__main__", "cli", "commands", "config", "server", "daemons"),
    ("engine",),
    ("rig", "moe"),          # rig imports moe, never the other way
    ("backends",),
    ("writers", "models", "gguf"),
    ("log", "units", "paths"),   # leaf modules: import nothing of moerun but its errors' base
    ("ipc",),
    ("errors",),             # the base of moerun's errors, which ipc's derive from too
]
RANK = {unit: (layer, position) for layer, units in enumerate(LAYERS) for position, unit in enumerate(units)}


def unit_of(module: str) -> str | None:
    """The package (or top-level module) of a moerun module: moerun.rig.links -> rig."""
    parts = module.split(".")
    if parts[0] != "moerun" or len(parts) < 2:
        return None
    return parts[1]


def module_name(path: Path) -> str:
    for package, root in sorted(ROOTS.items(), key=lambda item: -len(item[0])):
        if path.is_relative_to(root):
            parts = list(path.relative_to(root).with_suffix("").parts)
            return ".".join([package, *parts[:-1]] if parts[-1] == "__init__" else [package, *parts])
    raise AssertionError(path)


def module_imports() -> set[tuple[str, str]]:
    """(importing module, imported module) for every import of a moerun module (`from moerun
    import x` as moerun.x)."""
    pairs = set()
    for root in ROOTS.values():
        for path in root.rglob("*.py"):
            source = module_name(path)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    targets = [node.module] if node.module != "moerun" else [f"moerun.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                else:
                    continue
                pairs.update((source, target) for target in targets if target.startswith("moerun"))
    return pairs


MODULE_IMPORTS = module_imports()


def imports() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the importing modules, for every moerun import."""
    edges: dict[tuple[str, str], list[str]] = {}
    for source, target in sorted(MODULE_IMPORTS):
        importer, imported = unit_of(source), unit_of(target)
        if imported is not None and importer not in (None, imported):
            edges.setdefault((importer, imported), []).append(source)
    return edges


EDGES = imports()


def test_every_package_and_top_level_module_has_a_layer():
    units = {unit for edge in EDGES for unit in edge}
    units |= {path.stem for path in (REPO / "moerun").glob("*.py") if path.stem != "__init__"}
    units |= {path.name for path in (REPO / "moerun").iterdir() if (path / "__init__.py").exists()}
    assert units - set(RANK) == set(), "give every new package or module a place in LAYERS (and the docs)"


@pytest.mark.parametrize("edge", sorted(EDGES), ids=lambda edge: f"{edge[0]}->{edge[1]}")
def test_no_layer_imports_upward(edge):
    importer, imported = edge
    assert RANK[imported] > RANK[importer], f"{importer} imports {imported} in {sorted(set(EDGES[edge]))}"


def test_no_import_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for importer, imported in EDGES:
        graph.setdefault(importer, set()).add(imported)
    done: set[str] = set()

    def visit(unit: str, path: tuple[str, ...]) -> None:
        assert unit not in path, f"import cycle: {' -> '.join((*path, unit))}"
        if unit not in done:
            for imported in graph.get(unit, ()):
                visit(imported, (*path, unit))
            done.add(unit)

    for unit in graph:
        visit(unit, ())


def test_ipc_imports_nothing_of_moerun_but_itself_and_the_errors_base():
    assert [edge for edge in EDGES if edge[0] == "ipc" and edge[1] != "errors"] == []


def test_backends_import_neither_engine_rig_nor_server():
    assert [edge for edge in EDGES if edge[0] == "backends" and edge[1] in ("engine", "rig", "server", "moe")] == []


def test_leaf_modules_import_nothing_of_moerun_but_the_errors_base():
    assert [edge for edge in EDGES if edge[0] in ("log", "units", "paths", "errors") and edge[1] != "errors"] == []


# The expert daemon's side: what runs in a daemon process to serve experts. A layer shard
# (daemons/shard.py) is a parent to its own expert daemons and runs the engine and a rig.
DAEMON_SIDE = ("moerun.daemons.handler", "moerun.daemons.gpu_experts", "moerun.daemons.slot_server")
PARENT_SIDE = ("moerun.rig", "moerun.engine", "moerun.server", "moerun.commands")


def daemon_side_violations(pairs: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """Imports of the parent's supervision, engine, server or commands by the daemon's side."""
    return sorted((source, target) for source, target in pairs
                  if source.startswith(DAEMON_SIDE) and target.startswith(PARENT_SIDE))


def test_the_daemon_side_imports_no_parent_code():
    assert daemon_side_violations(MODULE_IMPORTS) == []


def test_the_daemon_side_rule_catches_a_violation():
    planted = {("moerun.daemons.handler", "moerun.rig.supervisor"), ("moerun.daemons.shard", "moerun.rig.supervisor"),
               ("moerun.daemons.gpu_experts", "moerun.backends.gpu_ipc")}
    assert daemon_side_violations(planted) == [("moerun.daemons.handler", "moerun.rig.supervisor")]


def test_every_module_imports_on_a_machine_without_a_gpu():
    """GPU code imports CuPy when it runs, not when it is imported: a moved or renamed module
    whose imports broke fails here, not first on a GPU machine."""
    import importlib
    modules = sorted(module_name(path) for root in ROOTS.values() for path in root.rglob("*.py"))
    for module in modules:
        if not module.endswith("__main__"):
            importlib.import_module(module)


def test_no_architecture_branch_outside_models():
    """What an architecture does is in its file in moerun/models/: the engine reads nothing of
    the architecture's rule (the backends read what their operations take), and neither the
    engine nor the backends, the routing or the rig compare a value to an architecture's name."""
    from moerun.models.registry import ARCHITECTURES
    names = {n for module in ARCHITECTURES.values() for n in (module.RULE.family, module.RULE.gguf_arch)}
    branches = []
    for package in ("engine", "backends", "moe", "rig"):
        for path in (REPO / "moerun" / package).rglob("*.py"):
            where = path.relative_to(REPO)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if package == "engine" and isinstance(node, ast.Attribute) and node.attr == "rule":
                    branches.append(f"{where}:{node.lineno} reads the rule")
                if isinstance(node, ast.Compare):
                    constants = [c.value for operand in (node.left, *node.comparators) for c in ast.walk(operand)
                                 if isinstance(c, ast.Constant)]
                    branches += [f"{where}:{node.lineno} compares to {v!r}" for v in constants if v in names]
    assert branches == []
