"""Imports flow one way: protos <- core <- edge, cloud <- orchestrator (bench and tests may use anything), and no
two modules import each other, directly or in a cycle, even from inside a function; inside a layer, its folders for
one concern (``ROOMS``) flow one way too. Read from the source (AST), so a lazy import against the flow is caught
too. Everything imports the product by its installed name, ``tandem.<layer>``: a bare ``core`` / ``edge`` import
would load a second copy of a module from the checkout."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protos", "core", "edge", "cloud", "orchestrator")
CONSUMERS = ("bench",)  # may import anything; nothing of the product may import them
ALLOWED = {
    "protos": {"protos"},
    "core": {"protos", "core"},
    "edge": {"protos", "core", "edge"},
    "cloud": {"protos", "core", "cloud"},
    "orchestrator": {"protos", "core", "edge", "cloud", "orchestrator"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("tandem",) + parts if parts[0] in PACKAGES else parts)


def modules(packages=PACKAGES + CONSUMERS) -> dict[str, Path]:
    return {module_name(p): p for pkg in packages for p in (ROOT / pkg).rglob("*.py")
            if not p.name.endswith("_pb2_grpc.py")}


def layer(name: str) -> str:
    return name.split(".")[1] if name.startswith("tandem.") else name.split(".")[0]


def imports(name: str, path: Path) -> set[str]:
    """Every module of ours that ``name`` imports, wherever in the file."""
    pkg = name.rsplit(".", 1)[0]  # the package a relative import starts from (x.py and __init__.py alike)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y / from . import y
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
                out |= {target} | {f"{target}.{a.name}" for a in node.names}
            elif node.module:
                out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    ours = set(modules())
    ours |= {m.removesuffix(".__init__") for m in ours}  # a package is imported by its own name
    return {m for m in out if m in ours and m != name and m != name.removesuffix(".__init__")}


def test_imports_flow_one_way():
    against = []
    for name, path in modules(PACKAGES).items():
        for target in imports(name, path):
            if layer(target) not in ALLOWED[layer(name)]:
                against.append(f"{name} -> {target}")
    assert not against, "imports against the flow protos <- core <- edge, cloud <- orchestrator:\n" + "\n".join(
        sorted(against))


# the folders for one concern inside a layer: each may import itself and the rooms listed, nothing else of its layer
# (its layer's top level imports them, never the other way)
ROOMS = {
    "tandem.cloud.caches": set(),
    "tandem.cloud.engines": {"tandem.cloud.caches"},
    "tandem.cloud.learning": set(),
    "tandem.edge.export": set(),
}


def room(name: str) -> str | None:
    return next((r for r in ROOMS if name == r or name.startswith(r + ".")), None)


def test_rooms_import_one_way():
    against = []
    for name, path in modules(PACKAGES).items():
        own = room(name.removesuffix(".__init__"))
        if own is None:
            continue
        for target in imports(name, path):
            if layer(target) != layer(name) or room(target) in {own} | ROOMS[own]:
                continue
            against.append(f"{name} -> {target}")
    assert not against, "a room imports its layer's top level or a room it may not:\n" + "\n".join(sorted(against))


def test_no_import_cycles():
    mods = modules(PACKAGES)
    graph = {name: imports(name, path) for name, path in mods.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    cycles = [c for c in cycles if not all(m.endswith("__init__") or m in {f"tandem.{p}" for p in PACKAGES} for m in c)]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_product_is_imported_by_its_installed_name():
    bare = []
    files = [p for d in PACKAGES + CONSUMERS + ("tests",) for p in (ROOT / d).rglob("*.py")]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else [])
            bare += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in PACKAGES]
    assert not bare, "import these as tandem.<layer>:\n" + "\n".join(bare)


def test_every_import_of_ours_names_a_module_that_exists():
    """A lazy import of a moved or renamed module fails only when its function runs: catch it here."""
    import importlib.util
    missing = []
    for name, path in modules(PACKAGES + CONSUMERS).items():
        pkg = name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            elif isinstance(node, ast.ImportFrom) and node.module:
                target = node.module
            else:
                continue
            if target.startswith("tandem.") and importlib.util.find_spec(target) is None:
                missing.append(f"{name}: {target}")
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(sorted(missing))


def test_every_package_folder_is_installed():
    """pyproject.toml lists the packages one by one: a folder left out of the list is left out of the wheel."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {module_name(p).removesuffix(".__init__")
               for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    assert folders == listed, f"not listed: {sorted(folders - listed)}; listed, not there: {sorted(listed - folders)}"
