"""`bench nats-clients` end to end with a tiny load: nats.py through the broker's NATS
listener and through nats-server, the figures parseable and the ratios those of the
figures."""

from __future__ import annotations

import re

import pytest

from tests.bench.helpers import run_bench

_FIGURES = ("msgs", "rps", "p50_us")


def test_nats_clients_last_line() -> None:
    line = run_bench("nats-clients", "--count", "2000", "--requests", "200", "--runs", "1")
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
