"""`make docs`: the API reference builds from the docstrings with no pdoc warning and no
public name undocumented, and its check finds a name that is."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pdoc.doc

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "api_reference.py"


def _builder() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("api_reference", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_builds_clean_and_covers_the_public_surface(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    page = (tmp_path / "meshbus.html").read_text()
    for name in ("Service.send_nowait", "Message.headers", "Connector.publish", "InvalidPayload"):
        assert f'id="{name}"' in page, name
    assert (tmp_path / "index.html").exists()


def test_the_check_names_what_has_no_docs() -> None:
    module = types.ModuleType("sample", "A module.")
    exec(
        '''
class Documented:
    """Has ``size``."""
    size = 1
    def method(self) -> None:
        """Does it."""

class Bare:
    """A class with an undocumented method and attribute."""
    colour = "red"
    def method(self) -> None:
        pass

def function() -> None:
    pass

__all__ = ["Documented", "Bare", "function"]
''',
        module.__dict__,
    )
    sys.modules["sample"] = module
    try:
        missing = _builder().undocumented(pdoc.doc.Module(module))
    finally:
        del sys.modules["sample"]
    assert missing == ["sample.Bare.colour", "sample.Bare.method", "sample.function"]
