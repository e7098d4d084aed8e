"""The choice of the compiled or the pure-Python hot path (meshbus.compiled).

``make test`` runs the codec's, the NATS parser's and the client's tests on both legs:
the whole suite on the compiled one, built by the install, and these folders again with
``MESHBUS_NO_EXTENSIONS=1``. These tests make sure each run is on the leg it claims:
one that silently ran the source where the extension was built would test one leg twice.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import meshbus
from meshbus.compiled import (
    DISABLE,
    GROUP,
    MODULES,
    Leg,
    available,
    extension_path,
    is_compiled,
    select,
)

_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
_PACKAGE = Path(meshbus.__file__).parent


def _has_c_compiler() -> bool:
    compiler = sysconfig.get_config_var("CC") or "cc"
    return shutil.which(shlex.split(compiler)[0]) is not None


def test_each_hot_module_runs_on_the_leg_chosen() -> None:
    leg = select()
    for name in MODULES:
        module = importlib.import_module(name)
        assert is_compiled(module) == (leg is Leg.COMPILED), f"{name} on the {leg.name} leg"


@pytest.mark.skipif(os.environ.get(DISABLE) == "1", reason="the pure-Python leg, on purpose")
@pytest.mark.skipif(not _has_c_compiler(), reason="no C compiler: the extension cannot be built")
def test_where_a_compiler_is_the_compiled_leg_runs() -> None:
    """The install builds the extension wherever there is a compiler; if it did not (or
    the source changed since), the tests would run the pure-Python leg alone."""
    assert select() is Leg.COMPILED, f"{select().value}: build it with `pip install -e .`"


def test_nothing_else_of_the_package_is_compiled() -> None:
    """An extension left from a build that compiled more would import in place of its
    source, with no selector to turn it off."""
    built = {
        ".".join(path.relative_to(_PACKAGE.parent).parts).removesuffix(_SUFFIX)
        for path in _PACKAGE.rglob("*" + _SUFFIX)
    }
    assert built <= set(MODULES)


def test_no_class_the_interpreter_runs_subclasses_a_compiled_one() -> None:
    """Compiled, such a class is defined but cannot be instantiated (``TypeError:
    interpreted classes cannot inherit from compiled``): its module must be compiled too."""
    importlib.import_module("meshbus.client.connector")  # every module of the client
    subclassed = {
        f"{sub.__module__}.{sub.__qualname__} < {cls.__qualname__}"
        for name in MODULES
        for cls in vars(importlib.import_module(name)).values()
        if isinstance(cls, type) and cls.__module__ == name
        for sub in cls.__subclasses__()
        if sub.__module__.startswith("meshbus.") and sub.__module__ not in MODULES
    }
    assert not subclassed


def test_the_variable_runs_the_source() -> None:
    """In a fresh interpreter, as ``make test`` runs the pure-Python leg."""
    probe = (
        "import meshbus.compiled as c, meshbus.protocol.codec as codec, "
        "meshbus.client.inbound as inbound; "
        "print(c.select().name, c.is_compiled(codec), c.is_compiled(inbound))"
    )
    env = {**os.environ, DISABLE: "1"}
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["DISABLED", "False", "False"]


# -- available(): the decision, on a tree of files made here ----------------------------


def _tree(root: Path, *, extensions: bool = True, group: bool = True) -> None:
    """Each module's source under ``root``, with its extension (built after it)."""
    for name in MODULES:
        source = root.joinpath(*name.split(".")).with_suffix(".py")
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text("")
        os.utime(source, (1_000, 1_000))
        if extensions:
            root.joinpath(*name.split(".")).with_name(source.stem + _SUFFIX).write_bytes(b"")
    if group:
        (root / (GROUP + _SUFFIX)).write_bytes(b"")


def test_every_extension_built_after_its_source_is_the_compiled_leg(tmp_path: Path) -> None:
    _tree(tmp_path)
    assert available({}, tmp_path) is Leg.COMPILED


def test_the_variable_chooses_the_source_whatever_was_built(tmp_path: Path) -> None:
    _tree(tmp_path)
    assert available({DISABLE: "1"}, tmp_path) is Leg.DISABLED
    assert available({DISABLE: "0"}, tmp_path) is Leg.COMPILED


def test_no_extension_is_the_source(tmp_path: Path) -> None:
    _tree(tmp_path, extensions=False, group=False)
    assert available({}, tmp_path) is Leg.MISSING


def test_one_extension_missing_is_the_source(tmp_path: Path) -> None:
    """All or none: the compiled modules call each other directly."""
    _tree(tmp_path)
    missing = extension_path(MODULES[-1], tmp_path)
    assert missing is not None
    missing.unlink()
    assert available({}, tmp_path) is Leg.MISSING


def test_the_shared_library_missing_is_the_source(tmp_path: Path) -> None:
    """The modules' extensions import it: without it, they would fail to import."""
    _tree(tmp_path, group=False)
    assert available({}, tmp_path) is Leg.MISSING


def test_a_source_edited_after_the_build_is_the_source(tmp_path: Path) -> None:
    _tree(tmp_path)
    os.utime(tmp_path.joinpath(*MODULES[0].split(".")).with_suffix(".py"))
    assert available({}, tmp_path) is Leg.STALE
