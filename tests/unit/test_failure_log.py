"""FailureLog: a repeating failure logged when it starts, then at most once a period
with how often it happened meanwhile, and once when it stops."""

from __future__ import annotations

import logging

import pytest

from meshbus.util import FailureLog


def test_a_repeating_failure_is_logged_once_a_period_and_its_end_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    failures = FailureLog(
        logging.getLogger("meshbus.test"), "could not store", every=60, clock=lambda: now[0]
    )
    failures.succeeded()  # nothing failed: nothing to say
    with caplog.at_level(logging.WARNING, logger="meshbus.test"):
        for _ in range(100):
            failures.failed("disk is full", stream="ledger")
            now[0] += 0.1
        now[0] += 60
        failures.failed("disk is full", stream="ledger")
        failures.failed("disk is full", stream="ledger")
        failures.succeeded()
        failures.succeeded()
    said = [
        (r.levelname, r.getMessage(), getattr(r, "times_since_last_logged", None))
        for r in caplog.records
    ]
    assert said == [
        ("ERROR", "could not store", None),
        ("ERROR", "could not store", 100),
        ("WARNING", "could not store: works again", 1),
    ]
    assert caplog.records[0].error == "disk is full"  # type: ignore[attr-defined]
    assert caplog.records[0].stream == "ledger"  # type: ignore[attr-defined]
    assert not failures.failing
