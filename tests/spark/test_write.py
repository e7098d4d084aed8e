"""Writing to the bus with Spark: every row reaches its receivers once, also when Spark
runs a micro-batch (or a whole job) again -- real brokers, a real local Spark."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

import meshbus
from tests.conftest import BrokerProcess
from tests.spark.conftest import checkpoint, forget_last_commit, in_thread, publish, reader

pytestmark = [pytest.mark.spark, pytest.mark.slow]


async def test_a_replayed_micro_batch_reaches_the_receiver_once(
    spark: SparkSession, broker: BrokerProcess, tmp_path: Path
) -> None:
    await publish(broker.address, "events", [b"e%d" % i for i in range(1, 31)])
    location = checkpoint(tmp_path)

    def run() -> list[tuple[int, int]]:
        """Game events in, results out to the leaderboard topic; the batches it ran."""
        query = (
            reader(spark, broker.address, "events", maxRowsPerTrigger=10)
            .load()
            .selectExpr(
                "concat(cast('seen ' AS BINARY), payload) AS payload",
                "CAST(seq % 3 AS INT) AS priority",
            )
            .writeStream.format("meshbus")
            .option("brokers", broker.address)
            .option("address", "multicast:leaderboard")
            .option("checkpointLocation", location)
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(60)
        assert query.exception() is None
        return [(p.batchId, p.numInputRows) for p in query.recentProgress if p.numInputRows]

    async with await meshbus.connect(broker.address, server="board") as conn:
        board = await conn.register()
        await board.join("multicast:leaderboard")
        got: list[meshbus.Message] = []
        board.add_listener(got.append)

        assert await in_thread(run) == [(0, 10), (1, 10), (2, 10)]
        expected = sorted(b"seen e%d" % i for i in range(1, 31))
        # A task ends once its rows are acknowledged, and a receiver acknowledges a
        # message as it delivers it: everything is here when the query ends.
        assert sorted(m.payload for m in got) == expected
        assert sorted((m.payload, m.priority) for m in got) == sorted(
            (b"seen e%d" % i, i % 3) for i in range(1, 31)
        )
        assert {str(m.dst) for m in got} == {"multicast:leaderboard"}

        assert forget_last_commit(location) == 2
        # Spark runs batch 2 again: the same ten rows go out again, from a new
        # connector, with the same publish ids, and the receiver drops them.
        assert await in_thread(run) == [(2, 10)]
        assert sorted(m.payload for m in got) == expected


async def test_a_batch_write_rerun_with_its_write_id_is_stored_once(
    spark: SparkSession, broker: BrokerProcess
) -> None:
    await publish(broker.address, "red", [])
    await publish(broker.address, "blue", [])
    rows = [(f"move {i}", f"multicast:{'red' if i % 2 else 'blue'}", i % 5) for i in range(1, 21)]

    def write(write_id: str) -> None:
        df = spark.createDataFrame(rows, "payload STRING, address STRING, priority INT")
        (
            df.repartition(3)
            .sortWithinPartitions("payload")
            .write.format("meshbus")
            .option("brokers", broker.address)
            .option("writeId", write_id)
            .mode("append")
            .save()
        )

    def stored(stream: str) -> list[tuple[str, int]]:
        df = spark.read.format("meshbus").option("brokers", broker.address)
        got = df.option("stream", stream).load().collect()
        return sorted((bytes(r.payload).decode(), r.priority) for r in got)

    def expected(address: str) -> list[tuple[str, int]]:
        return sorted((payload, priority) for payload, to, priority in rows if to == address)

    await in_thread(write, "nightly-1")
    assert await in_thread(stored, "red") == expected("multicast:red")
    assert await in_thread(stored, "blue") == expected("multicast:blue")
    # The job runs again (say it failed half-way through): the same ids, stored once.
    await in_thread(write, "nightly-1")
    assert len(await in_thread(stored, "red")) == 10
    assert len(await in_thread(stored, "blue")) == 10


async def test_rows_in_message_groups_arrive_in_order_and_a_row_over_max_frame_fails(
    spark: SparkSession, broker: BrokerProcess
) -> None:
    """A DataFrame with a `group` column goes row by row (each message takes its place in
    its group); a row too large for a frame fails the job with FrameTooLarge, not a cut."""
    rows = [(f"turn {i}", f"match-{i % 2}", i >= 18) for i in range(20)]

    def write(df_rows: list[tuple[object, ...]], schema: str) -> None:
        (
            spark.createDataFrame(df_rows, schema)
            .coalesce(1)
            .write.format("meshbus")
            .option("brokers", broker.address)
            .option("address", "anycast:referee")
            .mode("append")
            .save()
        )

    async with await meshbus.connect(broker.address, server="referee") as conn:
        referee = await conn.register()
        await referee.join("anycast:referee")
        got: list[meshbus.Message] = []
        referee.add_listener(got.append)
        await in_thread(write, rows, "payload STRING, group STRING, final BOOLEAN")
        for match in ("match-0", "match-1"):
            mine = [(m.payload.decode(), m.final) for m in got if m.group == match]
            assert mine == [(p, f) for p, g, f in rows if g == match]

        with pytest.raises(Exception, match="exceeds the maximum frame size") as failed:
            await in_thread(write, [(b"x" * (2 << 20),)], "payload BINARY")
        assert "FrameTooLarge" in str(failed.value)
