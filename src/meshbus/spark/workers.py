"""``register()``'s check that Spark's Python workers can run the data source.

Spark runs the data source's code in Python worker processes that it starts with the
interpreter ``PYSPARK_PYTHON`` named when the SparkContext started (``python3`` from
``PATH`` if unset): on the driver's machine to plan a query, on every executor's to
run its tasks. A worker without meshbus fails the first read or write with a long
Java trace that ends in ``ModuleNotFoundError: No module named 'meshbus'``.

Only the workers know what they can import -- on a cluster they run on other
machines, with their own ``PATH`` and packages -- so the check asks them: one task,
one row, that imports ``meshbus.spark`` and says which interpreter it ran in. It
costs one Python worker start, which the first query would pay anyway, and reaches
one executor: a cluster whose executors are set up differently from each other can
still fail later.
"""

from __future__ import annotations

import os
import re
import sys
from typing import TYPE_CHECKING

from meshbus.errors import SparkSetupError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# The line of a failed job's message that says why its last task attempt failed.
_TASK_FAILURE = re.compile(r"most recent failure: Lost task .*?\): (.+)")


def check_workers(spark: SparkSession) -> None:
    """Raise ``SparkSetupError`` unless ``spark``'s Python workers import meshbus.spark."""
    from pyspark.sql.functions import udf

    def probe() -> tuple[str, str | None]:
        # Defined in here, so that cloudpickle ships this code itself: a module-level
        # function travels as a reference to its meshbus module, and a worker without
        # meshbus would fail to unpickle it instead of saying what it cannot import.
        import sys

        try:
            import meshbus.spark  # noqa: F401
        except ImportError as exc:
            return sys.executable, f"{type(exc).__name__}: {exc}"
        return sys.executable, None

    # useArrow=False: an Arrow UDF would also need pandas, which the data source does not.
    probe_udf = udf(probe, "struct<executable: string, error: string>", useArrow=False)
    try:
        row = spark.range(0, 1, 1, numPartitions=1).select(probe_udf().alias("probe")).first()
    except Exception as exc:
        found = _TASK_FAILURE.search(str(exc))
        why = f": {found.group(1).strip()}" if found else ""
        raise SparkSetupError(
            f"Spark's Python workers did not run a task{why} (Spark's error is chained "
            f"to this one). {_advice(spark)}"
        ) from exc
    assert row is not None  # one partition, one row
    executable, error = row.probe.executable, row.probe.error
    if error is not None:
        raise SparkSetupError(
            f"Spark's Python workers cannot import meshbus.spark ({error}): "
            f"they run {executable}. {_advice(spark)}"
        )


def _advice(spark: SparkSession) -> str:
    python = f"Python {sys.version_info.major}.{sys.version_info.minor}"
    advice = (
        f"Before the SparkSession starts, set PYSPARK_PYTHON to a {python} that has "
        "meshbus[spark] installed, at the same path on every executor -- such as this "
        f"driver's {sys.executable} -- or, with spark-submit, --conf spark.pyspark.python=PATH"
    )
    conf = spark.conf.get("spark.pyspark.python", None)
    # spark-submit hands the conf to the driver as PYSPARK_PYTHON; set on a session
    # built in Python, it reaches nothing -- a trap worth naming.
    if conf and conf != os.environ.get("PYSPARK_PYTHON"):
        advice += (
            f" (this session's spark.pyspark.python, {conf}, is not used: only "
            "spark-submit reads it; a SparkSession built in Python starts its workers "
            "with PYSPARK_PYTHON)"
        )
    return advice + "."
