"""Writing rows to an address on the bus, in batches and from streaming queries.

Each Spark task opens a connector, registers one service (``SERVER:65536`` and
up) and sends every row of its partition reliably, in *batch frames*
(``Service.send_batch``, docs/protocol.md §4.9): up to ``maxBatchRows`` rows to one
address in a frame, acknowledged and resent as one message, each row delivered
(and stored by a stream) as a message of its own. The task returns -- and Spark
may commit the batch -- only once every receiving connector (every member, for a
multicast address) has acknowledged every frame, or it fails with the
``DeliveryFailed`` of the first frame given up. Frames are not awaited one by
one: up to 16 are in flight. Rows of a DataFrame with a ``group`` column go one
frame each, as ``send(..., group=...)``: each takes its own place in its group.

Every row carries a publish id, so that a retried task or a replayed micro-batch
is delivered (and stored by a stream) once: a receiving connector drops a publish
id it has already delivered to that service within its dedupe window, and a
stream stores it once within the stream's ``dedupe_window``. The id is
``blake2b(scope, 16 bytes) + row index (8 bytes)`` where the scope is

* streaming: (query id, batch id, partition id) -- the query id is kept in the
  checkpoint, so a micro-batch replayed after a restart gets the same ids;
* batch: (``writeId``, partition id) -- ``writeId`` defaults to a fresh id made
  on the driver per ``save()``, the same for every task and every retry of it.

Both assume a replay puts the same rows in the same partitions in the same order,
which a deterministic plan over a replayable source (a meshbus stream, files)
does. When it may not (a shuffle before the write, a non-deterministic source),
give each row its own id in a ``publish_id`` column.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
)

import meshbus
from meshbus.address import Address, Anycast
from meshbus.errors import DeliveryFailed, MeshbusError, Timeout
from meshbus.protocol.batch import RowTuple
from meshbus.spark import bus
from meshbus.spark.options import PREFIX, WriteOptions, check_address, option_error

log = logging.getLogger("meshbus.spark")

_TEXT = (BinaryType(), StringType())
_INTEGER = (ByteType(), ShortType(), IntegerType(), LongType())
# The columns the writer reads (any others are ignored): the types each may have,
# and what it is, for the error messages. A string payload is sent as UTF-8.
INPUT_COLUMNS: dict[str, tuple[tuple[DataType, ...], str]] = {
    "payload": (_TEXT, "the message"),
    "address": ((StringType(),), "where the row goes"),
    "group": ((StringType(),), "the row's message group"),
    "final": ((BooleanType(),), "whether the row ends its group"),
    "priority": (_INTEGER, "the message's priority"),
    "publish_id": (_TEXT, "the row's own publish id"),
}


@dataclass(frozen=True)
class Layout:
    """Which of the input's columns the writer reads (others are ignored)."""

    columns: tuple[str, ...]
    payload_text: bool
    publish_id_text: bool

    def has(self, name: str) -> bool:
        return name in self.columns


def plan(schema: StructType, options: WriteOptions) -> Layout:
    """Check the DataFrame's columns against the options, on the driver."""
    fields = {f.name: f.dataType for f in schema.fields}
    if "payload" not in fields:
        raise option_error(
            "writing needs a 'payload' column (binary, or string sent as UTF-8); "
            f"the DataFrame has {', '.join(fields) or 'no columns'}"
        )
    for name, (kinds, what) in INPUT_COLUMNS.items():
        if name in fields and fields[name] not in kinds:
            allowed = " or ".join(k.simpleString() for k in kinds)
            raise option_error(
                f"column {name!r} ({what}) must be {allowed}, not {fields[name].simpleString()}"
            )
    if options.address is None and "address" not in fields:
        raise option_error(
            "where to send? Give the 'address' option (e.g. multicast:results) "
            "or an 'address' string column"
        )
    if (
        "group" in fields
        and options.address is not None
        and "address" not in fields
        and not isinstance(Address.parse(options.address), Anycast)
    ):
        raise option_error(
            f"a 'group' column needs an anycast address; {options.address} is not one"
        )
    return Layout(
        columns=tuple(n for n in INPUT_COLUMNS if n in fields),
        payload_text=fields["payload"] == StringType(),
        publish_id_text=fields.get("publish_id") == StringType(),
    )


def id_prefix(*scope: object) -> bytes:
    return hashlib.blake2b("/".join(map(str, scope)).encode(), digest_size=16).digest()


@dataclass
class Sent(WriterCommitMessage):
    """One task's report: rows sent, and of those the ones sent to a multicast
    address nobody was a member of (nothing to deliver, so nothing to wait for)."""

    partition: int
    rows: int
    unheard: int


async def send_partition(
    options: WriteOptions,
    layout: Layout,
    batches: Iterator[pa.RecordBatch],
    prefix: bytes,
    partition: int,
) -> Sent:
    """Send every row of ``batches``; return once all are acknowledged."""
    loop = asyncio.get_running_loop()
    # The event loop keeps running while Spark computes the next input batch (pulled in
    # a thread): acks are taken meanwhile, and nothing is resent for want of a turn.
    conn = await bus.connect(options.bus, keepalive=1.0)
    failed: list[DeliveryFailed] = []
    conn.on_delivery_failed(failed.append)
    rows = _Rows(options, layout, prefix)
    try:
        service = await conn.register()
        while (batch := await loop.run_in_executor(None, next, batches, None)) is not None:
            if layout.has("group"):
                await rows.send_one_by_one(service, batch)
            else:
                await rows.send_batched(service, batch)
        try:
            await conn.wait_acked(options.ack_timeout)
        except TimeoutError:
            raise Timeout(
                f"{PREFIX}: {conn.unacked} of {rows.frames} frames ({rows.sent} rows) were not "
                f"acknowledged within {options.ack_timeout} s (option 'ackTimeout')",
                options.ack_timeout,
            ) from None
        if failed:
            first = failed[0]
            raise DeliveryFailed(
                f"{PREFIX}: {len(failed)} of {rows.frames} frames ({rows.sent} rows) were never "
                f"acknowledged; the first: {first}",
                first.address,
                first.msg_id,
            )
    except MeshbusError as exc:
        bus.reraise(exc, options.bus, f"sending partition {partition}")
    finally:
        await conn.close()
    return Sent(partition, rows.sent, rows.unheard)


class _Rows:
    """One task's rows on their way: each gets the next index of the partition, which
    makes its derived publish id."""

    def __init__(self, options: WriteOptions, layout: Layout, prefix: bytes) -> None:
        self.options = options
        self.layout = layout
        self.prefix = prefix
        self.default = Address.parse(options.address) if options.address else None
        self.addresses: dict[str, Address] = {}
        self.sent = 0  # rows
        self.frames = 0
        self.unheard = 0  # rows sent to a multicast address without members

    def _address(self, text: str | None, row: int) -> Address:
        dst = self.default
        if text is not None:
            dst = self.addresses.get(text)
            if dst is None:
                dst = self.addresses[text] = Address.parse(
                    check_address(text, f"row {row}: column 'address'")
                )
        if dst is None:
            raise ValueError(f"{PREFIX}: row {row} has no address")
        return dst

    def _payloads(self, batch: pa.RecordBatch) -> list[bytes]:
        column = batch.column("payload")
        if column.null_count:
            row = self.sent + column.to_pylist().index(None)
            raise ValueError(f"{PREFIX}: row {row} has a null payload")
        if self.layout.payload_text:  # UTF-8 already: the same buffers, seen as bytes
            column = column.cast(pa.binary())
        payloads: list[bytes] = column.to_pylist()
        return payloads

    def _publish_ids(self, batch: pa.RecordBatch) -> list[bytes]:
        prefix, first = self.prefix, self.sent
        derived = [prefix + i.to_bytes(8, "big") for i in range(first, first + batch.num_rows)]
        if not self.layout.has("publish_id"):
            return derived
        given = batch.column("publish_id")
        if self.layout.publish_id_text:
            given = given.cast(pa.binary())
        return [own or made for own, made in zip(given.to_pylist(), derived, strict=True)]

    async def send_batched(self, service: meshbus.Service, batch: pa.RecordBatch) -> None:
        """Rows in batch frames of at most ``maxBatchRows`` rows: a run of rows to one
        address at a time, so rows keep their order per address."""
        payloads = self._payloads(batch)
        ids = self._publish_ids(batch)
        rows: list[RowTuple]
        if self.layout.has("priority"):
            priorities = [p or 0 for p in batch.column("priority").to_pylist()]
            rows = list(zip(payloads, ids, priorities, strict=True))
        else:
            rows = list(zip(payloads, ids, strict=True))
        if self.layout.has("address"):
            runs = _runs(batch.column("address").to_pylist())
        else:
            runs = [(None, 0, len(rows))]
        step = self.options.max_batch_rows
        for text, start, stop in runs:
            dst = self._address(text, self.sent + start)
            for lo in range(start, stop, step):
                chunk = rows[lo : min(lo + step, stop)]
                for msg_id, count in await service.send_batch(dst, chunk):
                    self.frames += 1
                    self.unheard += count if msg_id == 0 else 0
        self.sent += len(rows)

    async def send_one_by_one(self, service: meshbus.Service, batch: pa.RecordBatch) -> None:
        """A frame per row, for a DataFrame with a ``group`` column: every message of a
        message group takes its own place in the group's order."""
        layout = self.layout
        payloads = self._payloads(batch)
        ids = self._publish_ids(batch)
        columns = {name: batch.column(name).to_pylist() for name in layout.columns}
        for i in range(batch.num_rows):
            row = self.sent
            dst = self._address(columns["address"][i] if layout.has("address") else None, row)
            group = columns["group"][i]
            if group is not None and not isinstance(dst, Anycast):
                raise ValueError(
                    f"{PREFIX}: row {row} is in message group {group!r}, so it must go "
                    f"to an anycast address, not {dst}"
                )
            msg_id = await service.send(
                dst,
                payloads[i],
                reliable=True,
                group=group,
                final=bool(group is not None and layout.has("final") and columns["final"][i]),
                priority=(columns["priority"][i] or 0) if layout.has("priority") else 0,
                publish_id=ids[i],
            )
            self.sent += 1
            self.frames += 1
            self.unheard += msg_id == 0


def _runs(values: list[str | None]) -> list[tuple[str | None, int, int]]:
    """(value, start, stop) of each run of equal values, in order."""
    runs = []
    start = 0
    for value, run in itertools.groupby(values):
        stop = start + sum(1 for _ in run)
        runs.append((value, start, stop))
        start = stop
    return runs


def _run_task(
    options: WriteOptions, layout: Layout, batches: Iterator[pa.RecordBatch], *scope: object
) -> Sent:
    context = TaskContext.get()
    partition = context.partitionId() if context is not None else 0
    prefix = id_prefix(*scope, partition)
    with bus.runner() as run:
        return run.run(send_partition(options, layout, iter(batches), prefix, partition))


def _report(messages: list[WriterCommitMessage | None], what: str) -> None:
    done = [m for m in messages if isinstance(m, Sent)]
    rows = sum(m.rows for m in done)
    unheard = sum(m.unheard for m in done)
    log.info("%s: %d rows sent by %d tasks", what, rows, len(done))
    if unheard:
        log.warning("%s: %d rows went to a multicast address nobody was a member of", what, unheard)


class BatchWriter(DataSourceArrowWriter):
    """``df.write.format("meshbus")...save()``."""

    def __init__(self, options: WriteOptions, schema: StructType) -> None:
        self.options = options
        self.layout = plan(schema, options)
        bus.check_reachable(options.bus)
        # Made here, on the driver, once per save(): the tasks get a pickled copy, so
        # every task and every retry of one uses the same id.
        self.write_id = options.write_id or uuid.uuid4().hex
        log.info("meshbus write %s to %s", self.write_id, options.address or "per-row addresses")

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Sent:
        return _run_task(self.options, self.layout, iterator, "write", self.write_id)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        _report(messages, f"meshbus write {self.write_id}")

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        log.warning(
            "meshbus write %s failed; rows already acknowledged stay delivered, and running "
            "it again with option writeId=%s delivers only the rest",
            self.write_id,
            self.write_id,
        )


class StreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("meshbus")``: created again, on the driver, for every
    micro-batch's commit, so it holds only the parsed options and the column plan."""

    def __init__(self, options: WriteOptions, schema: StructType) -> None:
        self.options = options
        self.layout = plan(schema, options)
        bus.check_reachable(options.bus)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Sent:
        context = TaskContext.get()
        query = context.getLocalProperty("sql.streaming.queryId") if context else None
        batch = context.getLocalProperty("streaming.sql.batchId") if context else None
        if query is None or batch is None:
            raise RuntimeError(f"{PREFIX}: a stream writer ran outside a streaming query")
        return _run_task(self.options, self.layout, iterator, "stream", query, batch)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _report(messages, f"meshbus micro-batch {batchId}")

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.warning(
            "meshbus micro-batch %d failed; when the query runs it again, rows already "
            "delivered are dropped by their publish ids",
            batchId,
        )
