"""The event-loop lag record (meshbus.broker.observe.lag): maximum, percentiles, constant memory."""

from __future__ import annotations

import pytest

from meshbus.broker.observe.lag import BOUNDS_MS, LoopLag


def test_no_sample_is_all_zero() -> None:
    assert LoopLag().snapshot() == {"max": 0.0, "max_own": 0.0, "p99": 0.0, "samples": 0}


def test_the_maximum_is_exact_and_percentiles_are_bucket_bounds() -> None:
    lag = LoopLag()
    for _ in range(990):
        lag.record(0.0004, 0.0)  # 0.4 ms: the 1 ms bucket
    for _ in range(9):
        lag.record(0.015, 0.0)  # the 20 ms bucket
    lag.record(0.0731, 0.0)  # one stall: the 100 ms bucket
    assert lag.max_ms == pytest.approx(73.1)
    assert lag.percentile(0.5) == 1.0
    assert lag.percentile(0.99) == 1.0
    assert lag.percentile(0.995) == 20.0
    assert lag.percentile(1.0) == 100.0
    assert lag.snapshot() == {"max": 73.1, "max_own": 0.0, "p99": 1.0, "samples": 1000}


def test_a_lag_past_the_last_bound_reports_the_maximum() -> None:
    lag = LoopLag()
    lag.record(BOUNDS_MS[-1] / 1000 + 3.0, 0.0)
    assert lag.percentile(0.99) == lag.max_ms == pytest.approx(BOUNDS_MS[-1] + 3000)


def test_a_clock_that_wakes_early_records_no_negative_lag() -> None:
    lag = LoopLag()
    lag.record(-0.002, 0.0)
    assert lag.snapshot() == {"max": 0.0, "max_own": 0.0, "p99": 1.0, "samples": 1}


def test_own_lag_is_the_lateness_the_loops_cpu_time_explains() -> None:
    """A wake 60 ms late after 5 ms of work was mostly waiting for a core; one 60 ms late
    after 70 ms of work was the broker's own stall (and counts no more than the lateness)."""
    lag = LoopLag()
    lag.record(0.060, 0.005)
    assert (lag.max_ms, lag.max_own_ms) == (pytest.approx(60.0), pytest.approx(5.0))
    lag.record(0.040, 0.070)
    assert (lag.max_ms, lag.max_own_ms) == (pytest.approx(60.0), pytest.approx(40.0))
