"""examples/spark_job.py's job on the suite's SparkSession and a real broker: what it
writes through Spark is stored once per row and read back into the right totals."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from tests.conftest import BrokerProcess
from tests.spark.conftest import in_thread

pytestmark = [pytest.mark.spark, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "spark_job.py"


async def test_the_example_job_totals_what_it_wrote(
    spark: SparkSession, broker: BrokerProcess
) -> None:
    spec = importlib.util.spec_from_file_location("spark_job", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    await job.create_stream(broker.address)
    totals = await in_thread(lambda: job.leaderboard(spark, broker.address))
    expected = {player: sum(range(i, 100, 4)) for i, player in enumerate(job.PLAYERS)}
    assert totals == expected
