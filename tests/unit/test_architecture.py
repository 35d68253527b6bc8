"""The package layering holds: no titanctl package imports one that imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "titanctl"


def _package_of(module: str) -> str:
    """titanctl.checkpoint.formats.hf -> checkpoint; titanctl.errors -> errors."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, dict[str, list[str]]]:
    """{package: {imported package: [modules that import it]}} over every import, local ones included."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        source = _package_of(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
                if node.module == "titanctl":
                    targets = [f"titanctl.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("titanctl.") and _package_of(target) != source:
                    graph.setdefault(source, {}).setdefault(_package_of(target), []).append(module)
    return graph


def test_no_package_imports_one_that_imports_it_back():
    graph = import_graph()
    cycles = []
    for a, targets in graph.items():
        for b, importers in targets.items():
            if a < b and a in graph.get(b, {}):
                cycles.append(f"{a} <-> {b}: {sorted(set(importers))} and {sorted(set(graph[b][a]))}")
    assert not cycles, "import cycles between packages:\n" + "\n".join(cycles)


def test_the_model_knows_nothing_of_parallelism_or_training():
    below_model = {"errors", "config", "models"}
    offenders = {b: m for b, m in import_graph().get("models", {}).items() if b not in below_model}
    assert not offenders, offenders
