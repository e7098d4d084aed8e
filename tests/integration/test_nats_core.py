"""nats-core -- the NATS project's new Python client (PyPI), which needs Python >= 3.13 --
against a broker's NATS listener and, the same checks, against nats-server: wildcards,
queue groups, headers, request/reply, no responders. Each test runs
tests/nats_core/client.py for one check with the interpreter of tests/nats_core/.venv
(made by ``make nats-core``, or here the first time); where no Python >= 3.13 is found,
the tests skip."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.integration import test_nats_listener
from tests.integration.test_nats_listener import Server
from tests.nats_core.venv import HERE, ensure_venv

# The server under test: the broker's NATS listener, or nats-server (one per module).
server = test_nats_listener.server


@pytest.fixture(scope="module")
def core_python() -> Path:
    python = ensure_venv()
    if python is None:
        pytest.skip(
            "no Python >= 3.13 found (python3.13 on PATH, or installed by pyenv): "
            "nats-core needs it"
        )
    return python


@pytest.mark.parametrize("check", ["wildcards", "queues", "headers", "requests", "no_responders"])
def test_nats_core(core_python: Path, server: Server, check: str) -> None:
    done = subprocess.run(
        [str(core_python), str(HERE / "client.py"), check, server.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == f"ok {check}"
