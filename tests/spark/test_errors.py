"""A user's mistakes fail on the driver, when the query is defined or starts, with a
message that says what to fix -- not deep in a task's trace."""

from __future__ import annotations

import re
import socket
import sys
from pathlib import Path

import pytest
from pyspark.errors import AnalysisException, StreamingQueryException
from pyspark.sql import SparkSession

import meshbus
import meshbus.spark
from tests.conftest import BrokerProcess
from tests.spark.conftest import checkpoint, in_thread, publish

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def closed_port() -> str:
    """An address nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def load_error(spark: SparkSession, streaming: bool, **options: str) -> str:
    """What ``load()`` raises with ``options``: it fails right there."""
    read = spark.readStream if streaming else spark.read
    read = read.format("meshbus")
    for key, value in options.items():
        read = read.option(key, value)
    with pytest.raises(AnalysisException) as failed:
        read.load()
    return str(failed.value)


async def test_read_errors_fail_load(spark: SparkSession, broker: BrokerProcess) -> None:
    await publish(broker.address, "present", [b"x"])
    for streaming in (False, True):  # both fail in schema(), at load()
        message = load_error(spark, streaming, brokers=broker.address, stream="nope")
        assert "StreamError: meshbus data source (brokers " in message
        assert "no stream named 'nope'" in message
        message = load_error(spark, streaming, brokers=closed_port(), stream="present")
        assert re.search(r"ConnectionLost: .*could not connect to broker 127\.0\.0\.1:\d+", message)

    # Each failed load() costs Spark a new Python worker: the rest once, as batch reads.
    message = load_error(spark, False, brokers=broker.address)
    assert "ValueError: meshbus data source: option 'stream' is required" in message
    assert "option 'brokers' is required" in load_error(spark, False, stream="present")
    message = load_error(spark, False, brokers=broker.address, stream="present", startingSeq="x")
    assert "option 'startingSeq' must be an integer, got 'x'" in message

    def batch_only() -> str:
        read = spark.read.format("meshbus").option("brokers", broker.address)
        read = read.option("stream", "present").option("maxRowsPerTrigger", 10)
        with pytest.raises(AnalysisException) as failed:
            read.load().collect()
        return str(failed.value)

    assert "'maxRowsPerTrigger' is for streaming reads" in await in_thread(batch_only)


async def test_write_errors_fail_save(spark: SparkSession, broker: BrokerProcess) -> None:
    def save_error(columns: str, **options: str) -> str:
        df = spark.createDataFrame([], columns)
        write = df.write.format("meshbus").mode("append")
        for key, value in options.items():
            write = write.option(key, value)
        with pytest.raises(AnalysisException) as failed:
            write.save()
        return str(failed.value)

    def check() -> None:
        to = {"brokers": broker.address, "address": "multicast:out"}
        message = save_error("id LONG, text STRING", **to)
        assert "writing needs a 'payload' column" in message
        assert "the DataFrame has id, text" in message
        assert "must be binary or string" in save_error("payload INT", **to)
        assert "option 'brokers' is required" in save_error("payload STRING", address="anycast:x")
        assert "where to send?" in save_error("payload STRING", brokers=broker.address)
        message = save_error("payload STRING", brokers=broker.address, address="multicast:")
        assert "option 'address': group name must not be empty" in message
        message = save_error("payload STRING", brokers=closed_port(), address="anycast:x")
        assert "could not connect to broker" in message
        message = save_error("payload STRING, group STRING", **to)
        assert "a 'group' column needs an anycast address" in message

    await in_thread(check)


async def test_a_streaming_write_without_payload_fails_before_sending(
    spark: SparkSession, broker: BrokerProcess, tmp_path: Path
) -> None:
    await publish(broker.address, "src", [b"1", b"2"])

    def run() -> str:
        query = (
            spark.readStream.format("meshbus")
            .option("brokers", broker.address)
            .option("stream", "src")
            .load()
            .select("seq")
            .writeStream.format("meshbus")
            .option("brokers", broker.address)
            .option("address", "multicast:out")
            .option("checkpointLocation", checkpoint(tmp_path))
            .trigger(availableNow=True)
            .start()
        )
        with pytest.raises(StreamingQueryException) as failed:
            query.awaitTermination(60)
        return str(failed.value)

    message = await in_thread(run)
    # Spark makes the stream writer only when the first micro-batch runs (on the driver).
    assert "Failed to initialize Python data source writer" in message
    assert "writing needs a 'payload' column (binary, or string sent as UTF-8)" in message


def test_register_says_when_the_workers_python_does_not_start(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PYSPARK_PYTHON naming a Python that executors do not have. (Workers that run a
    Python without meshbus: test_cluster.py.)"""
    missing = str(tmp_path / "bin" / "python3")
    # What PYSPARK_PYTHON=missing gives a session: PySpark reads it into this attribute
    # when the SparkContext starts, and hands it to every Python function it ships.
    monkeypatch.setattr(spark.sparkContext, "pythonExec", missing)
    with pytest.raises(meshbus.SparkSetupError) as refused:
        meshbus.spark.register(spark)
    message = str(refused.value)
    assert f'did not run a task: java.io.IOException: Cannot run program "{missing}"' in message
    assert "set PYSPARK_PYTHON to a Python 3." in message
    assert f"such as this driver's {sys.executable} --" in message
