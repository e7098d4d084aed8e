"""The Spark suite's fixtures: one local SparkSession for the whole run, and helpers.

A local[2] session takes 6-10 s and ~1.8 GiB to start, so there is exactly one,
session-scoped. Spark's Python workers run this interpreter (``PYSPARK_PYTHON``),
which has meshbus installed. Brokers are the real ones of tests/conftest.py.

Spark calls block, and a test's own services (receivers on the bus) live on the
test's event loop, so tests run every Spark call in a thread (``in_thread``) and
keep the loop free to receive and acknowledge.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip("pyspark", reason="the spark extra is not installed")
pytest.importorskip("pyarrow", reason="the spark extra is not installed")
if shutil.which("java") is None and "JAVA_HOME" not in os.environ:
    pytest.skip("Spark needs Java (no java on PATH, no JAVA_HOME)", allow_module_level=True)

from pyspark.sql import DataFrame, SparkSession

import meshbus
import meshbus.spark

T = TypeVar("T")


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[2]")
        .appName("meshbus-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.streaming.stopTimeout", "10s")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    meshbus.spark.register(session)
    try:
        yield session
    finally:
        session.stop()


async def in_thread(call: Callable[..., T], *args: Any) -> T:
    """Run a blocking Spark call while the test's event loop keeps serving the bus.

    Spark 4 looks a Python data source up as a streaming *sink* in the JVM thread's
    active session only, and a new Python thread gets a JVM thread without one
    (DATA_SOURCE_NOT_FOUND at ``writeStream.start()``); docs/spark.md has the same
    two lines for users."""

    def with_session() -> T:
        session = SparkSession.builder.getOrCreate()
        session._jvm.org.apache.spark.sql.SparkSession.setActiveSession(session._jsparkSession)
        return call(*args)

    return await asyncio.to_thread(with_session)


async def publish(address: str, stream: str, payloads: list[bytes], **limits: Any) -> None:
    """Create ``stream`` capturing multicast:STREAM (if need be) and store ``payloads``."""
    async with await meshbus.connect(address, server="pub") as conn:
        await conn.streams.add(stream, f"multicast:{stream}", **limits)
        publisher = await conn.register()
        for payload in payloads:
            await publisher.send("multicast:" + stream, payload, reliable=True)
        await conn.wait_acked(30)


def reader(spark: SparkSession, address: str, stream: str, **options: Any) -> Any:
    """``spark.readStream.format("meshbus")`` with the options set."""
    read = spark.readStream.format("meshbus").option("brokers", address)
    read = read.option("stream", stream)
    for key, value in options.items():
        read = read.option(key, value)
    return read


class Batches:
    """A foreachBatch sink that remembers every batch it was given, replays included:
    (batch id, the rows' (seq, payload) in seq order)."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[tuple[int, bytes]]]] = []

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        rows = sorted((r.seq, bytes(r.payload)) for r in df.select("seq", "payload").collect())
        self.batches.append((batch_id, rows))

    def rows(self) -> list[tuple[int, bytes]]:
        """Every row of every distinct batch, checking that a replayed batch had exactly
        the rows it had the first time."""
        first: dict[int, list[tuple[int, bytes]]] = {}
        for batch_id, rows in self.batches:
            assert first.setdefault(batch_id, rows) == rows, f"batch {batch_id} changed"
        return sorted(row for rows in first.values() for row in rows)


def checkpoint(tmp_path: Path, name: str = "checkpoint") -> str:
    return str(tmp_path / name)


def forget_last_commit(location: str) -> int:
    """Delete the commit log entry of the checkpoint's last planned batch (if it was
    committed), so a restarted query runs that batch again; returns its id."""
    last = max(int(p.name) for p in (Path(location) / "offsets").iterdir() if p.name.isdigit())
    for name in (str(last), f".{last}.crc"):
        (Path(location) / "commits" / name).unlink(missing_ok=True)
    return last
