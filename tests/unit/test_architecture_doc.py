"""docs/architecture.md stays true to the code: every module it names exists, and
every class (and ``Class.method``) it cites is defined where the code is."""

from __future__ import annotations

import ast
import builtins
import re
from functools import cache
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
DOC = CHECKOUT / "docs" / "architecture.md"
SRC = CHECKOUT / "src" / "meshbus"
# Where a bare module name of the doc is looked for: the package, then its folders.
MODULE_ROOTS = [CHECKOUT, SRC, SRC / "broker", SRC / "client"]


@cache
def module_names() -> dict[str, set[str]]:
    """Every module's base name (``dispatch``) -> the names it defines at its top level."""
    modules: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        names = modules.setdefault(path.stem, set())
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(target.id for target in targets if isinstance(target, ast.Name))
    return modules


@cache
def defined() -> dict[str, set[str]]:
    """Every class of src/meshbus -> the names defined in it (methods, attributes)."""
    classes: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = classes.setdefault(node.name, set())
                for item in ast.walk(node):
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        names.add(item.name)
                    elif isinstance(item, ast.Attribute):
                        names.add(item.attr)
                    elif isinstance(item, ast.Name):
                        names.add(item.id)
    return classes


def cited(pattern: str) -> set[str]:
    return set(re.findall(pattern, DOC.read_text()))


def test_every_module_named_exists() -> None:
    missing = [
        name
        for name in cited(r"`([\w/]+\.py)`")
        if not any((root / name).is_file() for root in MODULE_ROOTS)
    ]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_class_and_method_cited_is_defined() -> None:
    classes = defined()
    top_level = module_names()
    wrong = []
    for ref in cited(r"`([A-Z][A-Za-z]+(?:\.[a-z_]\w*)?)(?:\(\))?`"):
        name, _, member = ref.partition(".")
        if name.isupper() or hasattr(builtins, name):
            continue  # a constant or an enum member; a builtin exception
        if member:
            if name not in classes or member not in classes[name]:
                wrong.append(ref)
        elif name not in classes and not any(name in names for names in top_level.values()):
            wrong.append(ref)  # neither a class nor a type alias (``Dialer``)
    assert not wrong, f"docs/architecture.md cites what the code does not define: {wrong}"


def test_every_module_function_cited_is_defined() -> None:
    modules = module_names()
    wrong = [
        ref
        for ref in cited(r"`([a-z_]+\.[A-Za-z_]\w*)(?:\(\))?`")
        if not ref.endswith(".py")
        if (module := ref.partition(".")[0]) in modules or module.startswith("cli_")
        if not (SRC / module).is_dir()
        if ref.partition(".")[2] not in modules.get(module, set())
    ]
    assert not wrong, f"docs/architecture.md cites functions that moved or went: {wrong}"
