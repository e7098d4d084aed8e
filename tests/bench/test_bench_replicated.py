"""`python -m bench stream --replicas 3` end to end, tiny: real meshes of three brokers, a
real 3-node JetStream cluster (skipped without nats-server), last lines that parse and add
up, failovers that lose nothing, and no server left running (``run_bench``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.cli import bench
from bench.jetstream import jetstream_cluster, nats_server_version
from bench.replicated import nats_failover
from bench.servers import NATS_SERVER_ENV, BenchSetupError, find_nats_server
from tests.bench.helpers import run_bench


def _no_nats_server() -> bool:
    try:
        find_nats_server()
    except BenchSetupError:
        return True
    return False


needs_nats = pytest.mark.skipif(_no_nats_server(), reason="nats-server is not installed")

_FIGURES = r"(\d+) {row}_meshbus_p50_ms=(\d+\.\d\d) {row}_meshbus_p99_ms=(\d+\.\d\d)"
_NATS = r" {row}_nats=(\d+) {row}_nats_p50_ms=(\d+\.\d\d) {row}_nats_p99_ms=(\d+\.\d\d)"
_RATIOS = r" {row}_ratio=(\d+\.\d{{3}}) {row}_p99_ratio=(\d+\.\d{{3}})"


def _row(line: str, row: str) -> list[float]:
    """The figures of one durability row: meshbus's three, then nats's three and the two
    ratios when nats-server ran it (none of them when it could not: `<row>_nats=none`)."""
    meshbus = _FIGURES.format(row=row)
    for shape in (meshbus + (_NATS + _RATIOS).format(row=row), f"{meshbus} {row}_nats=none"):
        match = re.search(rf"(?:^| ){row}_meshbus={shape}(?: |$)", line)
        if match:
            return [float(group) for group in match.groups()]
    raise AssertionError(f"no {row} row in {line!r}")


@needs_nats
def test_replicated_appends_against_jetstream() -> None:
    line = run_bench("stream", "--replicas", "3", "--vs-nats", "--count", "1000", "--runs", "1")
    default = _row(line, "default")
    assert len(default) == 8, "nats-server runs the default row on any version"
    per_s, p50, p99, nats_per_s, nats_p50, nats_p99, ratio, p99_ratio = default
    assert min(default) > 0
    assert p50 <= p99
    assert nats_p50 <= nats_p99
    # The ratios are of the printed medians (appends/s rounded to whole ones: within 1%).
    assert abs(ratio - per_s / nats_per_s) <= 0.01 * ratio + 0.001
    assert abs(p99_ratio - p99 / nats_p99) <= 0.01 * p99_ratio + 0.001
    always = _row(line, "always")
    assert min(always) > 0
    assert len(always) in (3, 8)


def test_failover_loses_nothing() -> None:
    # --raft-tick 0.04: elections after 0.4-0.8 s of silence, so the test stays short.
    line = run_bench(
        "stream", "--replicas", "3", "--failover", "--runs", "1", "--raft-tick", "0.04"
    )
    match = re.fullmatch(
        r"failover_s=(\d+\.\d{3}) elected_s=(\d+\.\d{3}) acked=(\d+) lost=(\d+) duplicated=(\d+)",
        line,
    )
    assert match, line
    failover_s, elected_s, acked, lost, duplicated = map(float, match.groups())
    assert elected_s > 0
    assert failover_s > 0
    assert acked > 0
    assert (lost, duplicated) == (0, 0)


@needs_nats
async def test_jetstream_failover_loses_nothing() -> None:
    # JetStream's own election takes 4-9 s: its side alone, in process.
    with jetstream_cluster(3, sync_always=False) as cluster:
        got = await nats_failover(cluster, window=64, resend_max=2.0, before=0.5, after=0.2)
    assert got.elected_s > 0
    assert got.resumed_s > 0
    assert got.acked > 0
    assert got.stored >= got.acked
    assert (got.lost, got.duplicated) == (0, 0)


def test_failover_needs_three_replicas() -> None:
    from click.testing import CliRunner

    result = CliRunner().invoke(bench, ["stream", "--failover"])
    assert result.exit_code == 2
    assert "--failover needs --replicas 3" in result.output


def test_the_nats_server_measured_may_be_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MESHBUS_BENCH_NATS_SERVER picks the binary (a newer release than the one on PATH,
    for the `always` row); one that cannot be run is refused, never skipped silently."""
    binary = tmp_path / "nats-server"
    binary.write_text("#!/bin/sh\necho 'nats-server: v9.9.9'\n")
    monkeypatch.setenv(NATS_SERVER_ENV, str(binary))
    with pytest.raises(BenchSetupError, match="not an executable"):
        find_nats_server()
    binary.chmod(0o755)
    assert find_nats_server() == str(binary)
    assert nats_server_version() == "nats-server: v9.9.9"
