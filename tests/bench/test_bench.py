"""`python -m bench` end to end, with tiny loads: the figures must be real and parseable."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from tests.bench.helpers import BENCH, CHECKOUT, run_bench

COMMANDS = (
    "unicast",
    "spark",
    "request",
    "tables",
    "cross",
    "fanout",
    "failover",
    "join",
    "routes",
    "members",
    "reliable",
    "chaos",
    "bursts",
    "handshake",
    "stream",
    "game",
    "client",
    "nats-clients",
    "consumer",
)


def test_help_lists_every_command() -> None:
    done = subprocess.run(
        [*BENCH, "--help"], capture_output=True, text=True, timeout=60, check=False, cwd=CHECKOUT
    )
    assert done.returncode == 0, done.stderr
    listed = done.stdout.split("Commands:", 1)[1]
    names = {line.split()[0] for line in listed.splitlines() if line.strip()}
    assert names == set(COMMANDS), listed


@pytest.mark.parametrize("destinations", ["1", "3"])
def test_unicast_vs_nats_last_line(destinations: str) -> None:
    line = run_bench(
        "unicast", "--count", "20000", "--runs", "1", "--vs-nats", "--destinations", destinations
    )
    match = re.fullmatch(r"meshbus=(\d+) nats=(\d+) ratio=(\d+\.\d+)", line)
    assert match, line
    meshbus, nats, ratio = int(match[1]), int(match[2]), float(match[3])
    assert meshbus > 0
    assert nats > 0
    assert ratio == pytest.approx(meshbus / nats, rel=0.01)


def test_request_vs_nats_last_line() -> None:
    line = run_bench("request", "--count", "500", "--runs", "1", "--concurrency", "4", "--vs-nats")
    match = re.fullmatch(r"meshbus_p50_us=(\d+\.\d) nats_p50_us=(\d+\.\d) ratio=(\d+\.\d+)", line)
    assert match, line
    meshbus, nats, ratio = float(match[1]), float(match[2]), float(match[3])
    assert 0 < meshbus < 1_000_000
    assert 0 < nats < 1_000_000
    assert ratio == pytest.approx(meshbus / nats, rel=0.02)


def test_meshbus_only_line() -> None:
    assert re.fullmatch(r"meshbus=\d+", run_bench("unicast", "--count", "5000", "--runs", "1"))


def test_bad_argument_exits_2() -> None:
    done = subprocess.run(
        [*BENCH, "unicast", "--count", "0"],
        capture_output=True,
        text=True,
        check=False,
        cwd=CHECKOUT,
    )
    assert done.returncode == 2
    assert "--count" in done.stderr


def test_tables_last_line() -> None:
    line = run_bench("tables", "--services", "100", "--links", "3", "--ops", "2000")
    match = re.fullmatch(r"route_unicast_ns=(\d+) route_multicast_ns=(\d+) pending_ns=(\d+)", line)
    assert match, line
    assert all(int(value) > 0 for value in match.groups())


def test_a_command_starts_without_the_others_imports() -> None:
    """The group imports a command defined elsewhere only when it is asked for."""
    script = (
        "import sys; from bench.cli import bench; "
        "bench(['unicast', '--help'], standalone_mode=False); "
        "print(sorted(m for m in sys.modules if m.startswith(('pyspark', 'bench.'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=CHECKOUT,
    )
    assert done.returncode == 0, done.stderr
    imported = done.stdout.strip().splitlines()[-1]
    assert "pyspark" not in imported, imported
    assert "bench.spark" not in imported, imported
    assert "bench.cli" in imported, imported


def test_the_installed_package_ships_no_bench() -> None:
    """The rig lives in the checkout only: no `meshbus bench` command, no meshbus.bench."""
    done = subprocess.run(
        [sys.executable, "-m", "meshbus", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    listed = done.stdout.split("Commands:", 1)[1].split("\n\n", 1)[0]
    names = {line.split()[0] for line in listed.splitlines() if line.strip()}
    assert "broker" in names
    assert "bench" not in names
    assert importlib.util.find_spec("meshbus.bench") is None
