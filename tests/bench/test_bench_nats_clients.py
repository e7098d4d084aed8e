"""`bench nats-clients` end to end with a tiny load: nats.py (and nats.js) through the
broker's NATS listener and through nats-server, the figures parseable and the ratios those
of the figures."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from bench.nats_clients import nats_clients
from bench.nats_js import NATS_JS_DIR
from tests.bench.helpers import run_bench

_FIGURES = ("msgs", "rps", "p50_us")


@pytest.mark.parametrize("client", ["nats.py", "nats.js"])
def test_nats_clients_last_line(client: str) -> None:
    if client == "nats.js" and (
        shutil.which("node") is None or not (NATS_JS_DIR / "node_modules" / "nats").is_dir()
    ):
        pytest.skip("node or nats.js is not installed (make nats-js installs both)")
    line = run_bench(
        "nats-clients",
        *("--client", client, "--count", "2000", "--requests", "200", "--runs", "1"),
    )
    pairs = dict(pair.split("=") for pair in line.split())
    for name in _FIGURES:
        meshbus, nats = float(pairs[f"meshbus_{name}"]), float(pairs[f"nats_{name}"])
        assert meshbus > 0, line
        assert nats > 0, line
        ratio = float(pairs[f"ratio_{name.removesuffix('_us')}"])
        assert ratio == pytest.approx(meshbus / nats, rel=0.01), line
    assert re.fullmatch(r"[\w=. ]+", line), line


def test_nats_clients_across_three_servers_last_line() -> None:
    """--brokers 3: a mesh of three against a nats-server cluster of three, the two sides
    of each scenario on different servers."""
    line = run_bench(
        "nats-clients", "--brokers", "3", "--count", "2000", "--requests", "200", "--runs", "1"
    )
    pairs = dict(pair.split("=") for pair in line.split())
    for name in _FIGURES:
        assert float(pairs[f"meshbus_{name}"]) > 0, line
        assert float(pairs[f"nats_{name}"]) > 0, line


def test_nats_js_without_node_says_what_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No node on PATH: the command fails before it starts a server, saying to run
    `make nats-js`."""
    monkeypatch.setenv("PATH", str(tmp_path))
    result = CliRunner().invoke(nats_clients, ["--client", "nats.js", "--runs", "1"])
    assert result.exit_code == 1, result.output
    assert "node is not installed: `make nats-js`" in result.output
