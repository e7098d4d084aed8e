"""Spark over meshbus, measured: streaming reads against Parquet, and writes to the bus.

``bench_spark()`` (``python -m bench spark``, the ``spark`` command below) starts a
broker with a SQLite store in a temporary directory (or uses ``brokers``), fills a
stream with ``rows`` messages of ``size`` bytes, and in one local Spark session
(``local[2]`` unless one is given) measures

* ``meshbus_read_rows_per_s``: ``readStream.format("meshbus")`` of the whole stream
  into the ``noop`` sink with ``trigger(availableNow=True)``, read by ``partitions``
  tasks (from the broker's store file: the broker runs on this machine);
* ``meshbus_bus_read_rows_per_s``: the same with ``localRead=false``, every page
  fetched from the broker;
* ``parquet_read_rows_per_s``: the same rows and columns, copied to ``partitions``
  Parquet files beforehand, through the same query with ``readStream.parquet``;
* ``python_ceiling_rows_per_s``: the same query over ``NothingSource``, a Python
  streaming source that reads nothing -- each task yields one prebuilt Arrow batch of
  the same schema and size over and over. It is what Spark's Python data source path
  itself costs (the Python process per query, Arrow from the workers to the JVM),
  the most any Python source can do here; ``ceiling_vs_parquet`` sets it against
  Parquet;
* ``meshbus_write_rows_per_s``: those Parquet rows' payloads streamed with
  ``writeStream.format("meshbus")`` to a multicast address a second stream captures;
  a task ends once the broker has stored (and acknowledged) every row, and the
  stream's count is checked afterwards.

Every rate is rows over the wall time of ``start()`` to the end of
``awaitTermination()``, so it includes Spark's fixed cost of a query.
``empty_query_s`` is that cost for a meshbus read of no rows: ~1.3 s with Spark 4.3
on two cores, nearly all of it Spark starting a Python process for the stream
reader (a do-nothing Python source costs the same; a Parquet query ~0.3 s), so
small runs understate the rate. A small query runs first so the JVM and the Python
workers are warm. ``fill_rows_per_s`` is how fast one connector filled the stream
with reliable sends, for scale.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

import meshbus
from bench.servers import meshbus_broker
from meshbus.spark import register
from meshbus.spark.reader import SCHEMA

STREAM = "bench_spark"
SINK = "bench_spark_out"
_PAGE = 4096  # rows per batch of NothingSource
# The checkout this rig runs from: Spark's Python processes unpickle NothingSource by its
# module name, bench.spark, and the rig is not installed where they could find it.
_CHECKOUT = str(Path(__file__).resolve().parents[1])


class _Rows(InputPartition):
    def __init__(self, count: int, size: int) -> None:
        self.count, self.size = count, size


class _NothingReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, rows: int, size: int, partitions: int) -> None:
        self.rows, self.size, self.tasks = rows, size, partitions

    def initialOffset(self) -> dict[str, int]:
        return {"rows": 0}

    def prepareForTriggerAvailableNow(self) -> None:
        """All rows are there from the start."""

    def latestOffset(self, start: dict[str, int], limit: Any) -> dict[str, int]:
        return {"rows": self.rows}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        count = end["rows"] - start["rows"]
        if count <= 0:
            return []
        n = self.tasks
        return [_Rows(count * (i + 1) // n - count * i // n, self.size) for i in range(n)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, _Rows)
        page = _page(partition.size)
        for done in range(0, partition.count, _PAGE):
            yield page.slice(0, min(_PAGE, partition.count - done))

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to release."""


class NothingSource(DataSource):
    """``format("meshbus-bench-nothing")``: rows of the meshbus schema from nowhere, the
    Python-source ceiling of ``python -m bench spark``."""

    @classmethod
    def name(cls) -> str:
        return "meshbus-bench-nothing"

    def schema(self) -> StructType:
        return SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        opts = self.options
        return _NothingReader(int(opts["rows"]), int(opts["size"]), int(opts["partitions"]))


def _page(size: int) -> pa.RecordBatch:
    """A batch of ``_PAGE`` rows shaped like a stream's: one source, one destination."""
    values = {
        "stream": STREAM,
        "seq": 1,
        "stored_at": 1_700_000_000_000_000,
        "src": "unicast:" + "0" * 32,
        "dst": "multicast:" + STREAM,
        "group": None,
        "priority": 0,
        "payload": b"x" * size,
        "headers": None,
    }
    schema = to_arrow_schema(SCHEMA, timezone="UTC")
    arrays = [pa.repeat(pa.scalar(values[f.name], f.type), _PAGE) for f in schema]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


@contextlib.contextmanager
def _broker(brokers: str | None, data_dir: str) -> Iterator[str]:
    if brokers is not None:
        yield brokers
        return
    with meshbus_broker("--data-dir", data_dir) as server:
        yield f"{server.host}:{server.port}"


@contextlib.contextmanager
def _session(spark: Any, partitions: int) -> Iterator[Any]:
    if spark is not None:
        yield spark
        return
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # Spark's Python processes inherit the environment of the JVM, which the session
    # below starts with this one: the checkout on their PYTHONPATH lets them import
    # bench.spark whatever directory they start in.
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _CHECKOUT not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([_CHECKOUT, *paths])
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master(f"local[{partitions}]")
        .appName("meshbus-bench-spark")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", str(partitions))
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()


async def _fill(address: str, rows: int, size: int) -> float:
    """Create the streams and store ``rows`` messages; the seconds the sends took."""
    async with await meshbus.connect(address, server="benchfill") as conn:
        await conn.streams.add(STREAM, f"multicast:{STREAM}")
        await conn.streams.add(SINK, f"multicast:{SINK}")
        publisher = await conn.register()
        began = time.perf_counter()
        for i in range(rows):
            payload = i.to_bytes(8, "big") * math.ceil(size / 8)
            await publisher.send(f"multicast:{STREAM}", payload[:size], reliable=True)
        await conn.wait_acked(600)
        return time.perf_counter() - began


async def _stored(address: str, stream: str) -> int:
    async with await meshbus.connect(address, server="benchfill") as conn:
        return (await conn.streams.info(stream)).messages


def _timed(query: Any) -> float:
    """Wall seconds from ``start()`` (already called) to the end of the query."""
    began = time.perf_counter()
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"the benchmark query failed: {query.exception()}")
    return time.perf_counter() - began


def bench_spark(
    rows: int = 200_000,
    size: int = 100,
    *,
    partitions: int = 2,
    runs: int = 1,
    brokers: str | None = None,
    spark: Any = None,
) -> dict[str, float]:
    """The figures described in the module docstring; medians over ``runs``. With
    ``brokers`` the streams are created there (and must not exist yet); with ``spark``
    that session is used (and left running), and its Python workers must be able to
    import ``bench.spark`` (the checkout on their PYTHONPATH)."""
    tmp = tempfile.mkdtemp(prefix="meshbus-bench-spark-")
    try:
        with (
            _broker(brokers, str(Path(tmp) / "broker")) as address,
            _session(spark, partitions) as session,
        ):
            register(session)
            session.dataSource.register(NothingSource)
            # Spark makes a streaming sink only in the thread's active JVM session.
            jvm_session = session._jvm.org.apache.spark.sql.SparkSession
            jvm_session.setActiveSession(session._jsparkSession)
            return _measure(session, address, tmp, rows, size, partitions, runs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _measure(
    spark: Any, address: str, tmp: str, rows: int, size: int, partitions: int, runs: int
) -> dict[str, float]:
    fill_seconds = asyncio.run(_fill(address, rows, size))
    per_task = str(math.ceil(rows / partitions))

    def meshbus_source(**options: Any) -> Any:
        read = spark.readStream.format("meshbus").option("brokers", address)
        read = read.option("stream", STREAM).option("rowsPerPartition", per_task)
        for key, value in options.items():
            read = read.option(key, str(value))
        return read.load()

    def run(df: Any, sink: str, **options: str) -> float:
        write = df.writeStream.format(sink).trigger(availableNow=True)
        write = write.option("checkpointLocation", tempfile.mkdtemp(dir=tmp))
        for key, value in options.items():
            write = write.option(key, value)
        return _timed(write.start())

    # The copy, and a first small query, warm up the JVM and the Python workers.
    parquet = str(Path(tmp) / "parquet")
    batch = spark.read.format("meshbus").option("brokers", address).option("stream", STREAM)
    batch.load().repartition(partitions).write.parquet(parquet)
    run(meshbus_source(startingSeq=max(1, rows - 999)), "noop")

    nothing = spark.readStream.format(NothingSource.name()).option("rows", rows)
    nothing = nothing.option("size", size).option("partitions", partitions).load()
    empties, reads, bus_reads, parquet_reads, ceilings, writes = [], [], [], [], [], []
    for _ in range(runs):
        empties.append(run(meshbus_source(startingOffsets="latest"), "noop"))
        reads.append(run(meshbus_source(), "noop"))
        bus_reads.append(run(meshbus_source(localRead="false"), "noop"))
        parquet_reads.append(run(spark.readStream.schema(SCHEMA).parquet(parquet), "noop"))
        ceilings.append(run(nothing, "noop"))
        before = asyncio.run(_stored(address, SINK))
        writes.append(
            run(
                spark.readStream.schema(SCHEMA).parquet(parquet).select("payload"),
                "meshbus",
                brokers=address,
                address=f"multicast:{SINK}",
            )
        )
        stored = asyncio.run(_stored(address, SINK)) - before
        if stored != rows:
            raise RuntimeError(f"the write stored {stored} of {rows} rows")

    empty_s, read_s, bus_read_s, parquet_s, ceiling_s, write_s = (
        statistics.median(x) for x in (empties, reads, bus_reads, parquet_reads, ceilings, writes)
    )
    return {
        "rows": rows,
        "payload_bytes": size,
        "partitions": partitions,
        "fill_rows_per_s": rows / fill_seconds,
        "meshbus_read_rows_per_s": rows / read_s,
        "meshbus_bus_read_rows_per_s": rows / bus_read_s,
        "parquet_read_rows_per_s": rows / parquet_s,
        "read_vs_parquet": parquet_s / read_s,
        "python_ceiling_rows_per_s": rows / ceiling_s,
        "ceiling_vs_parquet": parquet_s / ceiling_s,
        "read_vs_ceiling": ceiling_s / read_s,
        "meshbus_write_rows_per_s": rows / write_s,
        "meshbus_read_s": read_s,
        "parquet_read_s": parquet_s,
        "python_ceiling_s": ceiling_s,
        "meshbus_write_s": write_s,
        "empty_query_s": empty_s,
    }


@click.command()
@click.option(
    "--rows",
    type=click.IntRange(1000),
    default=500_000,
    show_default=True,
    help="Rows in the stream (each read, and written back, once per run).",
)
@click.option(
    "--size", type=click.IntRange(0, 100_000), default=100, show_default=True,
    help="Payload bytes per row.",
)  # fmt: skip
@click.option(
    "--runs", type=click.IntRange(1), default=3, show_default=True,
    help="Runs in one Spark session; medians are reported.",
)  # fmt: skip
def spark(rows: int, size: int, runs: int) -> None:
    """Spark on the bus: a streaming read of a meshbus stream into the noop sink against
    the same rows read from Parquet in the same session (the physical reference), and
    a streaming write from Spark to the bus. local[2], trigger(availableNow=True).

    `read` is the default (tasks read the broker's store file, which is on this machine);
    `read_bus` fetches every page from the broker (localRead=false).

    `ceiling` is a Python source that reads nothing (one prebuilt Arrow batch, yielded over
    and over): what Spark's Python data source path alone allows.

    Needs Java and the spark extra. Last line: `read=<rows/s> read_bus=<rows/s> parquet=<rows/s>
    read_ratio=<meshbus/parquet> ceiling=<rows/s> ceiling_ratio=<ceiling/parquet> write=<rows/s>
    empty_query_s=<s>`.
    """
    from bench.report import key_values, new_table, print_tables

    figures = bench_spark(rows, size, runs=runs)
    table = new_table(
        f"spark: {rows:,} rows x {size} B, local[2], medians of {runs}", ("what", "value")
    )
    for key, value in figures.items():
        table.add_row(key, f"{value:,.3f}" if value < 100 else f"{value:,.0f}")
    print_tables(table)
    click.echo(
        key_values(
            read=f"{figures['meshbus_read_rows_per_s']:.0f}",
            read_bus=f"{figures['meshbus_bus_read_rows_per_s']:.0f}",
            parquet=f"{figures['parquet_read_rows_per_s']:.0f}",
            read_ratio=f"{figures['read_vs_parquet']:.3f}",
            ceiling=f"{figures['python_ceiling_rows_per_s']:.0f}",
            ceiling_ratio=f"{figures['ceiling_vs_parquet']:.3f}",
            write=f"{figures['meshbus_write_rows_per_s']:.0f}",
            empty_query_s=f"{figures['empty_query_s']:.2f}",
        )
    )
