"""The package's shape: rooms by concern, imports that run one way, and the rules that keep the
GPU and the executor behind their one door each.

The import graph is read from the source with ast (imports inside functions included), so a lazy
import that closes a cycle counts as much as one at the top of a file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "zerolite"
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"

# Lowest first: a module may import from its own room and from rooms below it, never above.
LAYERS = [
    ("errors", "torch_env", "openmp", "huge_pages", "progress", "hf", "text", "sampling", "memory_model", "_engine"),
    ("io",),
    ("layout",),
    ("quant",),
    ("moe",),
    ("convert",),
    ("distributed",),
    ("runtime",),
    ("planner",),
    ("speculative",),
    ("lm",),
    ("decoding",),
    ("generate",),
    ("serve",),
    ("profile",),
    ("cli",),
    ("__init__", "__main__"),
]
RANK = {room: rank for rank, rooms in enumerate(LAYERS) for room in rooms}
DEVICE_MODULE = "zerolite.io.device"


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(path, package): path for path in sorted(package.rglob("*.py"))}


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The zerolite modules path imports, anywhere in it: `from zerolite.a import b` is zerolite.a.b
    where that is a module, else zerolite.a; relative imports are resolved against name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("zerolite")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parents + ([base] if base else []))
            if not base.startswith("zerolite"):
                continue
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    known = modules(package)
    names = set(known) | {"zerolite._engine"}  # the C++ engine, built by CMake
    return {name: imported(path, name, names) for name, path in known.items()} | {"zerolite._engine": set()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for other in sorted(graph[node]):
            if state.get(other) == 1:
                return path[path.index(other):] + [other]
            if other not in state and (found := visit(other)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} imports {b}" for a, targets in graph.items() for b in sorted(targets)
            if RANK[room(b)] > RANK[room(a)]]


def test_every_room_has_a_layer():
    rooms = {room(m) for m in modules()}
    assert rooms <= set(RANK), f"rooms with no place in LAYERS: {sorted(rooms - set(RANK))}"


def test_the_package_has_no_import_cycle():
    assert cycle(import_graph()) is None, " -> ".join(cycle(import_graph()))


def test_imports_run_down_the_layers_only():
    assert upward(import_graph()) == []


def test_a_cycle_is_found(tmp_path):
    """The check itself: a lazy import that closes a loop between two rooms is caught."""
    package = tmp_path / "zerolite"
    (package / "io").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "io" / "__init__.py").write_text("")
    (package / "io" / "engine.py").write_text("def f():\n    from zerolite.lm import load\n")
    (package / "lm.py").write_text("from zerolite.io.engine import f\n")
    graph = import_graph(package)
    assert cycle(graph) == ["zerolite.io.engine", "zerolite.lm", "zerolite.io.engine"]
    assert upward(graph) == ["zerolite.io.engine imports zerolite.lm"]


def test_the_package_has_rooms_and_few_modules_at_the_top():
    top = [p.stem for p in PACKAGE.glob("*.py")]
    rooms = [p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()]
    assert len(top) <= 14, sorted(top)
    assert len(rooms) >= 8, sorted(rooms)


# Folder names that common tools pass over without a word: Python's standard .gitignore ignores them at
# any depth, ruff's and black's default excludes skip them, and code-map tools read spec/ and tests/ as
# tests. A room named like one of these would drop out of commits, lint runs or maps.
IGNORED_FOLDER_NAMES = {
    "build", "develop-eggs", "dist", "downloads", "eggs", "lib", "lib64", "parts", "sdist", "var", "wheels",
    "htmlcov", "env", "venv", "ENV", "instance", "target", "site", "cython_debug", "__pypackages__",
    "_build", "buck-out", "node_modules", "site-packages", "spec", "specs", "test", "tests",
}


def test_no_room_is_named_like_a_folder_tools_ignore():
    folders = {p.name for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"}
    assert folders & IGNORED_FOLDER_NAMES == set()


def rooms_imported(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """For each module, the rooms other than its own that it imports from."""
    return {a: {room(b) for b in targets} - {room(a)} for a, targets in graph.items()}


def test_the_executor_and_every_module_import_from_few_rooms():
    """A module that reaches into many rooms is a hub where every feature lands: the executor keeps
    to bindings, slots and the schedule (at most 4 rooms besides runtime), and no module reaches
    past 6."""
    reach = rooms_imported(import_graph())
    worst = sorted(reach.items(), key=lambda item: -len(item[1]))[:5]
    report = "; ".join(f"{name}: {len(rooms)} {sorted(rooms)}" for name, rooms in worst)
    assert len(reach["zerolite.runtime.executor"]) <= 4, report
    assert all(len(rooms) <= 6 for rooms in reach.values()), report


def test_torch_cuda_only_in_the_device_module():
    """Every CUDA call goes through zerolite.io.device, so the simulated device sees them all."""
    users = [name for name, path in modules().items()
             if name != DEVICE_MODULE and re.search(r"\btorch\.cuda\b|from torch import cuda", path.read_text())]
    assert users == []


def test_only_lm_reaches_the_executor():
    """OffloadedLM is the executor's one door: everything else asks it (lm.recover(), lm.new_cache())."""
    users = [name for name, path in modules().items()
             if name not in ("zerolite.lm.offloaded_lm", "zerolite.runtime.executor", "zerolite.runtime.loader")
             and re.search(r"\.executor\b", path.read_text())]
    assert users == []


def documented_rooms() -> list[str]:
    """The subpackages docs/architecture.md's layout section names: one `zerolite/NAME/` line each."""
    section = ARCHITECTURE.read_text().split("## Layout of the code", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\s*zerolite/(\w+)/", section, flags=re.M)


def test_the_documented_layout_is_the_tree():
    rooms = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert sorted(documented_rooms()) == rooms


def test_the_picture_of_the_house_is_the_layers(monkeypatch):
    """docs/architecture.md's diagram is drawn from LAYERS by tools/house_diagram.py: a floor
    changed here and not redrawn there fails."""
    monkeypatch.syspath_prepend(str(PACKAGE.parent / "tools"))
    from house_diagram import block, drawn

    assert drawn(ARCHITECTURE.read_text()) == block(LAYERS), "run python tools/house_diagram.py"


def zerolite_imports() -> set[tuple[str, str]]:
    """Every (module, name) of a `from zerolite... import name` in zerolite/, tests/ and tools/."""
    found = set()
    for folder in ("zerolite", "tests", "tools"):
        for path in (PACKAGE.parent / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("zerolite"):
                    found |= {(node.module, alias.name) for alias in node.names}
    return found


def test_every_name_imported_from_zerolite_is_there():
    """After a move, a stale import in a lazily imported function or a tool would only fail when
    that path runs: here each one is imported."""
    import importlib

    missing = []
    for module, name in sorted(zerolite_imports()):
        target = importlib.import_module(module)
        is_package = hasattr(target, "__path__")
        if not hasattr(target, name) and not (is_package and importlib.util.find_spec(f"{module}.{name}")):
            missing.append(f"from {module} import {name}")
    assert missing == []
