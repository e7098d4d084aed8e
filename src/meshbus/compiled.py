"""The compiled hot path: which build of the per-message modules this process runs.

The modules every message passes through -- the codec, the client's per-message path
and the NATS listener's parser, ``MODULES`` -- are compiled by mypyc from their own
source when the package is built (``setup.py``; why mypyc and not Cython, with the
figures, is in BENCHMARKS.md).
The source stays the reference: there is no second implementation to keep in step,
and it is what runs when

* ``MESHBUS_NO_EXTENSIONS=1`` is set (the pure-Python leg, which ``make test`` runs
  too),
* the build made no extension (no C compiler: the install goes on without one), or
* an extension is older than its source (a checkout edited since it was built: the
  edit runs, not the old build; ``pip install -e .`` or ``make test`` builds it again).

The choice is made once, when ``meshbus`` is imported (its ``__init__`` calls
``select`` before anything else): unless the compiled leg is to run, a finder ahead
of the standard ones hands out the source of each module of ``MODULES``, which would
otherwise import as the extension beside it.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from importlib.machinery import ExtensionFileLoader, ModuleSpec
from pathlib import Path
from types import ModuleType

# Read by setup.py as text (a build does not import the package it builds).
MODULES = (
    "meshbus.protocol.codec",
    "meshbus.protocol.nats",
    "meshbus.client.outbound",
    "meshbus.client.message",
    "meshbus.client.mailboxes",
    "meshbus.client.inbound",
    "meshbus.client.link",
    "meshbus.client.reliable",
    "meshbus.client.waiters",
    "meshbus.client.requester",
    # Not on the hot path: StreamMessage subclasses Message, and a class the interpreter
    # runs cannot subclass a compiled one.
    "meshbus.client.streams",
)
# The name of mypyc's shared library of MODULES, a top-level module beside the package.
GROUP = "meshbus__mypyc"

DISABLE = "MESHBUS_NO_EXTENSIONS"
_ROOT = Path(__file__).resolve().parent.parent  # the folder that holds the package


class Leg(enum.Enum):
    """Which build of ``MODULES`` runs, and why."""

    COMPILED = "compiled (mypyc)"
    DISABLED = f"pure Python: {DISABLE}=1"
    MISSING = "pure Python: no compiled extension was built (no C compiler at install?)"
    STALE = (
        "pure Python: a compiled extension is older than its source; "
        "rebuild it with pip install -e . (make test does)"
    )


def source_path(module: str, root: Path = _ROOT) -> Path:
    """The ``.py`` file of ``module``, a module of the package."""
    return root.joinpath(*module.split(".")).with_suffix(".py")


def extension_path(module: str, root: Path = _ROOT) -> Path | None:
    """The compiled extension of ``module`` for this interpreter, if one was built."""
    base = root.joinpath(*module.split("."))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = base.with_name(base.name + suffix)
        if path.is_file():
            return path
    return None


def available(environ: Mapping[str, str] = os.environ, root: Path = _ROOT) -> Leg:
    """The leg a process would run, from its environment and the files under ``root``."""
    if environ.get(DISABLE) == "1":
        return Leg.DISABLED
    if extension_path(GROUP, root) is None:
        return Leg.MISSING
    for module in MODULES:
        extension = extension_path(module, root)
        if extension is None:
            return Leg.MISSING
        if source_path(module, root).stat().st_mtime > extension.stat().st_mtime:
            return Leg.STALE
    return Leg.COMPILED


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds each module of ``MODULES`` as its source, never as its extension."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname not in MODULES:
            return None
        return importlib.util.spec_from_file_location(fullname, source_path(fullname))


_chosen: Leg | None = None


def select() -> Leg:
    """Choose the leg of this process, once (``meshbus`` does on import); the leg chosen."""
    global _chosen
    if _chosen is None:
        _chosen = available()
        if _chosen is not Leg.COMPILED:
            sys.meta_path.insert(0, _SourceFinder())
    return _chosen


def is_compiled(module: ModuleType) -> bool:
    """Whether ``module`` was imported from a compiled extension."""
    return isinstance(module.__spec__.loader if module.__spec__ else None, ExtensionFileLoader)
