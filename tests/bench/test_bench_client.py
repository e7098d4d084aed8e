"""`bench client` end to end with a tiny load: both systems measured, the figures parseable,
the ratios those of the figures, and no worker process left behind."""

from __future__ import annotations

import re

import pytest

from tests.bench.helpers import run_bench

_FIGURES = ("msgs", "fast_msgs", "rps", "p50_us")


def test_client_vs_nats_last_line() -> None:
    line = run_bench("client", "--count", "2000", "--requests", "200", "--runs", "1", "--vs-nats")
    pairs = dict(pair.split("=") for pair in line.split())
    for name in _FIGURES:
        meshbus, nats = float(pairs[f"meshbus_{name}"]), float(pairs[f"nats_{name}"])
        assert meshbus > 0, line
        assert nats > 0, line
        ratio = float(pairs[f"ratio_{name.removesuffix('_us')}"])
        assert ratio == pytest.approx(meshbus / nats, rel=0.01), line
    assert re.fullmatch(r"[\w=. ]+", line), line
