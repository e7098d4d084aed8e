"""`cross` and `fanout` end to end with tiny loads: real broker meshes and nats-server
clusters, started and stopped by the commands; the figures must be real and parseable.
The --vs-nats runs go through ``python -m bench``, the others run in process."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from bench.traffic import cross, fanout
from tests.bench.helpers import last_line, run_bench


def test_cross_vs_nats_last_line() -> None:
    line = run_bench("cross", "--count", "20000", "--runs", "1", "--vs-nats")
    match = re.fullmatch(r"meshbus=(\d+) nats=(\d+) ratio=(\d+\.\d{3})", line)
    assert match, line
    meshbus, nats, ratio = int(match[1]), int(match[2]), float(match[3])
    assert meshbus > 0
    assert nats > 0
    assert ratio == pytest.approx(meshbus / nats, rel=0.01)


def test_cross_meshbus_only_line() -> None:
    line = last_line(cross, "--count", "5000", "--runs", "2", "--size", "100")
    match = re.fullmatch(r"meshbus=(\d+)", line)
    assert match, line
    assert int(match[1]) > 0


def test_fanout_vs_nats_last_line() -> None:
    line = run_bench(
        "fanout",
        *("--subscribers", "60", "--links-per-broker", "2", "--count", "1000"),
        *("--runs", "1", "--vs-nats"),
    )
    match = re.fullmatch(
        r"meshbus_deliveries=(\d+) nats_deliveries=(\d+) ratio=(\d+\.\d{3}) "
        r"peer_copies_per_msg=(\d+\.\d{3})",
        line,
    )
    assert match, line
    meshbus, nats, ratio = int(match[1]), int(match[2]), float(match[3])
    assert meshbus > 0
    assert nats > 0
    assert ratio == pytest.approx(meshbus / nats, rel=0.01)
    assert match[4] == "1.000"


def test_fanout_meshbus_only_line() -> None:
    # Uneven shares (7 subscribers on 6 links), two runs on the same mesh.
    line = last_line(
        fanout,
        *("--subscribers", "7", "--links-per-broker", "2", "--count", "3000", "--runs", "2"),
    )
    match = re.fullmatch(r"meshbus_deliveries=(\d+) peer_copies_per_msg=(\d+\.\d{3})", line)
    assert match, line
    assert int(match[1]) > 0
    assert match[2] == "1.000"


def test_fanout_needs_a_subscriber_per_link() -> None:
    result = CliRunner().invoke(fanout, ["--subscribers", "5", "--links-per-broker", "2"])
    assert result.exit_code == 2
    assert "--subscribers" in result.output
