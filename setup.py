"""The compiled hot path (src/meshbus/compiled.py): mypyc builds of the modules it names.

Everything else about the package is in pyproject.toml. The extensions are optional: a
machine without a C compiler (or where mypyc cannot build them) installs the package
all the same, says so once here, and runs the pure-Python source, which is the
reference the extensions are compiled from.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.extension import Extension

_SELECTOR = Path(__file__).parent / "src" / "meshbus" / "compiled.py"


def _constant(name: str) -> Any:
    """A constant of the selector, read from its source (the build does not import it)."""
    for node in ast.parse(_SELECTOR.read_text()).body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == name:
            return ast.literal_eval(node.value)
    raise LookupError(f"{_SELECTOR} defines no {name}")


def _warn(reason: str) -> None:
    print(
        f"WARNING: meshbus installs without its compiled hot path ({reason}); "
        "it runs the pure-Python source, slower per message.",
        file=sys.stderr,
    )


def _extensions() -> list[Extension]:
    modules: tuple[str, ...] = _constant("MODULES")
    group: str = _constant("GROUP")
    try:
        from mypyc.build import mypycify

        # mypy type-checks what it compiles: the package's own config (strict) applies.
        extensions = mypycify(
            [str(Path("src", *m.split("."))) + ".py" for m in modules],
            group_name=group.removesuffix("__mypyc"),
            opt_level="3",
        )
    except (Exception, SystemExit) as exc:  # mypyc exits on a type error
        _warn(f"mypyc could not generate it: {exc}")
        return []
    for extension in extensions:
        # No compiler, or a failed compile: build_ext warns and installs the rest.
        extension.optional = True
    return extensions


# pip runs this file three times for one install -- for the build's requirements, for
# the metadata, and for the build itself -- and only the build compiles: mypyc's
# type-check and C generation cost ~7 s each time, so they run for a build command only.
_BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}
# Set by the Makefile's first install, which puts the dependencies in place: the
# extension (~40 s of one core for gcc) is built by a second install beside the checks
# (mypy, ruff), not before them.
_DEFER = "MESHBUS_DEFER_BUILD"

_building = bool(_BUILDS & set(sys.argv[1:])) and os.environ.get(_DEFER) != "1"
setup(ext_modules=_extensions() if _building else [])
