"""A Spark job on the bus: write match results to a stream, then read them as a table.

    python examples/spark_job.py

Needs Java 17+ and the spark extra (``pip install 'meshbus[spark]'``; ``make`` installs
it). A batch DataFrame is written to ``multicast:results`` -- a stream captures it, each
row stored once even if a task is retried -- then read back from the stream and
aggregated into a leaderboard, as a Kafka topic would be.
"""

from __future__ import annotations

import asyncio
import os
import sys

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

import meshbus
import meshbus.spark

BROKER = os.environ.get("MESHBUS_BROKER", "127.0.0.1:7400")
PLAYERS = ("ann", "bob", "cid", "dee")


async def create_stream(broker: str = BROKER) -> None:
    async with meshbus.connect(broker, server="setup") as conn:
        await conn.streams.add("results", "multicast:results")


def leaderboard(spark: SparkSession, broker: str) -> dict[str, int]:
    """Write the results with Spark, read them back from the stream, total per player."""
    meshbus.spark.register(spark)
    matches = spark.createDataFrame(
        [(f'{{"player": "{PLAYERS[i % 4]}", "score": {i}}}',) for i in range(100)],
        ["payload"],
    )
    (
        matches.write.format("meshbus")
        .option("brokers", broker)
        .option("address", "multicast:results")
        .mode("append")
        .save()
    )
    stored = spark.read.format("meshbus").option("brokers", broker).option("stream", "results")
    text = F.col("payload").cast("string")
    scores = stored.load().select(
        F.get_json_object(text, "$.player").alias("player"),
        F.get_json_object(text, "$.score").cast("int").alias("score"),
    )
    board = scores.groupBy("player").agg(F.sum("score").alias("total"))
    return {row.player: row.total for row in board.collect()}


def main() -> None:
    asyncio.run(create_stream())
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the workers import meshbus
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("meshbus example")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        for player, total in sorted(leaderboard(spark, BROKER).items()):
            print(f"{player}: {total}")
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
