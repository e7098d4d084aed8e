"""`python -m bench spark` end to end with a tiny load: a last line that parses and adds up."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.helpers import BENCH, CHECKOUT, run_bench

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.xdist_group("jvm")]

# The group imported by a process that has the checkout on its sys.path but neither runs
# in it nor has it on PYTHONPATH (a notebook, a test runner started elsewhere): Spark's
# Python workers, which import bench.spark by name, get it from the bench itself.
IMPORTED = [
    sys.executable,
    "-c",
    f"import sys; sys.path.insert(0, {str(CHECKOUT)!r}); from bench.cli import bench; bench()",
]
LAST_LINE = (
    r"read=(\d+) read_bus=(\d+) parquet=(\d+) read_ratio=(\d+\.\d{3}) "
    r"ceiling=(\d+) ceiling_ratio=(\d+\.\d{3}) write=(\d+) empty_query_s=(\d+\.\d\d)"
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("elsewhere", [False, True], ids=["python -m bench", "imported"])
def test_spark_bench_last_line(elsewhere: bool, tmp_path: Path) -> None:
    """The benchmark itself runs once (a minute on two cores: a JVM and eight queries),
    imported elsewhere, the stricter of the two ways in: Spark's Python workers find
    bench.spark only because the bench puts the checkout on their PYTHONPATH (run in the
    checkout they would find it anyway, as their working directory). ``python -m bench``
    in the checkout -- bench/__main__.py, which does exactly what IMPORTED does, and
    which every other bench test runs -- is checked to reach the same command, with the
    options and the last line used here."""
    args = ("spark", "--rows", "2000", "--runs", "1")
    if not elsewhere:
        done = subprocess.run(
            [*BENCH, *args, "--help"],
            capture_output=True, text=True, timeout=60, check=False, cwd=CHECKOUT,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("Usage: python -m bench spark [OPTIONS]"), done.stdout
        for option in ("--rows", "--runs"):
            assert option in done.stdout, done.stdout
        documented = " ".join(done.stdout.split())
        for key in re.findall(r"(\w+)=\(", LAST_LINE):
            assert f"{key}=<" in documented, (key, documented)
        return
    # A JVM and eight queries: about a minute on two idle cores, over two beside a
    # test suite's other JVMs.
    line = run_bench(*args, command=IMPORTED, cwd=tmp_path, timeout=240)
    match = re.fullmatch(LAST_LINE, line)
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
