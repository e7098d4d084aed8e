"""`meshbus bench spark` end to end with a tiny load: a last line that parses and adds up."""

from __future__ import annotations

import re

import pytest

from tests.integration.bench_helpers import run_bench

pytestmark = [pytest.mark.slow, pytest.mark.spark]


@pytest.mark.timeout(240)
def test_spark_bench_last_line() -> None:
    line = run_bench("spark", "--rows", "2000", "--runs", "1")
    match = re.fullmatch(
        r"read=(\d+) read_bus=(\d+) parquet=(\d+) read_ratio=(\d+\.\d{3}) "
        r"ceiling=(\d+) ceiling_ratio=(\d+\.\d{3}) write=(\d+) empty_query_s=(\d+\.\d\d)",
        line,
    )
    assert match, line
    read, bus, parquet = int(match[1]), int(match[2]), int(match[3])
    ratio, ceiling, ceiling_ratio, write = (
        float(match[4]),
        int(match[5]),
        float(match[6]),
        int(match[7]),
    )
    assert min(read, bus, parquet, ceiling, write) > 0
    assert abs(ratio - read / parquet) <= 0.01 * ratio + 0.001
    assert abs(ceiling_ratio - ceiling / parquet) <= 0.01 * ceiling_ratio + 0.001
