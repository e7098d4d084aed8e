"""`python -m bench stream`: durable stream appends and reads, against NATS JetStream.

Append: one publisher sends ``--count`` messages reliably to a multicast address a
stream captures, each ``send(..., reliable=True)`` right after the previous one, then
waits until all are acknowledged (``wait_acked``); a broker acknowledges a message once
its group commit has stored it. The figure is acknowledged messages per second, the
publisher on the stream's own broker. JetStream does the same with at most 256
publishes in flight (``jetstream_append``).

Append over the wire (``append_wire``): the same acknowledged appends, driven the way
the JetStream driver drives nats-server -- the raw protocol on one link, every frame
encoded before the clock starts, at most ``_NATS_WINDOW`` unacknowledged -- so the
figure is the broker's and the pair ``append_wire``/``nats_append`` compares servers
alone. ``append`` is what an application gets through the client library.

Fetch: a second link reads the stream back from seq 1 with ``streams.fetch`` in
requests of ``--batch`` messages; an answer holds fewer when they would not fit in one
frame (1 MiB by default), and the next request starts after the last seq received.

Durability: the main figures use the default, ``--fsync normal``: SQLite in WAL mode
without an fsync per commit, so an acknowledged message survives the broker being
killed but not an OS crash or power cut -- like nats-server, which by default syncs
its files every two minutes. ``append_always`` is the same append with ``--fsync
always``, one fsync per group commit, which also survives power loss.

What ``always`` costs depends on who waits. A pipelined publisher, as here, hardly pays:
while the broker waits for one fsync (on the event loop), the next publishes pile up and
are committed together, so the batches grow and the fsyncs per message shrink. A
publisher that waits for each acknowledgement before the next send pays a whole fsync
per message: on a virtual disk with ~0.3 ms fsyncs, ``send_reliable`` one at a time went
from ~0.1 ms (normal) to ~1.4 ms (always), 6,600 to 430 messages/s -- and every other
link of that broker waits out each fsync too.

Every run starts its servers afresh, each with a new store in a temporary directory,
in the order meshbus (fsync normal), nats-server -js, meshbus (fsync always); the
figures are the medians over ``--runs``.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator

import click

from bench.report import key_values, new_table, print_tables
from bench.runs import count_option
from bench.servers import BenchSetupError, Server

STREAM = "bench"
CAPTURE = "multicast:bench.stream"
_ACK_TIMEOUT = 600.0  # bounds wait_acked: only reached when acks stopped coming
_NATS_WINDOW = 256  # JetStream publishes in flight (the bench.jetstream default)


class StreamBenchError(Exception):
    """What the broker stored or returned is not what was sent."""


# -- meshbus ----------------------------------------------------------------------------------


async def meshbus_append(host: str, port: int, count: int, size: int) -> float:
    """Create the stream on the broker at host:port and append ``count`` messages of ``size``
    bytes through reliable sends; acknowledged messages per second."""
    import meshbus
    from meshbus.errors import DeliveryFailed

    failed: list[DeliveryFailed] = []
    async with await meshbus.connect(f"{host}:{port}", server="benchpub") as conn:
        conn.on_delivery_failed(failed.append)
        await conn.streams.add(STREAM, CAPTURE)
        publisher = await conn.register()
        payload = b"x" * size
        send = publisher.send
        start = time.perf_counter()
        for _ in range(count):
            if not await send(CAPTURE, payload, reliable=True):
                raise StreamBenchError(f"the broker does not know that {STREAM} captures {CAPTURE}")
        await conn.wait_acked(_ACK_TIMEOUT)
        elapsed = time.perf_counter() - start
        if failed:
            raise StreamBenchError(f"{len(failed)} publishes were never acknowledged")
        info = await conn.streams.info(STREAM)
    if info.messages != count or info.last_seq != count or info.bytes != count * size:
        raise StreamBenchError(f"the stream holds {info} after {count} acknowledged publishes")
    return count / elapsed


async def meshbus_fetch(host: str, port: int, count: int, size: int, batch: int) -> float:
    """Read the ``count`` messages of the appended stream back in order; messages/s."""
    import meshbus

    async with await meshbus.connect(f"{host}:{port}", server="benchread") as conn:
        fetch = conn.streams.fetch
        got = 0
        start = time.perf_counter()
        while got < count:
            page = await fetch(STREAM, got + 1, min(batch, count - got))
            if not page:
                raise StreamBenchError(f"fetch stopped after {got} of {count} messages")
            # Gap-free from seq 1: the i-th message read must carry seq i.
            if page[0].seq != got + 1 or page[-1].seq != got + len(page):
                raise StreamBenchError(f"after seq {got} came seqs {page[0].seq}..{page[-1].seq}")
            if len(page[-1].payload) != size:
                raise StreamBenchError(f"message {page[-1].seq} has {len(page[-1].payload)} bytes")
            got += len(page)
        elapsed = time.perf_counter() - start
    return count / elapsed


async def meshbus_append_wire(host: str, port: int, count: int, size: int, window: int) -> float:
    """``count`` reliable frames straight on the wire, ``window`` unacknowledged at most;
    acknowledged messages per second. The stream is made and checked by the client."""
    import meshbus

    async with await meshbus.connect(f"{host}:{port}", server="benchadmin") as conn:
        await conn.streams.add(STREAM, CAPTURE)
    per_s = await wire_append(host, port, count, size, window)
    async with await meshbus.connect(f"{host}:{port}", server="benchadmin") as conn:
        info = await conn.streams.info(STREAM)
    if info.messages != count or info.bytes != count * size:
        raise StreamBenchError(f"the stream holds {info} after {count} acknowledged publishes")
    return per_s


async def wire_append(
    host: str, port: int, count: int, size: int, window: int, latencies: list[float] | None = None
) -> float:
    """Send ``count`` reliable frames to ``CAPTURE`` on one raw link to the broker at
    host:port, ``window`` unacknowledged at most, every frame encoded before the clock
    starts; acknowledged messages per second. ``latencies``: filled with each frame's
    seconds from its write to its ack."""
    import asyncio

    from bench.wire import PRODUCER, MeshbusWire
    from meshbus.address import Address
    from meshbus.protocol import DataFlags, DataFrame, FrameDecoder, encode_data
    from meshbus.protocol.ext import unpack_acks

    sock = MeshbusWire().open_producer(host, port)
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        dst, src, payload = Address.parse(CAPTURE).to_bytes(), PRODUCER.to_bytes(), b"x" * size
        frames = [
            encode_data(dst, src, payload, msg_id=i, flags=DataFlags.RELIABLE)
            for i in range(1, count + 1)
        ]
        decoder = FrameDecoder()
        acked: set[int] = set()
        sent_at: list[float] = []
        start = time.perf_counter()
        sent = min(window, count)
        writer.write(b"".join(frames[:sent]))
        if latencies is not None:
            sent_at += [start] * sent
        while len(acked) < count:
            data = await reader.read(1 << 16)
            if not data:
                raise StreamBenchError(f"the broker closed the link after {len(acked)} acks")
            now = time.perf_counter()
            decoder.feed(data)
            while (frame := decoder.next_frame()) is not None:
                if isinstance(frame, DataFrame) and frame.flags & DataFlags.ACK:
                    ids = unpack_acks(frame.payload)
                    if latencies is not None:
                        # msg ids run from 1: id i was written at sent_at[i - 1].
                        latencies += [now - sent_at[i - 1] for i in ids if i not in acked]
                    acked.update(ids)
            more = min(count - sent, window - (sent - len(acked)))
            if more > 0:
                writer.write(b"".join(frames[sent : sent + more]))
                sent += more
                if latencies is not None:
                    sent_at += [now] * more
        elapsed = time.perf_counter() - start
    finally:
        writer.close()
    if acked != set(range(1, count + 1)):
        raise StreamBenchError(f"{len(acked)} acks for {count} publishes, ids out of range")
    return count / elapsed


# -- one run -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _meshbus(fsync: str) -> Iterator[Server]:
    from bench.servers import meshbus_broker

    with (
        tempfile.TemporaryDirectory(prefix="meshbus-bench-stream-") as data_dir,
        meshbus_broker("--data-dir", data_dir, "--fsync", fsync) as server,
    ):
        yield server


@contextlib.contextmanager
def _nats() -> Iterator[Server]:
    from bench.jetstream import jetstream_server

    with (
        tempfile.TemporaryDirectory(prefix="meshbus-bench-jetstream-") as store_dir,
        jetstream_server(store_dir) as server,
    ):
        yield server


def _run_once(count: int, size: int, batch: int) -> dict[str, float]:
    """One run of every measurement, each on servers of its own: msgs/s by figure name."""
    import uvloop

    from bench.jetstream import jetstream_append, jetstream_fetch

    figures: dict[str, float] = {}
    with _meshbus("normal") as server:
        figures["append"] = uvloop.run(meshbus_append(server.host, server.port, count, size))
        figures["fetch"] = uvloop.run(meshbus_fetch(server.host, server.port, count, size, batch))
    with _meshbus("normal") as server:
        figures["append_wire"] = uvloop.run(
            meshbus_append_wire(server.host, server.port, count, size, _NATS_WINDOW)
        )
    with _nats() as server:
        figures["nats_append"] = uvloop.run(
            jetstream_append(server.host, server.port, count, size, _NATS_WINDOW)
        )
        figures["nats_fetch"] = uvloop.run(jetstream_fetch(server.host, server.port, count, batch))
    with _meshbus("always") as server:
        figures["append_always"] = uvloop.run(meshbus_append(server.host, server.port, count, size))
    return figures


# -- the command ---------------------------------------------------------------------------------


@click.command()
@count_option(100_000, "Messages appended (and read back) per run and system.")
@click.option(
    "--size",
    type=click.IntRange(0, 900_000),
    default=100,
    show_default=True,
    help="Payload bytes per message.",
)
@click.option(
    "--batch",
    type=click.IntRange(1, 100_000),
    default=1000,
    show_default=True,
    help="Messages asked for per fetch request (meshbus answers with fewer when they "
    "would not fit in one 1 MiB frame; JetStream pulls this many).",
)
@click.option(
    "--runs",
    type=click.IntRange(1),
    default=3,
    show_default=True,
    help="Runs; each starts fresh servers and stores. Medians are reported.",
)
@click.option(
    "--replicas",
    type=click.Choice(["1", "3"]),
    default="1",
    show_default=True,
    help="3: a stream of three replicas on a mesh of three brokers (bench/replicated.py), "
    "with --vs-nats against JetStream R3, or with --failover.",
)
@click.option(
    "--vs-nats",
    is_flag=True,
    help="--replicas 3: also measure JetStream R3, appends or --failover (1 always does).",
)
@click.option(
    "--failover",
    is_flag=True,
    help="--replicas 3: kill -9 the stream's leader under appends; seconds until acked again.",
)
@click.option(
    "--window",
    type=click.IntRange(1, 10_000),
    default=_NATS_WINDOW,
    show_default=True,
    help="--replicas 3: appends in flight.",
)
@click.option(
    "--raft-tick",
    type=click.FloatRange(0.005, 10.0),
    default=0.1,
    show_default=True,
    help="--failover: the brokers' --raft-tick (elections after 10-20 ticks of silence).",
)
@click.option(
    "--resend-max",
    type=click.FloatRange(0.01, 60.0),
    default=2.0,
    show_default=True,
    help="--failover: the producer's RetryPolicy.max_interval (resends every 0.2 s, then "
    "twice as long each time, up to this); the JetStream producer resends alike.",
)
def stream(
    count: int,
    size: int,
    batch: int,
    runs: int,
    replicas: str,
    vs_nats: bool,
    failover: bool,
    window: int,
    raft_tick: float,
    resend_max: float,
) -> None:
    """Durable streams: acknowledged appends and fetches per second, meshbus against
    nats-server -js (both file-backed, no fsync per write); then meshbus appends with
    --fsync always (an fsync per group commit: survives power loss).

    `append` publishes through the client library; `append_wire` drives the broker the way
    the JetStream driver drives nats-server (raw protocol, pre-encoded, 256 in flight), so
    `wire_ratio` compares the servers alone.

    Needs nats-server (Debian package). Last line:
    `append=<msgs/s> nats_append=<msgs/s> append_ratio=<meshbus/nats> append_wire=<msgs/s>
    wire_ratio=<wire/nats> fetch=<msgs/s> nats_fetch=<msgs/s> fetch_ratio=<meshbus/nats>
    append_always=<msgs/s>`.

    With --replicas 3: `always_meshbus=<msgs/s> always_meshbus_p50_ms=<ms>
    always_meshbus_p99_ms=<ms> [always_nats=... always_ratio=<r> always_p99_ratio=<r>]`
    and the same for `default_`; `always_nats=none` when nats-server has no
    `sync_interval: always`. With --failover: `failover_s=<s> elected_s=<s> acked=<n>
    lost=<n> duplicated=<n>` and, with --vs-nats, the same prefixed `nats_`.
    """
    if replicas == "3":
        from bench.replicated import replicated_appends, replicated_failover

        if failover:
            replicated_failover(window, runs, raft_tick, resend_max, vs_nats)
        else:
            replicated_appends(count, size, window, runs, vs_nats)
        return
    if failover:
        raise click.UsageError("--failover needs --replicas 3")
    from bench.jetstream import JetStreamError
    from meshbus.errors import MeshbusError

    table = new_table(
        f"stream: {count:,} x {size} B, fetch batch {batch}",
        ("run", "system", "append msgs/s", "fetch msgs/s"),
    )
    per_run: dict[str, list[float]] = {}
    try:
        for run in range(1, runs + 1):
            figures = _run_once(count, size, batch)
            for key, value in figures.items():
                per_run.setdefault(key, []).append(value)
            rows = [
                ("meshbus (fsync normal)", figures["append"], f"{figures['fetch']:,.0f}"),
                ("meshbus (normal, wire driver)", figures["append_wire"], "-"),
                ("nats-server -js", figures["nats_append"], f"{figures['nats_fetch']:,.0f}"),
                ("meshbus (fsync always)", figures["append_always"], "-"),
            ]
            for system, appended, fetched in rows:
                table.add_row(str(run), system, f"{appended:,.0f}", fetched)
    except (BenchSetupError, JetStreamError, StreamBenchError, MeshbusError) as exc:
        raise click.ClickException(str(exc)) from exc
    medians = {key: statistics.median(values) for key, values in per_run.items()}
    append, fetch = medians["append"], medians["fetch"]
    table.add_section()
    table.add_row(
        "median", "meshbus / nats", f"{append / medians['nats_append']:.3f}",
        f"{fetch / medians['nats_fetch']:.3f}",
    )  # fmt: skip
    wire_ratio = medians["append_wire"] / medians["nats_append"]
    table.add_row("median", "wire driver / nats", f"{wire_ratio:.3f}", "-")
    table.add_row(
        "median", "fsync always / normal", f"{medians['append_always'] / append:.3f}", "-"
    )
    print_tables(table)
    click.echo(
        key_values(
            append=f"{append:.0f}",
            nats_append=f"{medians['nats_append']:.0f}",
            append_ratio=f"{append / medians['nats_append']:.3f}",
            append_wire=f"{medians['append_wire']:.0f}",
            wire_ratio=f"{wire_ratio:.3f}",
            fetch=f"{fetch:.0f}",
            nats_fetch=f"{medians['nats_fetch']:.0f}",
            fetch_ratio=f"{fetch / medians['nats_fetch']:.3f}",
            append_always=f"{medians['append_always']:.0f}",
        )
    )
