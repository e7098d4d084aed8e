"""The driver of test_cluster.py's applications, run as its own process:
``python -m tests.spark.cluster_app MASTER BROKERS WORK BARE_PYTHON JAVA_OPTIONS RESULT``.

A process of its own because a JVM holds one SparkContext at a time, and the pytest
process may hold the suite's local one (conftest.py's ``spark``). Two applications
run on the standalone cluster at MASTER, one after the other:

1. Python workers that run BARE_PYTHON, a Python without meshbus: ``register()``
   must refuse, and its message is kept.
2. Workers that run this interpreter: ``register()`` passes, and a streaming query
   reads stream ``ledger`` and writes each row back to ``multicast:board`` as
   ``seen PAYLOAD``; it is stopped mid-way and restarted from its checkpoint, with
   its last planned batch uncommitted, as in test_read.py and test_write.py. The
   pytest process publishes the first 120 messages and receives the written ones.

JAVA_OPTIONS go to the driver's and the executors' JVMs. What the test checks is
written to RESULT as JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

import meshbus
import meshbus.spark
from tests.spark.conftest import forget_last_commit, publish, reader

BOARD = "multicast:board"


def start(master: str, name: str, python: str, java: str, **conf: str) -> SparkSession:
    """Application ``name`` on ``master``, its Python workers running ``python``;
    executors of 512 MiB and one core; ``java``: the JVMs' options."""
    # The Python worker executable is read from here when the SparkContext starts.
    os.environ["PYSPARK_PYTHON"] = python
    settings = {
        "spark.master": master,
        "spark.app.name": f"meshbus-{name}",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.executor.memory": "512m",
        "spark.executor.cores": "1",
        "spark.driver.extraJavaOptions": java,
        "spark.executor.extraJavaOptions": java,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.sql.streaming.stopTimeout": "10s",
        **conf,
    }
    builder = SparkSession.builder
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def refusal(master: str, java: str, bare_python: str) -> str:
    """What ``register()`` says to workers without meshbus, on one executor. The
    session also sets spark.pyspark.python to a good interpreter, which a session
    built in Python ignores: the message must say so."""
    conf = {"spark.pyspark.python": sys.executable, "spark.cores.max": "1"}
    spark = start(master, "bare", bare_python, java, **conf)
    try:
        meshbus.spark.register(spark)
    except meshbus.SparkSetupError as exc:
        return str(exc)
    finally:
        spark.stop()
    raise AssertionError("register() accepted Python workers without meshbus")


def executors(spark: SparkSession) -> list[str]:
    """The ids of the executors (the driver is none of them), once both have come."""
    deadline = time.monotonic() + 30
    while True:
        ids = str(spark.sparkContext._jsc.sc().getExecutorIds().mkString(","))
        if len(ids.split(",")) >= 2 or time.monotonic() > deadline:
            return sorted(ids.split(","))
        time.sleep(0.1)


def query(spark: SparkSession, brokers: str, location: str, **options: Any) -> Any:
    """Game events in, ``seen EVENT`` out to the board, checkpointed at ``location``;
    every micro-batch in two tasks, one per executor (if the scheduler wills)."""
    return (
        reader(spark, brokers, "ledger", minPartitions=2, **options)
        .load()
        .selectExpr("concat(cast('seen ' AS BINARY), payload) AS payload")
        .writeStream.format("meshbus")
        .option("brokers", brokers)
        .option("address", BOARD)
        .option("checkpointLocation", location)
    )


def batches(running: Any) -> list[tuple[int, int]]:
    """(batch id, rows read) of every micro-batch the query ran that read rows."""
    return [(p["batchId"], p["numInputRows"]) for p in running.recentProgress if p["numInputRows"]]


def stream_stopped_and_restarted(spark: SparkSession, brokers: str, work: Path) -> dict[str, Any]:
    location = str(work / "checkpoint")
    first = query(spark, brokers, location, maxRowsPerTrigger=10).start()
    deadline = time.monotonic() + 60
    while len(batches(first)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    first.stop()  # wherever it is: between batches, or in the middle of one
    assert first.exception() is None
    # As in test_read.py: the restart runs the last planned batch again, from the
    # checkpoint's offsets -- and the sink's publish ids make its rows arrive once.
    replayed = forget_last_commit(location)
    asyncio.run(publish(brokers, "ledger", [b"x%d" % i for i in range(121, 131)]))
    second = query(spark, brokers, location)
    second = second.trigger(availableNow=True).start()
    second.awaitTermination(60)
    assert second.exception() is None
    return {"first": batches(first), "second": batches(second), "replayed": replayed}


def main() -> None:
    master, brokers, work_dir, bare_python, java_options, result = sys.argv[1:]
    refused = refusal(master, java_options, bare_python)
    # Executors import the meshbus this driver imports -- the code under test -- even
    # when the cluster's own environment would find another one (or none). Both cores
    # said again: the builder and the driver's JVM keep the first application's
    # settings (spark.cores.max=1) for the next one.
    here = str(Path(meshbus.__file__).parents[1])
    conf = {"spark.executorEnv.PYTHONPATH": here, "spark.cores.max": "2"}
    spark = start(master, "app", sys.executable, java_options, **conf)
    try:
        meshbus.spark.register(spark)
        ids = executors(spark)
        # Where tasks run: each executor's directory, <worker dir>/<app id>/<executor id>.
        task_dirs = spark.sparkContext.parallelize(range(4), 4).map(lambda _: os.getcwd())
        outcome = {
            "refused": refused,
            "app": spark.sparkContext.applicationId,
            "executors": ids,
            "task_dirs": sorted(set(task_dirs.collect())),
            **stream_stopped_and_restarted(spark, brokers, Path(work_dir)),
        }
    finally:
        spark.stop()
    Path(result).write_text(json.dumps(outcome))


if __name__ == "__main__":
    main()
