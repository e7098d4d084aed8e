"""Reading a durable stream into Spark, in batches and as a stream.

A stream numbers its messages 1, 2, 3, ... with no gaps, and retention only ever
removes the oldest (store.py), so a sequence number is all an offset needs to be:
``{"stream": NAME, "next_seq": N}``, the first seq not read yet. A micro-batch is
the half-open range [start.next_seq, end.next_seq); Spark writes the end of every
batch to its checkpoint before running it and replays an uncommitted batch with
the same offsets after a restart, so ``read`` must return exactly the same rows
for a range every time -- and it does, since stored messages never change.

Trimmed messages: a stream with ``max_msgs``/``max_bytes``/``max_age`` may have
dropped the start of a range before it was read (``first_seq`` moved past it).
The broker's fetch starts at ``first_seq`` then, so the read skips ahead; the
driver logs how many were lost, and ``failOnDataLoss=true`` fails the query
instead.

Every range is split into partitions of at most ``rowsPerPartition`` rows (at
least ``minPartitions`` of them), each read by one Spark task with its own
connector, page by page (``fetchSize`` rows a request). The request for the next
page goes out before the current page is handed to Spark, so the broker works
while Spark converts.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    DataType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from meshbus.address import Address
from meshbus.client.streams import StreamInfo
from meshbus.errors import StreamError
from meshbus.protocol.blocks import Block, BlockSlice
from meshbus.protocol.headers import decode_headers
from meshbus.spark import bus
from meshbus.spark.options import PREFIX, ReadOptions, option_error

log = logging.getLogger("meshbus.spark")

# name -> (type, nullable). Only `group` may be empty: a message outside any group.
COLUMNS: dict[str, tuple[DataType, bool]] = {
    "stream": (StringType(), False),
    "seq": (LongType(), False),
    "stored_at": (TimestampType(), False),
    "src": (StringType(), False),
    "dst": (StringType(), False),
    "group": (StringType(), True),
    "priority": (IntegerType(), False),
    "payload": (BinaryType(), False),
    # The sender's headers (Message.headers); null for a message without any.
    "headers": (MapType(StringType(), StringType()), True),
}
SCHEMA = StructType([StructField(name, kind, null) for name, (kind, null) in COLUMNS.items()])


def check_schema(schema: StructType) -> None:
    """A schema given with ``.schema(...)`` may pick and order columns, not change them."""
    for field in schema.fields:
        known = COLUMNS.get(field.name)
        if known is None:
            raise option_error(
                f"the stream has no column {field.name!r}; its columns are "
                f"{', '.join(COLUMNS)} (docs/spark.md)"
            )
        if field.dataType != known[0]:
            raise option_error(
                f"column {field.name!r} is {known[0].simpleString()}, "
                f"not {field.dataType.simpleString()}"
            )


# -- offsets and ranges --------------------------------------------------------------


def offset(stream: str, next_seq: int) -> dict[str, Any]:
    return {"stream": stream, "next_seq": next_seq}


def next_seq_of(stream: str, value: dict[str, Any]) -> int:
    if value.get("stream") != stream or not isinstance(value.get("next_seq"), int):
        raise option_error(
            f"the checkpoint holds offset {value} of another stream than {stream!r}; "
            "reading another stream needs a new checkpointLocation"
        )
    seq: int = value["next_seq"]
    return seq


@dataclass
class SeqRange(InputPartition):
    """What one Spark task reads: seqs [start, stop) of a stream, and how to get them
    (a task runs in another process, from a pickled copy)."""

    options: ReadOptions
    columns: tuple[str, ...]
    start: int
    stop: int


def split(options: ReadOptions, columns: tuple[str, ...], start: int, stop: int) -> list[SeqRange]:
    """[start, stop) in ``minPartitions`` or more near-equal parts of at most
    ``rowsPerPartition`` rows; none for an empty range."""
    count = stop - start
    if count <= 0:
        return []
    parts = max(options.min_partitions, math.ceil(count / options.rows_per_partition))
    parts = min(parts, count)
    bounds = [start + count * i // parts for i in range(parts + 1)]
    return [SeqRange(options, columns, a, b) for a, b in itertools.pairwise(bounds)]


# -- reading a range ------------------------------------------------------------------


@dataclass
class _View:
    """The messages ``lo``..``lo + count - 1`` of a decoded block that a range wants."""

    block: Block
    lo: int
    count: int
    stored_at: float


def to_batch(part: SeqRange, pieces: list[BlockSlice], schema: pa.Schema) -> pa.RecordBatch:
    """The messages of ``pieces`` (consecutive slices of blocks) inside ``part`` as one
    Arrow batch of the wanted columns, built from the blocks' buffers and distinct
    values: no Python object per message, and a few Arrow calls per block."""
    views = []
    for piece in pieces:
        lo = max(piece.start, part.start - piece.first_seq)
        hi = min(piece.stop, part.stop - piece.first_seq)
        views.append(_View(piece.block(), lo, hi - lo, piece.stored_at))
    total = sum(view.count for view in views)
    first = pieces[0].first_seq + views[0].lo
    arrays: list[pa.Array] = []
    for name in part.columns:
        kind = schema.field(name).type
        if name == "stream":
            array = pa.repeat(pa.scalar(part.options.stream, kind), total)
        elif name == "seq":  # a running sum in C: pa.array(range(...)) took 60 ns a row
            import pyarrow.compute as pc  # here: see _read_local

            ones = pa.repeat(pa.scalar(1, kind), total)
            array = pc.cumulative_sum(ones, start=pa.scalar(first - 1, kind))
        elif name == "stored_at":
            array = _runs(kind, [(round(v.stored_at * 1_000_000), v.count) for v in views])
        elif name == "payload":
            array = _concat(
                [
                    pa.Array.from_buffers(
                        kind,
                        v.count,
                        [None, pa.py_buffer(v.block.offsets), pa.py_buffer(v.block.payloads)],
                        offset=v.lo,
                    )
                    for v in views
                ]
            )
        elif name == "headers":
            array = _headers_column(kind, views)
        else:
            array = _dictionary_column(kind, views, _DICTIONARY_COLUMNS[name])
        arrays.append(array)
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _dictionary_column(
    kind: pa.DataType,
    views: list[_View],
    column: Callable[[Block], tuple[Sequence[object], memoryview]],
) -> pa.Array:
    parts = [(*column(v.block), v) for v in views]
    if not any(index for _, index, _ in parts):  # one value a block: the usual case
        return _runs(kind, [(values[0], v.count) for values, _, v in parts])
    arrays = []
    for values, index, v in parts:
        if not index:
            arrays.append(pa.repeat(pa.scalar(values[0], kind), v.count))
        else:
            positions = [None, pa.py_buffer(index)]
            taken = pa.Array.from_buffers(pa.uint32(), v.count, positions, offset=v.lo)
            arrays.append(pa.array(values, kind).take(taken))
    return _concat(arrays)


def _headers_column(kind: pa.DataType, views: list[_View]) -> pa.Array:
    """Nulls for the blocks without headers (the usual case: no work per message); the
    decoded header blocks of the others."""
    arrays = []
    for v in views:
        if v.block.header_offsets is None:
            arrays.append(pa.nulls(v.count, kind))
        else:
            blocks = v.block.header_list(v.lo, v.lo + v.count)
            arrays.append(pa.array([decode_headers(h) if h else None for h in blocks], kind))
    return _concat(arrays)


def _runs(kind: pa.DataType, runs: list[tuple[object, int]]) -> pa.Array:
    """Each value ``count`` times, in order; one repeat when all are the same value."""
    first = runs[0][0]
    if all(value == first for value, _ in runs):
        return pa.repeat(pa.scalar(first, kind), sum(count for _, count in runs))
    return _concat([pa.repeat(pa.scalar(value, kind), count) for value, count in runs])


def _concat(arrays: list[pa.Array]) -> pa.Array:
    return arrays[0] if len(arrays) == 1 else pa.concat_arrays(arrays)


# A stream's messages come from few addresses and groups: their text forms, once each.
@functools.lru_cache(maxsize=65536)
def _address_text(raw: bytes) -> str:
    return str(Address.from_bytes(raw))


@functools.lru_cache(maxsize=65536)
def _group_text(raw: bytes) -> str | None:
    return raw.decode("utf-8", "replace") if raw else None


# A dictionary-encoded column: the block's distinct values (as Spark wants them) and
# its index per message.
_DICTIONARY_COLUMNS: dict[str, Callable[[Block], tuple[Sequence[object], memoryview]]] = {
    "src": lambda b: (list(map(_address_text, b.src_values)), b.src_index),
    "dst": lambda b: (list(map(_address_text, b.dst_values)), b.dst_index),
    "group": lambda b: (list(map(_group_text, b.group_values)), b.group_index),
    "priority": lambda b: (b.priority_values, b.priority_index),
}


def read_range(part: SeqRange) -> Iterator[pa.RecordBatch]:
    """The messages of ``part`` in seq order, one Arrow batch per page: read from the
    host broker's store file when it is on this machine (``localRead``), else fetched
    from the broker, the next page asked for before this one is yielded."""
    opts = part.options
    schema = to_arrow_schema(
        StructType([StructField(n, COLUMNS[n][0], COLUMNS[n][1]) for n in part.columns]),
        timezone="UTC",
    )
    store = _local_store(opts)
    if store is not None:
        yield from _read_local(part, store, schema)
        return
    doing = f"reading stream {opts.stream!r} seqs {part.start}..{part.stop - 1}"

    with bus.runner() as run:
        conn = run.run(bus.connect(opts.bus))

        def page(first: int) -> asyncio.Task[list[BlockSlice]]:
            want = min(opts.fetch_size, part.stop - first)
            return run.get_loop().create_task(conn.streams.fetch_blocks(opts.stream, first, want))

        pending: asyncio.Task[list[BlockSlice]] | None = None
        try:
            pending = page(part.start)
            expected = part.start
            while pending is not None:
                # The deadline runs from here, not from the request: while Spark holds a
                # page the loop is stopped, and that time is not the broker's.
                fetched = run.run(bus.ask(opts.bus, _wait(pending), doing))
                pending = None
                pieces, expected = _accept(part, fetched, expected)
                if not pieces:
                    break
                if expected < part.stop:
                    pending = page(expected)
                    run.run(_started())  # the request is written before Spark takes the page
                yield to_batch(part, pieces, schema)
        finally:
            if pending is not None:
                pending.cancel()
            run.run(conn.close())


def _accept(
    part: SeqRange, pieces: list[BlockSlice], expected: int
) -> tuple[list[BlockSlice], int]:
    """Which of a page's blocks hold messages of ``part``, and the seq to read next; a
    page that starts past ``expected`` lost messages to retention."""
    inside = [piece for piece in pieces if piece.seqs.start < part.stop]
    if not inside:
        return [], expected  # trimmed past the end of the range
    if inside[0].seqs.start != expected:
        _data_loss(part.options, expected, inside[0].seqs.start)
    return inside, min(inside[-1].seqs.stop, part.stop)


def _local_store(opts: ReadOptions) -> str | None:
    """The host broker's store file when this task can read it itself: same machine,
    file readable, and ``localRead`` not false. ``localRead=true`` insists."""
    if opts.local_read == "false":
        return None
    info = bus.stream_info(opts.bus, opts.stream)
    here = info.host == socket.gethostname() and bool(info.store)
    if here and os.access(info.store, os.R_OK):
        return info.store
    if opts.local_read == "true":
        raise option_error(
            f"localRead=true, but stream {opts.stream!r} is "
            + (f"in {info.store}, which this process cannot read" if here else
               f"on broker {info.broker}, not in a store file on this machine")
        )  # fmt: skip
    return None


def _read_local(part: SeqRange, store: str, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """``read_range`` from the broker's SQLite file (read-only; WAL lets the broker go
    on writing): no broker work, no socket, the pages packed here."""
    opts = part.options
    # Imported where a task uses it, not with the module: Spark starts a fresh Python
    # process per streaming query for the source's offsets, and its imports are part of
    # every query's start (this and pyarrow.compute were 60 ms of it, BENCHMARKS.md).
    from meshbus.storage.sqlite import SqliteStreamReader

    reader = SqliteStreamReader(store)
    try:
        expected = part.start
        while expected < part.stop:
            want = min(opts.fetch_size, part.stop - expected)
            page = reader.read_blocks(opts.stream, expected, want)
            pieces, expected = _accept(part, page, expected)
            if not pieces:
                break
            yield to_batch(part, pieces, schema)
    finally:
        reader.close()


async def _wait(task: asyncio.Task[list[BlockSlice]]) -> list[BlockSlice]:
    return await task


async def _started() -> None:
    """One loop turn: a task created just before has run up to its first wait."""


def _data_loss(opts: ReadOptions, wanted: int, first: int) -> None:
    message = (
        f"{PREFIX}: stream {opts.stream!r} no longer holds seqs {wanted}..{first - 1} "
        f"(retention removed them before they were read)"
    )
    if opts.fail_on_data_loss:
        raise StreamError(message + "; failOnDataLoss=true stops the query")
    log.warning("%s; skipping ahead to %d", message, first)


# -- batch reads -----------------------------------------------------------------------


class BatchReader(DataSourceReader):
    """``spark.read``: seqs ``startingSeq`` (default the first one kept) through
    ``endingSeq`` (default the last one when the read is planned), inclusive."""

    def __init__(self, options: ReadOptions, schema: StructType) -> None:
        check_schema(schema)
        self.options = options
        self.columns = tuple(schema.fieldNames())
        info = bus.stream_info(options.bus, options.stream)
        self.start = options.starting_seq or info.first_seq
        if self.start < info.first_seq:
            _data_loss(options, self.start, info.first_seq)
            self.start = info.first_seq
        last = info.last_seq if options.ending_seq is None else options.ending_seq
        # Rows appended after planning are not read, even below endingSeq: every task
        # and every retry of one then reads the same rows.
        self.stop = min(last, info.last_seq) + 1

    def partitions(self) -> Sequence[InputPartition]:
        return split(self.options, self.columns, self.start, self.stop)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, SeqRange):
            return iter(())  # Spark's stand-in partition for an empty read
        return read_range(partition)


# -- streaming reads -------------------------------------------------------------------


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream``: offsets from the host broker's counters. The reader lives in
    one long-lived driver process per query; ``read`` runs in the tasks."""

    def __init__(self, options: ReadOptions, schema: StructType) -> None:
        check_schema(schema)
        self.options = options
        self.columns = tuple(schema.fieldNames())
        self._initial: int | None = None
        self._target: int | None = None  # Trigger.AvailableNow: stop at this next_seq
        self._latest: int | None = None

    def _info(self) -> StreamInfo:
        return bus.stream_info(self.options.bus, self.options.stream)

    def initialOffset(self) -> dict[str, Any]:
        # Asked more than once per run: "latest" must give the same answer each time.
        if self._initial is None:
            info = self._info()
            start = self.options.starting_seq
            if start is None:
                start = info.last_seq + 1 if self.options.starting_latest else info.first_seq
            elif start > info.last_seq + 1:
                raise option_error(
                    f"startingSeq {start} is past the end of stream {self.options.stream!r} "
                    f"(last_seq {info.last_seq}); startingOffsets=latest reads only new messages"
                )
            self._initial = start
        return offset(self.options.stream, self._initial)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.options.max_rows_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.options.max_rows_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._info().last_seq + 1

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        begin = next_seq_of(self.options.stream, start)
        info = self._info()
        end = info.last_seq + 1
        self._latest = end
        if begin > end:
            raise StreamError(
                f"{PREFIX}: the checkpoint is at seq {begin} but stream {self.options.stream!r} "
                f"ends at {info.last_seq}: was the stream deleted and created again? "
                "Reading it from the start needs a new checkpointLocation"
            )
        if begin < info.first_seq and end > begin:
            _data_loss(self.options, begin, info.first_seq)
        if self._target is not None:
            end = min(end, self._target)
        if isinstance(limit, ReadMaxRows):
            # Count only rows still there: a trimmed stretch costs the batch nothing.
            end = min(end, max(begin, info.first_seq) + limit.max_rows)
        return offset(self.options.stream, max(begin, end))

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return None if self._latest is None else offset(self.options.stream, self._latest)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        stream = self.options.stream
        return split(
            self.options, self.columns, next_seq_of(stream, start), next_seq_of(stream, end)
        )

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SeqRange)
        return read_range(partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to release: Spark's checkpoint is the only cursor."""
