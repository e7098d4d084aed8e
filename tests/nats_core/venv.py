"""The virtual environment of the nats-core tests: tests/nats_core/.venv, Python >= 3.13.

nats-core, the NATS project's new Python client, needs Python 3.13 or later; meshbus runs
on 3.11, where only an empty placeholder of it installs. Where an interpreter of 3.13 or
later is found, tests/integration/test_nats_core.py runs nats-core in a venv of its own,
made once from requirements.txt (by ``make nats-core``, or else by the first test that
needs it) and made again when that file changes. Where none is found, those tests skip.

``python -m tests.nats_core.venv`` makes it (the Makefile's nats-core target) or says why
it does not.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
VENV = HERE / ".venv"
_PYTHON = VENV / "bin" / "python"
_REQUIREMENTS = HERE / "requirements.txt"
_INSTALLED = VENV / ".installed"  # newer than requirements.txt: the venv is complete
# pytest's workers may all reach for the venv at once: one makes it, the others wait.
_LOCK = HERE / ".venv.lock"
_PROBE_TIMEOUT = 30.0


def find_python313() -> str | None:
    """A Python >= 3.13 that runs: ``python3.13`` on PATH, else one that pyenv installed
    (pyenv's python3.13 shim on PATH runs only where pyenv selected that version)."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    installed = sorted(pyenv.glob("versions/3.1[3-9]*/bin/python3"), reverse=True)
    for candidate in (shutil.which("python3.13"), *map(str, installed)):
        if candidate is not None and _is_313(candidate):
            return candidate
    return None


def _is_313(python: str) -> bool:
    try:
        done = subprocess.run(
            [python, "-c", "import sys; sys.exit(sys.version_info < (3, 13))"],
            capture_output=True,
            timeout=_PROBE_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def ensure_venv() -> Path | None:
    """The venv's interpreter, the venv made first if it is missing or older than
    requirements.txt; None where no Python >= 3.13 is found."""
    with open(_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _INSTALLED.exists() and _INSTALLED.stat().st_mtime >= _REQUIREMENTS.stat().st_mtime:
            return _PYTHON
        python = find_python313()
        if python is None:
            return None
        shutil.rmtree(VENV, ignore_errors=True)
        subprocess.run([python, "-m", "venv", str(VENV)], check=True)
        pip = [str(_PYTHON), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, "-r", str(_REQUIREMENTS)], check=True)
        _INSTALLED.touch()
        return _PYTHON


if __name__ == "__main__":
    made = ensure_venv()
    if made is None:
        print("no Python >= 3.13 found: the nats-core tests will skip")
    else:
        print(f"nats-core tests: {made}")
