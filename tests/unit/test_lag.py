"""The event-loop lag record (meshbus.broker.lag): maximum, percentiles, constant memory."""

from __future__ import annotations

import pytest

from meshbus.broker.lag import BOUNDS_MS, LoopLag


def test_no_sample_is_all_zero() -> None:
    assert LoopLag().snapshot() == {"max": 0.0, "p99": 0.0, "samples": 0}


def test_the_maximum_is_exact_and_percentiles_are_bucket_bounds() -> None:
    lag = LoopLag()
    for _ in range(990):
        lag.record(0.0004)  # 0.4 ms: the 1 ms bucket
    for _ in range(9):
        lag.record(0.015)  # the 20 ms bucket
    lag.record(0.0731)  # one stall: the 100 ms bucket
    assert lag.max_ms == pytest.approx(73.1)
    assert lag.percentile(0.5) == 1.0
    assert lag.percentile(0.99) == 1.0
    assert lag.percentile(0.995) == 20.0
    assert lag.percentile(1.0) == 100.0
    assert lag.snapshot() == {"max": 73.1, "p99": 1.0, "samples": 1000}


def test_a_lag_past_the_last_bound_reports_the_maximum() -> None:
    lag = LoopLag()
    lag.record(BOUNDS_MS[-1] / 1000 + 3.0)
    assert lag.percentile(0.99) == lag.max_ms == pytest.approx(BOUNDS_MS[-1] + 3000)


def test_a_clock_that_wakes_early_records_no_negative_lag() -> None:
    lag = LoopLag()
    lag.record(-0.002)
    assert lag.snapshot() == {"max": 0.0, "p99": 1.0, "samples": 1}
