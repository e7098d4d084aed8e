"""The options of the ``meshbus`` Spark data source, parsed and checked on the driver.

Spark hands a data source its options as strings in a case-insensitive map. Every
option is parsed here, once, into frozen dataclasses that travel to the executors
inside the reader, the writer and their partitions; a bad value fails on the driver
with a ``ValueError`` that names the option and what it accepts (the user's mistake,
like ``Address.parse``'s), never later in a task.

The option names are the ones documented in docs/spark.md; Spark matches them
without regard to case.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from meshbus.address import Address, Unicast
from meshbus.client.brokers import broker_list
from meshbus.protocol.batch import MAX_ROWS

PREFIX = "meshbus data source"


def option_error(message: str) -> ValueError:
    return ValueError(f"{PREFIX}: {message}")


@dataclass(frozen=True)
class BusOptions:
    """How to reach the mesh: every reader and writer connects with these."""

    brokers: str  # HOST:PORT[,HOST:PORT...]
    server: str  # the server name of the connector's dynamic address
    connect_timeout: float
    request_timeout: float  # one stream request (info, fetch)
    # Paths, opened where each connector is made -- on the driver and on every executor,
    # so the files must exist on each (docs/spark.md). None: no credentials (or the file
    # MESHBUS_CREDS names); no TLS unless one of the TLS files is given.
    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None


@dataclass(frozen=True)
class ReadOptions:
    bus: BusOptions
    stream: str
    starting_seq: int | None  # None: starting_latest says earliest or latest
    starting_latest: bool
    ending_seq: int | None  # batch only; None: last_seq when the read is planned
    max_rows_per_trigger: int | None
    rows_per_partition: int
    min_partitions: int
    fetch_size: int
    fail_on_data_loss: bool
    local_read: str  # "auto", "true" or "false" (docs/spark.md)


@dataclass(frozen=True)
class WriteOptions:
    bus: BusOptions
    address: str | None  # the text form; None: every row has an `address` column
    write_id: str | None  # batch writes; None: one made up per save()
    ack_timeout: float
    max_batch_rows: int  # rows per batch frame, at most (fewer when max_frame is reached)


class _Options:
    """A lowered copy of Spark's options with typed getters that explain bad values."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self._values = {str(k).lower(): str(v) for k, v in options.items()}

    def has(self, name: str) -> bool:
        return name.lower() in self._values

    def text(self, name: str) -> str | None:
        value = self._values.get(name.lower())
        if value is None:
            return None
        value = value.strip()
        return value or None

    def required(self, name: str, what: str) -> str:
        value = self.text(name)
        if value is None:
            raise option_error(f"option '{name}' is required: {what}")
        return value

    def integer(self, name: str, default: int | None, minimum: int = 1) -> int | None:
        text = self.text(name)
        if text is None:
            return default
        try:
            value = int(text)
        except ValueError:
            raise option_error(f"option '{name}' must be an integer, got {text!r}") from None
        if value < minimum:
            raise option_error(f"option '{name}' must be at least {minimum}, got {value}")
        return value

    def count(self, name: str, default: int) -> int:
        value = self.integer(name, default)
        assert value is not None
        return value

    def seconds(self, name: str, default: float) -> float:
        text = self.text(name)
        if text is None:
            return default
        try:
            value = float(text)
        except ValueError:
            raise option_error(
                f"option '{name}' must be a number of seconds, got {text!r}"
            ) from None
        if not (value > 0 and math.isfinite(value)):
            raise option_error(f"option '{name}' must be a positive number of seconds, got {text}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        text = self.text(name)
        if text is None:
            return default
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise option_error(f"option '{name}' must be true or false, got {text!r}")


def parse_bus(options: Mapping[str, str]) -> BusOptions:
    opts = _Options(options)
    brokers = opts.required("brokers", "the mesh to connect to, as HOST:PORT[,HOST:PORT...]")
    try:
        broker_list(brokers)
    except ValueError as exc:
        raise option_error(f"option 'brokers': {exc}") from None
    server = opts.text("server") or "spark"
    try:
        Unicast(server, 1)
    except ValueError as exc:
        raise option_error(f"option 'server': {exc}") from None
    tls_cert, tls_key = opts.text("tlsCert"), opts.text("tlsKey")
    if bool(tls_cert) != bool(tls_key):
        raise option_error("options 'tlsCert' and 'tlsKey' go together: give both, or neither")
    return BusOptions(
        brokers=brokers,
        server=server,
        connect_timeout=opts.seconds("connectTimeout", 10.0),
        request_timeout=opts.seconds("requestTimeout", 60.0),
        creds=opts.text("creds"),
        tls_ca=opts.text("tlsCa"),
        tls_cert=tls_cert,
        tls_key=tls_key,
    )


def parse_read(options: Mapping[str, str], *, streaming: bool | None) -> ReadOptions:
    """Every read option. ``streaming`` says which of them apply; None (at ``load()``,
    before Spark says which kind of read it is) checks what both kinds accept."""
    opts = _Options(options)
    bus = parse_bus(options)
    stream = opts.required("stream", "the name of the durable stream to read")
    starting_seq = opts.integer("startingSeq", None)
    starting = (opts.text("startingOffsets") or "earliest").lower()
    if starting not in ("earliest", "latest"):
        raise option_error(
            f"option 'startingOffsets' must be 'earliest' or 'latest', got {starting!r} "
            "(use 'startingSeq' to start at a sequence number)"
        )
    if starting_seq is not None and opts.has("startingOffsets"):
        raise option_error("give 'startingSeq' or 'startingOffsets', not both")
    if starting == "latest" and streaming is False:
        raise option_error(
            "a batch read starts at 'earliest' or at a 'startingSeq'; "
            "startingOffsets=latest would read nothing"
        )
    ending_seq = opts.integer("endingSeq", None)
    if streaming is True and ending_seq is not None:
        raise option_error("'endingSeq' is for batch reads (spark.read); a stream has no end")
    if ending_seq is not None and starting_seq is not None and ending_seq < starting_seq:
        raise option_error(f"'endingSeq' ({ending_seq}) is before 'startingSeq' ({starting_seq})")
    local_read = (opts.text("localRead") or "auto").lower()
    if local_read not in ("auto", "true", "false"):
        raise option_error(f"option 'localRead' must be auto, true or false, got {local_read!r}")
    max_rows = opts.integer("maxRowsPerTrigger", None)
    if max_rows is not None and streaming is False:
        raise option_error("'maxRowsPerTrigger' is for streaming reads (spark.readStream)")
    return ReadOptions(
        bus=bus,
        stream=stream,
        starting_seq=starting_seq,
        starting_latest=starting == "latest",
        ending_seq=ending_seq,
        max_rows_per_trigger=max_rows,
        rows_per_partition=opts.count("rowsPerPartition", 100_000),
        min_partitions=opts.count("minPartitions", 1),
        fetch_size=opts.count("fetchSize", 4000),
        fail_on_data_loss=opts.boolean("failOnDataLoss", False),
        local_read=local_read,
    )


def parse_write(options: Mapping[str, str]) -> WriteOptions:
    opts = _Options(options)
    bus = parse_bus(options)
    address = opts.text("address")
    if address is not None:
        address = check_address(address, "option 'address'")
    return WriteOptions(
        bus=bus,
        address=address,
        write_id=opts.text("writeId"),
        ack_timeout=opts.seconds("ackTimeout", 60.0),
        max_batch_rows=_max_batch_rows(opts.count("maxBatchRows", MAX_ROWS)),
    )


def check_address(text: str, what: str) -> str:
    """The canonical text form of an address as the CLI takes it (``game01:5``,
    ``multicast:NAME``, ``anycast:NAME``, ``unicast:SERVER:N``); ValueError if bad."""
    try:
        return str(Address.parse(text))
    except ValueError as exc:
        raise option_error(f"{what}: {exc}") from None


def _max_batch_rows(rows: int) -> int:
    if not 1 <= rows <= MAX_ROWS:
        raise option_error(
            f"option 'maxBatchRows' must be 1 to {MAX_ROWS} (the rows a batch frame may "
            f"carry), got {rows}"
        )
    return rows
