"""The demo's data pipeline: a Spark Structured Streaming job on the bus.

It reads the match results from the durable stream ``results`` (the meshbus Spark
source, sequence numbers as offsets), keeps wins per player (a streaming
aggregation, so Spark holds the ranking in its state store), and writes every
changed row back to ``multicast:leaderboard`` with the meshbus batch sink, where the
lobby services get it. Spark's Python data sources take appends only, so the
changed rows of each micro-batch ("update" mode) go out through ``foreachBatch``,
as Kafka users do for aggregations. Each row's publish id is (batch id, player), so
a batch Spark runs again after a restart is delivered once (the receivers'
publish-id window), whatever order its rows come in.
Each row carries the send time of the newest result it counts, so a lobby can tell
how long a result took to reach the leaderboard.
"""

from __future__ import annotations

import os
import sys
from typing import Any

TRIGGER = "1 second"
# Spark's own logging, errors only: the demo's terminal is for the demo.
_LOG4J = """rootLogger.level = error
rootLogger.appenderRef.stderr.ref = stderr
appender.console.type = Console
appender.console.name = stderr
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = spark %p %c{1}: %m%n
"""


def start_session(work_dir: str) -> Any:
    """A local Spark session for the demo (blocking: 6-10 s). Spark's Python workers
    must run this interpreter, which has meshbus installed."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    log4j = os.path.join(work_dir, "log4j2.properties")
    with open(log4j, "w") as file:
        file.write(_LOG4J)
    from pyspark.sql import SparkSession

    import meshbus.spark

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("meshbus-demo")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{log4j}")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.streaming.stateStore.providerClass",
                "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider")
        .getOrCreate()
    )  # fmt: skip
    spark.sparkContext.setLogLevel("ERROR")
    meshbus.spark.register(spark)
    return spark


def start_leaderboard(
    spark: Any, brokers: str, access: dict[str, str], stream: str, address: str, checkpoint: str
) -> Any:
    """Start the streaming query; returns it (``query.stop()`` ends it). ``access``: the
    data source's options that sign in and turn TLS on (``Access.data_source_options``)."""
    from pyspark.sql import functions as f
    from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

    schema = StructType(
        [
            StructField("match", LongType()),
            StructField("winner", StringType()),
            StructField("loser", StringType()),
            StructField("sent_at", DoubleType()),
        ]
    )
    results = (
        spark.readStream.format("meshbus")
        .option("brokers", brokers)
        .option("stream", stream)
        .option("startingOffsets", "earliest")
        .options(**access)
        .load()
    )
    parsed = results.select(f.from_json(f.col("payload").cast("string"), schema).alias("r"))
    wins = parsed.groupBy(f.col("r.winner").alias("player")).agg(
        f.count("*").alias("wins"), f.max("r.sent_at").alias("last_sent_at")
    )
    rows = wins.select(
        "player", f.to_json(f.struct("player", "wins", "last_sent_at")).alias("payload")
    )

    def publish(batch: Any, batch_id: int) -> None:
        publish_id = f.concat(f.lit(f"leaderboard/{batch_id}/"), f.col("player"))
        (
            batch.select("payload", publish_id.alias("publish_id"))
            .write.format("meshbus")
            .option("brokers", brokers)
            .option("address", address)
            .options(**access)
            .mode("append")
            .save()
        )

    return (
        rows.writeStream.foreachBatch(publish)
        .option("checkpointLocation", checkpoint)
        .outputMode("update")
        .trigger(processingTime=TRIGGER)
        .start()
    )
