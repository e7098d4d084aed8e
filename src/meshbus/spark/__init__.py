"""meshbus for PySpark: the ``meshbus`` Python data source (docs/spark.md).

    import meshbus.spark

    meshbus.spark.register(spark)
    rows = (
        spark.readStream.format("meshbus")
        .option("brokers", "127.0.0.1:7400")
        .option("stream", "results")
        .load()
    )

Needs the ``spark`` extra (``pip install 'meshbus[spark]'``: pyspark 4.2+ and
pyarrow). Spark's Python workers must be able to import meshbus: point
``PYSPARK_PYTHON`` at the interpreter meshbus is installed in (``register`` checks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshbus.spark.reader import SCHEMA
from meshbus.spark.source import MeshbusDataSource
from meshbus.spark.workers import check_workers

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["SCHEMA", "MeshbusDataSource", "register"]


def register(spark: SparkSession) -> None:
    """Make ``format("meshbus")`` available to ``spark``'s readers and writers.

    First runs a one-row task to check that Spark's Python workers can import meshbus
    (``SparkSetupError`` if not, naming ``PYSPARK_PYTHON`` and what to set it to):
    without it, the first query would fail with a long trace instead."""
    check_workers(spark)
    spark.dataSource.register(MeshbusDataSource)
