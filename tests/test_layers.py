"""The import structure docs/architecture.md describes: no import cycle between modules, no
package imports one from a higher layer, the product never imports the lab, and the lab
(`cachecraft_bench`) imports only the product's public modules (imports inside functions and
under TYPE_CHECKING count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import cachecraft
import cachecraft_bench

ROOT = Path(cachecraft.__file__).parent
LAB = Path(cachecraft_bench.__file__).parent
LAYERS = [
    {"errors", "env", "logs", "config", "config_file", "request"},
    {"model", "store"},
    {"reuse"},
    {"engine"},
    {"llm"},
    {"server"},
    {"api"},
    {"cli", "cachecraft"},
    {"cachecraft_bench"},
]
LEVEL = {name: i for i, layer in enumerate(LAYERS) for name in layer}
PUBLIC = {
    "cachecraft",
    "cachecraft.api",
    "cachecraft.llm",
    "cachecraft.request",
    "cachecraft.config",
    "cachecraft.config_file",
    "cachecraft.errors",
    "cachecraft.env",
    "cachecraft.store.base",
    "cachecraft.store.config",
}
"""The public modules (cachecraft/api.py and docs/architecture.md list the same); every other
module is internal, and what outsiders need from one is re-exported by cachecraft.api."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in [*ROOT.rglob("*.py"), *LAB.rglob("*.py")]:
        root = ROOT if path.is_relative_to(ROOT) else LAB
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.append(full if full in mods else node.module)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            edges[m] |= {t for t in targets if t in mods and t != m}
    return edges


def _package(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "cachecraft_bench":
        return "cachecraft_bench"
    return parts[1] if len(parts) > 1 else "cachecraft"


def test_every_package_has_a_layer() -> None:
    assert {_package(m) for m in _modules()} <= set(LEVEL)


def test_no_import_from_a_higher_layer() -> None:
    edges = _edges(_modules())
    upward = sorted(
        f"{m} -> {t}"
        for m, targets in edges.items()
        for t in targets
        if LEVEL[_package(t)] > LEVEL[_package(m)]
    )
    assert upward == []


def test_lab_imports_only_public_modules() -> None:
    """The benchmarks measure what a user can run: they reach the engine, the model and the
    store through the public surface, never through an internal module."""
    edges = _edges(_modules())
    internal = sorted(
        f"{m} -> {t}"
        for m, targets in edges.items()
        if _package(m) == "cachecraft_bench"
        for t in targets
        if _package(t) != "cachecraft_bench" and t not in PUBLIC
    )
    assert internal == []


def test_the_product_never_imports_the_lab() -> None:
    edges = _edges(_modules())
    assert not any(
        _package(t) == "cachecraft_bench"
        for m, targets in edges.items()
        if _package(m) != "cachecraft_bench"
        for t in targets
    )


def test_the_public_modules_exist() -> None:
    assert set(_modules()) >= PUBLIC


def test_no_import_cycle() -> None:
    edges = _edges(_modules())
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycles.append([*path[path.index(t) :], t])
            elif t not in state:
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert cycles == []
