"""`python -m bench spark` end to end with a tiny load: a last line that parses and adds up."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.bench.helpers import CHECKOUT, run_bench

pytestmark = [pytest.mark.slow, pytest.mark.spark]

# The group imported by a process that has the checkout on its sys.path but neither runs
# in it nor has it on PYTHONPATH (a notebook, a test runner started elsewhere): Spark's
# Python workers, which import bench.spark by name, get it from the bench itself.
IMPORTED = [
    sys.executable,
    "-c",
    f"import sys; sys.path.insert(0, {str(CHECKOUT)!r}); from bench.cli import bench; bench()",
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("elsewhere", [False, True], ids=["python -m bench", "imported"])
def test_spark_bench_last_line(elsewhere: bool, tmp_path: Path) -> None:
    args = ("spark", "--rows", "2000", "--runs", "1")
    line = run_bench(*args, command=IMPORTED, cwd=tmp_path) if elsewhere else run_bench(*args)
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
