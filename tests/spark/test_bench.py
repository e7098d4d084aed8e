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
        r"read=(\d+) parquet=(\d+) read_ratio=(\d+\.\d{3}) write=(\d+) empty_query_s=(\d+\.\d\d)",
        line,
    )
    assert match, line
    read, parquet, ratio, write = int(match[1]), int(match[2]), float(match[3]), int(match[4])
    assert min(read, parquet, write) > 0
    assert abs(ratio - read / parquet) <= 0.01 * ratio + 0.001
