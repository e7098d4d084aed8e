"""The mesh-operation benchmarks end to end, with tiny meshes: real broker processes,
figures that parse and make sense, and no broker left running afterwards.

Plain ``def`` tests: each command runs its own uvloop event loop (``uvloop.run``), which
cannot start inside a running one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable

import click
import pytest
from click.testing import CliRunner

from bench.bursts import bursts
from bench.members import members
from bench.membership import failover, join
from bench.routes import routes
from tests.bench.helpers import last_line, run_bench

Run = Callable[..., str]  # (command, *args) -> its last line


def in_subprocess(command: click.Command, *args: str) -> str:
    """``command`` as `python -m bench NAME ARGS`."""
    assert command.name is not None
    return run_bench(command.name, *args)


# Each command in process (warnings are errors there) and as `python -m bench NAME`.
both_ways = pytest.mark.parametrize("run", [last_line, in_subprocess], ids=["cli", "subprocess"])


@both_ways
def test_failover_last_line(run: Run) -> None:
    line = run(failover, "--runs", "1", "--connectors", "6", "--services-per-connector", "3")
    match = re.fullmatch(r"failover_ms_median=(\d+\.\d) failover_ms_max=(\d+\.\d)", line)
    assert match, line
    median, most = float(match[1]), float(match[2])
    assert 0 < median <= most < 30_000


@both_ways
def test_join_last_line(run: Run) -> None:
    line = run(join, "--runs", "1", "--connectors", "6", "--services-per-connector", "2")
    match = re.fullmatch(r"join_ms_median=(\d+\.\d) spread=(\d+)", line)
    assert match, line
    assert 0 < float(match[1]) < 60_000
    assert int(match[2]) <= 1


@both_ways
def test_routes_last_line(run: Run) -> None:
    line = run(routes, "--services", "600", "--connectors-per-broker", "2", "--changes", "2")
    match = re.fullmatch(
        r"join_table_ms=(\d+\.\d) change_ms=(\d+\.\d\d) register_per_s=(\d+) "
        r"bytes_per_route=(-?\d+) max_lag_ms=(\d+\.\d)",
        line,
    )
    assert match, line
    join_table_ms, change_ms, per_s = float(match[1]), float(match[2]), int(match[3])
    assert 0 < join_table_ms < 30_000
    assert 0 <= change_ms < 5_000
    assert per_s > 0
    # 600 routes move a broker's RSS by a page or two, either way: only the form is sure.
    assert abs(int(match[4])) < 100_000
    assert 0 < float(match[5]) < 30_000


def test_routes_without_the_rebalance() -> None:
    line = last_line(
        routes,
        "--services",
        "300",
        "--connectors-per-broker",
        "1",
        "--changes",
        "1",
        "--no-rebalance",
    )
    assert line.startswith("join_table_ms="), line


@both_ways
def test_members_last_line(run: Run) -> None:
    line = run(members, "--members", "600", "--connectors-per-broker", "2", "--messages", "2")
    match = re.fullmatch(
        r"join_s=(\d+\.\d\d) deliver_ms=(\d+\.\d) max_lag_ms=(\d+\.\d) "
        r"bytes_per_route=(-?\d+) bytes_per_membership=(-?\d+)",
        line,
    )
    assert match, line
    assert 0 < float(match[1]) < 60
    assert 0 < float(match[2]) < 30_000
    assert 0 < float(match[3]) < 30_000
    assert abs(int(match[4])) < 100_000
    assert abs(int(match[5])) < 100_000


def test_members_refuses_more_services_per_connector_than_a_broker_takes() -> None:
    result = CliRunner().invoke(members, ["--members", "100000", "--connectors-per-broker", "3"])
    assert result.exit_code == 2
    assert "--connectors-per-broker" in result.output


def test_bad_argument_exits_2() -> None:
    result = CliRunner().invoke(failover, ["--connectors", "1"])
    assert result.exit_code == 2
    assert "--connectors" in result.output


def test_bursts_reports_the_loop_lag_of_both_brokers() -> None:
    line = last_line(bursts, "--count", "500")
    fields = dict(item.split("=") for item in line.split())
    assert list(fields) == [
        "entry_max_lag_ms",
        "peer_max_lag_ms",
        "entry_p99_ms",
        "suspicions",
        "entry_own_ms",
        "peer_own_ms",
    ]
    # A broker's own share of its lag is part of the lag, and a burst takes some.
    assert 0 < float(fields["entry_own_ms"]) <= float(fields["entry_max_lag_ms"]), line
    assert 0 <= float(fields["peer_own_ms"]) <= float(fields["peer_max_lag_ms"]), line
    assert fields["suspicions"] == "0"
    # A p99 of at least the first bucket's bound: the probe took samples through the burst.
    assert float(fields["entry_p99_ms"]) >= 1, line


def test_bursts_can_give_one_broker_a_core_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """--own-core pins that broker to the last core and every other process (the other
    brokers, the load generator) to the rest, then gives the load generator its cores
    back; the last line adds that broker's lag."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    placed: list[tuple[int, set[int]]] = []
    pin = os.sched_setaffinity

    def recording(pid: int, mask: Iterable[int]) -> None:
        placed.append((pid, set(mask)))
        pin(pid, mask)

    monkeypatch.setattr(os, "sched_setaffinity", recording)
    line = last_line(bursts, "--count", "300", "--own-core", "joining")
    fields = dict(item.split("=") for item in line.split())
    assert float(fields["alone_max_lag_ms"]) >= 0, line
    alone = [pid for pid, mask in placed if mask == {cores[-1]}]
    rest = {pid for pid, mask in placed if mask == set(cores[:-1])}
    assert len(alone) == 1, placed
    assert alone[0] not in rest, placed
    assert len(rest) == 3, placed  # the two other brokers, and the load generator (pid 0)
    assert 0 in rest, placed
    assert os.sched_getaffinity(0) == set(cores)
