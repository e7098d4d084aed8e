"""The client's modules import each other without a circle, type-only imports counted.

A module that needs another only for a type still depends on it: a circle of such
imports is a circle of parts that know each other. The graph is read from the source
with ``ast``, so an import under ``if TYPE_CHECKING:`` or inside a function counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import meshbus.client

PACKAGE = "meshbus.client"
SOURCE = Path(meshbus.client.__file__).parent


def imported(tree: ast.AST) -> set[str]:
    """The modules of the package that ``tree`` imports (a name imported from the
    package itself counts as its submodule when there is one)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    prefix = f"{PACKAGE}."
    return {name.removeprefix(prefix) for name in found if name.startswith(prefix)}


def import_graph() -> dict[str, set[str]]:
    """Each module of the package (``__init__`` left out: importing a submodule runs
    it, so every module would import it) and the package's modules it imports."""
    modules = {path.stem: path for path in SOURCE.glob("*.py") if path.stem != "__init__"}
    return {
        name: imported(ast.parse(path.read_text(), str(path))) & modules.keys()
        for name, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """A circle of imports in ``graph`` (its modules in order, the first again at the end),
    or [] when there is none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str]:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return []
        path.append(node)
        for successor in sorted(graph[node]):
            if cycle := visit(successor):
                return cycle
        path.pop()
        done.add(node)
        return []

    for node in sorted(graph):
        if cycle := visit(node):
            return cycle
    return []


def test_the_client_modules_form_a_dag() -> None:
    graph = import_graph()
    assert {"connector", "failover", "inbound", "message"} <= graph.keys()
    assert graph["inbound"] >= {"memberships", "waiters"}, "the graph is read, not empty"
    cycle = find_cycle(graph)
    assert not cycle, "the client's modules import each other in a circle: " + " -> ".join(cycle)


def test_a_circle_is_found() -> None:
    """The check can fail: a type-only import back up closes a circle."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from meshbus.client.service import Service\n"
    )
    graph = {"service": {"mailboxes"}, "mailboxes": imported(tree), "link": set()}
    assert find_cycle(graph) == ["mailboxes", "service", "mailboxes"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []
