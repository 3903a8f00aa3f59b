"""The package's imports go one way: each layer imports only the layers below it.

Layers, lowest first (ARCHITECTURE.md): ``errors``; ``types`` and ``config``; ``model``;
``verifier``; ``proposers``; ``engine``; ``server``, ``bench`` and ``distill``; ``deploy``;
``cli``; the package's own ``__init__``, which re-exports the public API. A module may import
its own layer's unit (a package's modules import each other) and any unit of a lower layer;
two units of one layer (``types`` and ``config``; ``server``, ``bench`` and ``distill``) do
not import each other. Every import counts, lazy ones inside functions and ``TYPE_CHECKING``
ones included. Outside ``model/``, the runtime is reached only through ``hybridspec.model``'s
public names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import hybridspec

PACKAGE_DIR = Path(hybridspec.__file__).parent

LAYERS: dict[str, int] = {
    "errors": 0,
    "lazy": 0,  # the package __init__s' lazy re-exports
    "types": 1,
    "config": 1,
    "model": 2,
    "verifier": 3,
    "proposers": 4,
    "engine": 5,
    "server": 6,
    "bench": 6,
    "distill": 6,
    "deploy": 7,  # Ray Serve: replicas of the server's app
    "cli": 8,
    "": 9,  # hybridspec/__init__.py
}


def module_name(path: Path, package_dir: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> str:
    """``hybridspec.model.llama`` -> ``model``; ``hybridspec`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imported_modules(
    source: str, module: str, is_package: bool, modules: set[str]
) -> list[tuple[str, int]]:
    """Every ``hybridspec`` module that ``source`` imports, with its line, lazy imports too.

    ``from hybridspec.model import loader`` imports the module ``hybridspec.model.loader`` when
    ``modules`` holds it, else the name ``loader`` of ``hybridspec.model``.
    """
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            for alias in node.names:
                submodule = f"{name}.{alias.name}"
                found.append((submodule if submodule in modules else name, node.lineno))
    return [(name, line) for name, line in found if name.split(".")[0] == "hybridspec"]


def import_graph(package_dir: Path) -> dict[str, list[tuple[str, int]]]:
    paths = {module_name(path, package_dir): path for path in sorted(package_dir.rglob("*.py"))}
    return {
        module: imported_modules(path.read_text(), module, path.name == "__init__.py", set(paths))
        for module, path in paths.items()
    }


def layer_violations(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    problems = []
    for module, imports in graph.items():
        unit = unit_of(module)
        for target, line in imports:
            other = unit_of(target)
            if other == unit:
                continue
            if LAYERS[other] >= LAYERS[unit]:
                problems.append(f"{module}:{line} imports {target} (layer {other!r} is not below)")
            elif other == "model" and target.count(".") > 1:
                problems.append(f"{module}:{line} reaches into {target}: use hybridspec.model")
    return problems


def import_cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Cycles among modules, a package counting as its ``__init__`` module."""
    edges = {
        module: sorted({t for t, _ in imports if t in graph}) for module, imports in graph.items()
    }
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in edges[module]:
            if target == module or module.startswith(target + "."):
                continue  # a package's own modules read its __init__ as they load: no cycle
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in edges:
        if module not in state:
            visit(module)
    return cycles


def test_every_unit_has_a_layer() -> None:
    units = {unit_of(module) for module in import_graph(PACKAGE_DIR)}
    assert units <= set(LAYERS), f"modules outside the layer map: {units - set(LAYERS)}"


def test_imports_go_one_way() -> None:
    assert layer_violations(import_graph(PACKAGE_DIR)) == []


def test_no_import_cycle() -> None:
    assert import_cycles(import_graph(PACKAGE_DIR)) == []


@pytest.mark.parametrize(
    ("module", "statement", "problem"),
    [
        ("model/loader.py", "from hybridspec.engine import Engine", "layer 'engine' is not below"),
        ("verifier/verify.py", "import hybridspec.proposers", "layer 'proposers' is not below"),
        ("types.py", "from hybridspec.config import EngineConfig", "layer 'config' is not below"),
        ("bench/report.py", "from hybridspec.server import create_app", "is not below"),
        ("proposers/draft.py", "from hybridspec.model.llama import x", "reaches into"),
    ],
)
def test_a_forbidden_import_is_caught(
    tmp_path: Path, module: str, statement: str, problem: str
) -> None:
    copy = tmp_path / "hybridspec"
    for path in PACKAGE_DIR.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE_DIR)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    edited = copy / module
    edited.write_text(edited.read_text() + f"\n\ndef _late():\n    {statement}\n")
    found = layer_violations(import_graph(copy))
    assert len(found) == 1 and problem in found[0], found


def test_a_cycle_is_caught(tmp_path: Path) -> None:
    package = tmp_path / "hybridspec"
    (package / "engine").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "engine" / "__init__.py").write_text("")
    (package / "engine" / "a.py").write_text("from hybridspec.engine import b\n")
    (package / "engine" / "b.py").write_text("import hybridspec.engine.a\n")
    cycles = import_cycles(import_graph(package))
    assert any({"hybridspec.engine.a"} <= set(cycle) for cycle in cycles), cycles
