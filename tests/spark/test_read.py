"""Reading durable streams with Spark: batch ranges, availableNow runs, and a query
stopped mid-way and restarted from its checkpoint -- real brokers, a real local Spark."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from meshbus.spark import SCHEMA
from tests.conftest import BrokerProcess, start_broker, stop_all
from tests.spark.conftest import (
    Batches,
    checkpoint,
    forget_last_commit,
    in_thread,
    publish,
    reader,
)

pytestmark = [pytest.mark.spark, pytest.mark.slow]


async def test_a_batch_read_returns_exactly_the_range(
    spark: SparkSession, broker: BrokerProcess
) -> None:
    payloads = [b"event-%03d" % i for i in range(1, 41)]
    before = time.time()
    await publish(broker.address, "games", payloads)
    after = time.time()

    def read() -> list[tuple[object, ...]]:
        df = (
            spark.read.format("meshbus")
            .option("brokers", broker.address)
            .option("stream", "games")
            .option("startingSeq", 5)
            .option("endingSeq", 27)
            .option("rowsPerPartition", 7)  # 4 tasks
            .option("fetchSize", 3)  # and several pages each
            .load()
        )
        assert df.schema == SCHEMA
        assert df.rdd.getNumPartitions() == 4
        return [tuple(r) for r in df.orderBy("seq").collect()]

    rows = await in_thread(read)
    assert [r[1] for r in rows] == list(range(5, 28))
    assert [bytes(r[7]) for r in rows] == payloads[4:27]  # type: ignore[arg-type]
    stream, _, stored_at, src, dst, group, priority, _, headers = rows[0]
    assert (stream, dst, group, priority, headers) == ("games", "multicast:games", None, 0, None)
    assert str(src).startswith("pub:")
    assert isinstance(stored_at, dt.datetime)
    assert before - 1 <= stored_at.timestamp() <= after + 1

    def whole() -> list[int]:
        df = spark.read.format("meshbus").option("brokers", broker.address)
        return [r.seq for r in df.option("stream", "games").load().select("seq").collect()]

    assert sorted(await in_thread(whole)) == list(range(1, 41))  # default: all of it

    await publish(broker.address, "quiet", [])

    def empty() -> int:
        df = spark.read.format("meshbus").option("brokers", broker.address)
        return df.option("stream", "quiet").load().count()

    assert await in_thread(empty) == 0


async def test_a_local_read_of_the_store_file_equals_a_read_over_the_bus(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A broker with a data dir on this machine: tasks read its SQLite file themselves
    (localRead auto or true) and get exactly what fetching over the bus gives."""
    broker = await start_broker("--data-dir", str(tmp_path / "data"))
    try:
        payloads = [b"local-%03d" % i for i in range(1, 61)]
        await publish(broker.address, "games", payloads, max_msgs=50)  # 1..10 trimmed

        def read(local: str) -> list[tuple[object, ...]]:
            df = (
                spark.read.format("meshbus")
                .option("brokers", broker.address)
                .option("stream", "games")
                .option("localRead", local)
                .option("rowsPerPartition", 20)
                .option("fetchSize", 7)
                .load()
            )
            return [tuple(r) for r in df.orderBy("seq").collect()]

        over_the_bus = await in_thread(read, "false")
        assert [r[1] for r in over_the_bus] == list(range(11, 61))
        assert [bytes(r[7]) for r in over_the_bus] == payloads[10:]  # type: ignore[arg-type]
        assert await in_thread(read, "true") == over_the_bus
        assert await in_thread(read, "auto") == over_the_bus
    finally:
        await stop_all([broker])


async def test_local_read_true_without_a_store_file_says_why(
    spark: SparkSession, broker: BrokerProcess
) -> None:
    await publish(broker.address, "memory", [b"x"])

    def read() -> int:
        df = spark.read.format("meshbus").option("brokers", broker.address)
        return df.option("stream", "memory").option("localRead", "true").load().count()

    with pytest.raises(Exception, match="localRead=true, but stream 'memory' is on broker"):
        await in_thread(read)


def available_now(
    spark: SparkSession, address: str, stream: str, sink: Batches, location: str, **options: object
) -> None:
    """Read ``stream`` with trigger(availableNow=True) into ``sink``, checkpointed."""
    query = (
        reader(spark, address, stream, **options)
        .load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", location)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(60)
    assert query.exception() is None


async def test_available_now_twice_reads_only_what_came_in_between(
    spark: SparkSession, broker: BrokerProcess, tmp_path: Path
) -> None:
    await publish(broker.address, "scores", [b"a%d" % i for i in range(1, 26)])
    sink = Batches()
    location = checkpoint(tmp_path)

    def run() -> None:
        available_now(spark, broker.address, "scores", sink, location, maxRowsPerTrigger=10)

    await in_thread(run)
    # maxRowsPerTrigger=10 splits the 25 rows into three micro-batches.
    assert [len(rows) for _, rows in sink.batches] == [10, 10, 5]
    assert [seq for seq, _ in sink.rows()] == list(range(1, 26))

    await publish(broker.address, "scores", [b"b%d" % i for i in range(1, 8)])
    sink.batches.clear()
    await in_thread(run)
    assert sink.rows() == [(25 + i, b"b%d" % i) for i in range(1, 8)]


async def test_a_query_stopped_mid_way_resumes_without_loss_or_repeat(
    spark: SparkSession, broker: BrokerProcess, tmp_path: Path
) -> None:
    await publish(broker.address, "ledger", [b"x%d" % i for i in range(1, 121)])
    sink = Batches()
    location = checkpoint(tmp_path)

    def stop_after_two_batches() -> None:
        query = (
            reader(spark, broker.address, "ledger", maxRowsPerTrigger=10)
            .load()
            .writeStream.foreachBatch(sink)
            .option("checkpointLocation", location)
            .start()
        )
        deadline = time.monotonic() + 60
        while len(sink.batches) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        query.stop()  # wherever it is: between batches, or in the middle of one
        assert query.exception() is None

    await in_thread(stop_after_two_batches)
    seen = len(sink.rows())
    assert 20 <= seen < 120, f"the first run read {seen} rows"
    # Whether or not stop() came in the middle of a batch, make the last one uncommitted:
    # the restart must run it again, from the checkpoint's offsets, with the same rows.
    replayed = forget_last_commit(location)
    # stop() can land after the batch was planned (its offsets written) but before it
    # reached the sink: then the first run never saw it. Either way, it runs once more.
    ran_before = [batch for batch, _ in sink.batches].count(replayed)

    await publish(broker.address, "ledger", [b"x%d" % i for i in range(121, 131)])

    await in_thread(
        lambda: available_now(spark, broker.address, "ledger", sink, location, maxRowsPerTrigger=40)
    )
    assert [batch for batch, _ in sink.batches].count(replayed) == ran_before + 1
    assert sink.rows() == [(i, b"x%d" % i) for i in range(1, 131)]  # checks the replay too


async def test_a_trimmed_stream_is_read_from_its_first_kept_message(
    spark: SparkSession, broker: BrokerProcess, tmp_path: Path
) -> None:
    await publish(broker.address, "recent", [b"r%d" % i for i in range(1, 13)], max_msgs=5)
    sink = Batches()
    location = checkpoint(tmp_path)
    await in_thread(
        lambda: available_now(spark, broker.address, "recent", sink, location, startingSeq=1)
    )
    # Seqs 1..7 were removed by max_msgs=5 before the query started: skipped.
    assert sink.rows() == [(i, b"r%d" % i) for i in range(8, 13)]
