"""`python -m bench reliable`: what exactly-once delivery costs against a plain send.

One sender service on broker 1 of a 2-broker mesh sends COUNT messages to one
receiver service on broker 2, through the public client API (``Service.send``), in
runs that alternate plain and reliable on the same mesh, so both see the same machine
noise. The figure is application throughput: messages the receiving service got per
second, from the first send to the last message received. A reliable sender pipelines
(``send(..., reliable=True)`` returns once written, the connector keeps up to
``ReliableConfig.max_unacked`` in flight) and then waits for every ack; that wait is
shown too, but the figure ends with the last message received, as for plain sends.

Both connectors live in the bench process, on one event loop: the receiver's acks and
the sender's bookkeeping share that core, as the two sides' work would on a busy host.
Every run is checked: each message id arrives exactly once (a plain send on a healthy
mesh loses nothing either), or the command fails.
"""

from __future__ import annotations

import asyncio
import statistics
import struct
import time
from dataclasses import dataclass

import click

import meshbus
from bench.cluster import Cluster, meshbus_mesh
from bench.harness import CheckFailed
from bench.report import new_table, print_tables
from bench.runs import count_option, size_option
from bench.servers import BenchSetupError

_ID = struct.Struct(">I")  # the message id, at the head of every payload
_PROBE = b"?"  # shorter than an id: never counted
# Give-up bounds: far above anything healthy, they only turn a hang into a clear error.
_SETTLE_TIMEOUT = 10.0
_MIN_DELIVERY_TIMEOUT = 60.0
_MODES = ("plain", "reliable")


@dataclass
class RunResult:
    mode: str
    count: int
    seconds: float  # first send to last message received
    acked_seconds: float  # first send to the last ack (reliable), or to the last message

    @property
    def msgs_per_s(self) -> float:
        return self.count / self.seconds


class _Counter:
    """The receiving application: counts every id, and notes when the last one arrived."""

    def __init__(self, count: int) -> None:
        self.seen = bytearray(count)
        self.received = 0
        self.duplicates = 0
        self.probed = asyncio.get_running_loop().create_future()
        self.done = asyncio.get_running_loop().create_future()
        self.finished = 0.0

    def __call__(self, message: meshbus.Message) -> None:
        payload = message.payload
        if len(payload) < _ID.size:
            if not self.probed.done():
                self.probed.set_result(None)
            return
        (msg_id,) = _ID.unpack_from(payload)
        if self.seen[msg_id]:
            self.duplicates += 1
            return
        self.seen[msg_id] = 1
        self.received += 1
        if self.received == len(self.seen):
            self.finished = time.perf_counter()
            self.done.set_result(None)


async def _probe(sender: meshbus.Service, counter: _Counter, dst: meshbus.Address) -> None:
    """Plain probes until one arrives: the route across the mesh is in place before timing
    (``register`` returns once the mesh knows the address; this only bounds a bug)."""
    deadline = time.monotonic() + _SETTLE_TIMEOUT
    while not counter.probed.done():
        if time.monotonic() > deadline:
            raise BenchSetupError(f"no probe reached {dst} within {_SETTLE_TIMEOUT:.0f} s")
        await sender.send(dst, _PROBE)
        await asyncio.wait([counter.probed], timeout=0.05)


async def _measure(cluster: Cluster, mode: str, count: int, size: int) -> RunResult:
    a, b = cluster.nodes[:2]
    reliable = mode == "reliable"
    # Payloads are built before the clock starts: the figure is the bus's, not struct's.
    pad = bytes(size - _ID.size)
    payloads = [_ID.pack(i) + pad for i in range(count)]
    recv_conn = await meshbus.connect(f"{b.host}:{b.port}", server="rbrecv", failover=False)
    try:
        send_conn = await meshbus.connect(f"{a.host}:{a.port}", server="rbsend", failover=False)
        try:
            receiver = await recv_conn.register()
            sender = await send_conn.register()
            counter = _Counter(count)
            receiver.add_listener(counter)
            dst = receiver.address
            await _probe(sender, counter, dst)
            limit = max(_MIN_DELIVERY_TIMEOUT, count / 1000)
            send = sender.send
            began = time.perf_counter()
            for payload in payloads:
                await send(dst, payload, reliable=reliable)
            try:
                await asyncio.wait_for(asyncio.shield(counter.done), limit)
                if reliable:
                    await send_conn.wait_acked(limit)
            except TimeoutError:
                raise CheckFailed(
                    f"{mode}: {counter.received:,} of {count:,} messages arrived and "
                    f"{send_conn.unacked:,} were unacknowledged after {limit:.0f} s"
                ) from None
            acked = time.perf_counter() if reliable else counter.finished
            # A round trip on each side gives a late duplicate (a resend that crossed its
            # ack) the time to show up before the connectors close.
            await send_conn.ping()
            await recv_conn.ping()
            if counter.duplicates:
                raise CheckFailed(f"{mode}: {counter.duplicates:,} messages arrived twice")
            return RunResult(mode, count, counter.finished - began, acked - began)
        finally:
            await send_conn.close()
    finally:
        await recv_conn.close()


@click.command()
@size_option("Payload bytes per message (its first 4 are the message id).", 100, _ID.size)
@count_option(100_000)
@click.option(
    "--runs",
    type=click.IntRange(1),
    default=3,
    show_default=True,
    help="Runs per mode, plain and reliable alternating; medians are reported.",
)
def reliable(size: int, count: int, runs: int) -> None:
    """Reliable vs plain sends: one service on broker 1 -> one on broker 2 of a 2-broker
    mesh, messages the receiving application got per second.

    Each run opens fresh connectors and times from the first send to the last message
    received; a reliable run pipelines its sends and then waits for every ack (the
    `acked s` column). Every message must arrive exactly once.

    Last line: `plain=<msgs/s> reliable=<msgs/s> ratio=<reliable/plain>`.
    """
    import uvloop

    table = new_table(
        f"reliable vs plain: {count:,} x {size} B, broker 1 -> broker 2",
        ("run", "mode", "msgs/s", "seconds", "acked s"),
    )
    figures: dict[str, list[float]] = {mode: [] for mode in _MODES}
    try:
        with meshbus_mesh(2) as cluster:
            for run in range(1, runs + 1):
                for mode in _MODES:
                    result = uvloop.run(_measure(cluster, mode, count, size))
                    figures[mode].append(result.msgs_per_s)
                    table.add_row(
                        str(run),
                        mode,
                        f"{result.msgs_per_s:,.0f}",
                        f"{result.seconds:.3f}",
                        f"{result.acked_seconds:.3f}",
                    )
    except BenchSetupError as exc:
        raise click.ClickException(str(exc)) from exc
    except meshbus.MeshbusError as exc:
        raise click.ClickException(f"the mesh failed during the benchmark: {exc}") from exc
    print_tables(table)
    plain, reliable_ = (statistics.median(figures[mode]) for mode in _MODES)
    click.echo(f"plain={plain:.0f} reliable={reliable_:.0f} ratio={reliable_ / plain:.3f}")
