"""`python -m bench consumer` end to end: a stream of 1 replica and one of 3 on real
brokers, a durable consumer taking and acknowledging every message, a last line that
parses, and no broker left running afterwards (``run_bench``)."""

from __future__ import annotations

import re

from tests.bench.helpers import run_bench

_LAST_LINE = re.compile(
    r"r1=(\d+) r3=(\d+) ratio=(\d+\.\d{3}) r1_round_ms=(\d+\.\d\d) r3_round_ms=(\d+\.\d\d)"
)


def test_consumer_last_line() -> None:
    line = run_bench("consumer", "--count", "300", "--batch", "50", "--runs", "1")
    match = _LAST_LINE.fullmatch(line)
    assert match, line
    r1, r3, ratio, ms1, ms3 = map(float, match.groups())
    assert min(r1, r3, ms1, ms3) > 0
    assert abs(ratio - r3 / r1) <= 0.01 * ratio + 0.001
