"""``meshbus report``'s errors: each fails before Spark starts, with a message that says
what to do, and exit 1 (or 2 for bad arguments)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import meshbus
from meshbus.report.cli import report
from tests.conftest import BrokerProcess

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def invoke(*args: str) -> Result:
    return CliRunner().invoke(report, list(args), prog_name="meshbus report")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_no_broker_reachable(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    brokers = f"127.0.0.1:{closed_port()},127.0.0.1:{closed_port()}"
    result = invoke("--brokers", brokers, "--out", str(out))
    assert result.exit_code == 1, result.output
    assert "Error: could not connect to broker 127.0.0.1:" in result.stderr
    assert "is a broker running there?" in result.stderr
    assert not out.exists()


async def test_no_telemetry_streams(broker: BrokerProcess, tmp_path: Path) -> None:
    async with await meshbus.connect(broker.address, server="pub") as conn:
        await conn.streams.add("orders", "multicast:orders")  # not telemetry
    out = str(tmp_path / "report.html")
    result = await asyncio.to_thread(invoke, "--brokers", broker.address, "--out", out)
    assert result.exit_code == 1, result.output
    assert "no telemetry streams" in result.stderr
    assert "--telemetry-interval" in result.stderr
    assert "✓" not in result.stderr  # the step failed: no "found 0 telemetry streams"


async def test_empty_telemetry_streams(broker: BrokerProcess, tmp_path: Path) -> None:
    async with await meshbus.connect(broker.address, server="pub") as conn:
        await conn.streams.add(f"telemetry.{broker.name}", "multicast:tm")
    out = str(tmp_path / "report.html")
    result = await asyncio.to_thread(invoke, "--brokers", broker.address, "--out", out)
    assert result.exit_code == 1, result.output
    assert "the telemetry streams hold no records" in result.stderr
    assert "✓" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--out", "/nonexistent-dir/report.html"], "directory /nonexistent-dir does not exist"),
        (["--out", "."], "is a directory"),
        (["--out", "r.html", "--since", "0"], "--since"),
        (["--out", "r.html", "--brokers", "nohost:x"], "--brokers"),
        ([], "Missing option '--out'"),
    ],
)
def test_bad_arguments(args: list[str], message: str) -> None:
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr


def test_help_says_how_to_enable_telemetry() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    assert "meshbus broker --telemetry-interval" in result.output
    assert "--since SECONDS" in result.output


def test_the_command_imports_no_spark() -> None:
    """``meshbus`` registers ``report``: its other commands must work without the extra."""
    code = (
        "import sys, meshbus.report.cli; "
        "print(sorted({'pyspark', 'pyarrow', 'matplotlib'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
