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
               ("moerun.daemons.gpu_experts", "moerun.backends.gpu.ipc")}
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


# The GPU wing: code outside moerun/backends/ reaches the GPU backend through its package's
# interface (moerun.backends.gpu, and moerun.backends.gpu.ipc for what two processes share),
# reads a backend only where the Backend protocol declares it or through its `device`, reads
# a device only where the device interface below offers it, and assigns into neither.
GPU_INTERFACE_MODULES = ("moerun.backends.gpu", "moerun.backends.gpu.ipc")
DEVICE_INTERFACE = {"cupy", "index", "stream", "launch", "elementwise", "pinned", "cut", "copy_addresses",
                    "hop_through", "capturing", "graph_step", "set_step_hooks"}


def gpu_import_violations(pairs: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """Imports of the GPU backend's own modules from outside moerun.backends."""
    return sorted((source, target) for source, target in pairs
                  if target.startswith("moerun.backends.gpu.") and target not in GPU_INTERFACE_MODULES
                  and unit_of(source) != "backends")


def test_code_outside_the_backends_imports_the_gpu_backend_through_its_interface():
    assert gpu_import_violations(MODULE_IMPORTS) == []


def test_the_gpu_import_rule_catches_a_violation():
    planted = {("moerun.rig.gpu.dispatch", "moerun.backends.gpu.library"),
               ("moerun.rig.gpu.dispatch", "moerun.backends.gpu"),
               ("moerun.rig.shards", "moerun.backends.gpu.ipc"),
               ("moerun.backends.gpu.backend", "moerun.backends.gpu.library")}
    assert gpu_import_violations(planted) == [("moerun.rig.gpu.dispatch", "moerun.backends.gpu.library")]


def class_members(path: Path, name: str) -> set[str]:
    """The attributes a class declares: its annotations, methods and properties, and what its
    __init__ assigns to self."""
    tree = ast.parse(path.read_text())
    cls = next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == name)
    members = {node.target.id for node in cls.body if isinstance(node, ast.AnnAssign)}
    members |= {node.name for node in cls.body if isinstance(node, ast.FunctionDef)}
    members |= {node.attr for node in ast.walk(cls) if isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) and node.value.id == "self"}
    return members


def is_backend(node: ast.AST) -> bool:
    """`backend` or `<anything>.backend`: how moerun names a backend wherever it holds one."""
    return (isinstance(node, ast.Name) and node.id == "backend") or (isinstance(node, ast.Attribute)
                                                                     and node.attr == "backend")


def backend_uses(source: str, where: str) -> list[str]:
    """What `source` assigns of a backend or of its device, and reads beyond their interfaces."""
    allowed = class_members(REPO / "moerun/backends/protocol.py", "Backend") | {"device"}
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        on_device = isinstance(value, ast.Attribute) and value.attr == "device" and is_backend(value.value)
        name = f"backend.device.{node.attr}" if on_device else f"backend.{node.attr}"
        if (on_device or is_backend(node.value)) and isinstance(node.ctx, ast.Store):
            found.append(f"{where}:{node.lineno} assigns {name}")
        elif (on_device and node.attr not in DEVICE_INTERFACE) or (is_backend(node.value) and node.attr not in allowed):
            found.append(f"{where}:{node.lineno} reads {name}")
    return found


def test_the_device_interface_is_the_devices():
    assert DEVICE_INTERFACE <= class_members(REPO / "moerun/backends/gpu/device.py", "GpuDevice")


def test_code_outside_the_gpu_backend_uses_a_backend_through_its_interfaces():
    """Every module that holds a compute backend (the tokenizer's `backend` is another thing)."""
    found = []
    for root in ROOTS.values():
        for path in root.rglob("*.py"):
            if not path.is_relative_to(REPO / "moerun/backends/gpu") and not path.is_relative_to(REPO / "moerun/gguf"):
                found += backend_uses(path.read_text(), str(path.relative_to(REPO)))
    assert found == []


def test_the_backend_use_rule_catches_violations():
    planted = ("self.backend.device.step_guard = rings\nbackend.cupy.zeros(3)\nbackend.device.kernels.rows()\n"
               "backend.device.stream.synchronize()\nbackend.linear(x, w)\n")
    assert backend_uses(planted, "f.py") == ["f.py:1 assigns backend.device.step_guard", "f.py:2 reads backend.cupy",
                                             "f.py:3 reads backend.device.kernels"]
