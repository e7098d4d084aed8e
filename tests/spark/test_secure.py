"""The data source against a broker with TLS and users: options 'creds' and 'tlsCa'
reach every connector it makes, the driver's and the tasks' (certificates by trustme,
keys by Credentials.generate, all in tmp_path)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

import meshbus
from tests.integration.helpers import start_secure_broker
from tests.spark.conftest import in_thread

pytestmark = [pytest.mark.spark, pytest.mark.slow]


async def test_a_read_and_a_write_sign_in_over_tls(spark: SparkSession, tmp_path: Path) -> None:
    secure = await start_secure_broker(tmp_path, "alice")
    broker, ca_file, creds = secure.process, secure.ca_file, secure.creds
    access = {"brokers": broker.address, "creds": str(creds), "tlsCa": str(ca_file)}
    try:
        async with await meshbus.connect(
            broker.address, server="pub", tls=str(ca_file), credentials=creds
        ) as conn:
            await conn.streams.add("games", "multicast:games")
            publisher, board = await conn.register(), await conn.register()
            await board.join("multicast:board")
            got: list[meshbus.Message] = []
            board.add_listener(got.append)
            for i in range(1, 21):
                await publisher.send("multicast:games", b"g%d" % i, reliable=True)
            await conn.wait_acked(30)

            def read_then_write() -> list[bytes]:
                read = spark.read.format("meshbus").option("stream", "games")
                read = read.option("rowsPerPartition", 10)  # two tasks
                df = read.options(**access).load()
                rows = [bytes(r.payload) for r in df.orderBy("seq").collect()]
                write = df.select("payload").write.format("meshbus").mode("append")
                write.options(**access).option("address", "multicast:board").save()
                return rows

            assert await in_thread(read_then_write) == [b"g%d" % i for i in range(1, 21)]
            # A write task ends once its rows are acknowledged: all are here by now.
            assert sorted(m.payload for m in got) == sorted(b"g%d" % i for i in range(1, 21))
    finally:
        assert await broker.stop() == 0
