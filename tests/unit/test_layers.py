"""The layers of docs/architecture.md are contracts ([tool.importlinter] in
pyproject.toml) that ``make test`` checks on the tree with lint-imports. Here each
contract is shown to break when one forbidden import is added to a copy of the tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

# (contract id, the module that gets the import, the module it must not import)
FORBIDDEN = [
    ("protocol", "protocol/codec.py", "meshbus.address"),
    ("raft", "raft/core.py", "meshbus.protocol.codec"),
    ("raft", "raft/log.py", "meshbus.storage.store"),
    ("storage", "storage/sqlite.py", "meshbus.broker.core.link"),
    ("client", "client/connector.py", "meshbus.broker.config"),
    ("broker-layers", "broker/core/forward.py", "meshbus.broker.mesh.relay"),
    ("broker-layers", "broker/mesh/sync.py", "meshbus.broker.handlers.guarantees"),
    ("broker-layers", "broker/handlers/guarantees.py", "meshbus.broker.observe.lag"),
    ("broker-layers", "broker/core/subjects.py", "meshbus.broker.nats.router"),
    ("security-tables", "broker/security/permissions.py", "meshbus.broker.core.link"),
    ("core-security", "broker/core/registry.py", "meshbus.broker.security.signin"),
    ("on-the-client", "spark/reader.py", "meshbus.broker.core.routing"),
    ("on-the-client", "cli/stream.py", "meshbus.broker.streams"),
]


def lint_imports(tree: Path, contract: str) -> subprocess.CompletedProcess[str]:
    """lint-imports on the package under ``tree``, with this checkout's contracts."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--contract", contract, str(CHECKOUT / "pyproject.toml")],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def copy_of_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("src")
    shutil.copytree(CHECKOUT / "src" / "meshbus", tree / "meshbus")
    return tree


@pytest.mark.parametrize(("contract", "module", "forbidden"), FORBIDDEN)
def test_a_forbidden_import_breaks_its_contract(
    copy_of_src: Path, contract: str, module: str, forbidden: str
) -> None:
    path = copy_of_src / "meshbus" / module
    kept = path.read_text()
    try:
        path.write_text(kept + f"\nimport {forbidden}  # noqa\n")
        result = lint_imports(copy_of_src, contract)
        assert result.returncode == 1, result.stdout + result.stderr
        assert "BROKEN" in result.stdout
        assert forbidden in result.stdout
    finally:
        path.write_text(kept)
