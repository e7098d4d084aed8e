"""`python -m bench stream --replicas 3`: appends to a stream of three replicas, against
JetStream R3 (``--vs-nats``); and with ``--failover``, how long appends stop when the
stream's leader is killed.

Appends: a mesh of three brokers, each with its own --data-dir, and a stream added with
replicas=3; against it, three clustered `nats-server -js` nodes (bench.jetstream) and a
stream with num_replicas 3, file storage. On both, one producer on the stream's leader
drives the same shape as the R=1 wire figures (``streams.wire_append``,
``jetstream.jetstream_append``): the raw protocol, every publish encoded before the clock
starts, at most ``--window`` unacknowledged. An append is acknowledged once a majority
of the replicas holds it. The figures: acknowledged appends/s, and each append's
latency from its write to its ack, p50 and p99. Every run starts its cluster afresh.

Two durability rows, each system's own words for the same thing:
- ``always``: every write fsynced before its ack. meshbus `--fsync always` (the Raft log
  is fsynced before every answer and every ack whatever --fsync says, and a replica's
  SQLite store, applied from that log, is not fsynced at each apply either way: the
  two meshbus rows differ only in the brokers' setting); nats-server
  `jetstream { sync_interval: always }`, a key 2.9 servers do not know: one that refuses
  it (asked with `nats-server -t`) gets no `always` row, the reason printed, and meshbus
  is measured alone.
- ``default``: each system's defaults. meshbus `--fsync normal`: the Raft log still
  fsynced before the ack, the replica's SQLite store not; nats-server: its files synced
  every 2 minutes, so an ack means "in the memory of a majority's processes".

Failover: the producer (the client library: ``--window`` reliable sends in flight, each
resent by the connector until acknowledged) on a broker that does not lead; once it has
been acknowledged for a while, the leader is killed (SIGKILL). With ``--vs-nats`` the
same on a JetStream R3 cluster, runs alternating: ``jetstream.JetStreamProducer``
publishes on a node that does not lead, with a Nats-Msg-Id each and the connector's
resend schedule. The figure is the time from the kill to appends acknowledged again
(the end of the longest silence after the kill); beside it, when a survivor first named
the new leader. At the end every acknowledged value must be in the stream, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import click

import meshbus
from bench.cluster import Cluster
from bench.report import key_values, new_table, print_tables
from bench.runs import alternate
from bench.servers import BenchSetupError
from bench.streams import CAPTURE, STREAM, StreamBenchError, wire_append

REPLICAS = 3
# How long a new stream may take to elect its leader and route its captures to it.
_LEADER_TIMEOUT = 20.0
# How long appends may stop after a leader's kill (JetStream's elections wait 4-9 s).
_RESUME_TIMEOUT = 30.0


@dataclass
class Appended:
    """One run of one system: acknowledged appends/s and latency percentiles (ms)."""

    per_s: float
    p50_ms: float
    p99_ms: float

    @classmethod
    def of(cls, per_s: float, latencies: list[float]) -> Appended:
        ordered = sorted(latencies)
        if not ordered:
            raise StreamBenchError("no append was acknowledged")

        def pick(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0

        return cls(per_s, pick(0.50), pick(0.99))


def _mesh_args(root: str) -> Callable[[int], tuple[str, ...]]:
    """Broker i's name and data dir: a replica is known to its group by its name."""
    return lambda i: ("--name", f"r{i}", "--data-dir", os.path.join(root, f"r{i}"))


async def _led(conn: meshbus.Connector, not_by: str = "") -> str:
    """The stream's leader once one (other than ``not_by``) is elected."""
    deadline = time.monotonic() + _LEADER_TIMEOUT
    while (leader := (await conn.streams.info(STREAM)).leader) in ("", not_by):
        if time.monotonic() > deadline:
            raise StreamBenchError(f"stream {STREAM} elected no leader in {_LEADER_TIMEOUT} s")
        await asyncio.sleep(0.02)
    return leader


async def _captured_at(addresses: list[str]) -> None:
    """Until the stream's member is in the routing table of every broker of ``addresses``:
    a reliable send to a multicast without members is acknowledged at once, stored nowhere."""
    for address in addresses:
        async with await meshbus.connect(address, server="benchadmin") as conn:
            deadline = time.monotonic() + _LEADER_TIMEOUT
            while not (await conn.stat())["groups"].get(CAPTURE):
                if time.monotonic() > deadline:
                    raise StreamBenchError(f"{address} routes {CAPTURE} to no member")
                await asyncio.sleep(0.02)


# -- acknowledged appends --------------------------------------------------------------------


async def _meshbus_appends(addresses: list[str], count: int, size: int, window: int) -> Appended:
    async with await meshbus.connect(addresses[0], server="benchadmin") as conn:
        await conn.streams.add(STREAM, CAPTURE, replicas=REPLICAS)
        leader = addresses[int((await _led(conn))[1:])]  # r<i> is broker i
    await _captured_at([leader])
    host, port = leader.rsplit(":", 1)
    latencies: list[float] = []
    per_s = await wire_append(host, int(port), count, size, window, latencies)
    async with await meshbus.connect(leader, server="benchadmin") as conn:
        info = await conn.streams.info(STREAM)  # the leader has applied what it acknowledged
    if info.messages != count or info.bytes != count * size:
        raise StreamBenchError(f"the stream holds {info} after {count} acknowledged publishes")
    return Appended.of(per_s, latencies)


def meshbus_appends(fsync: str, count: int, size: int, window: int) -> Appended:
    """One run on a fresh mesh of three brokers with ``--fsync fsync``."""
    import uvloop

    from bench.cluster import meshbus_mesh

    with (
        tempfile.TemporaryDirectory(prefix="meshbus-bench-r3-") as root,
        meshbus_mesh(REPLICAS, "--fsync", fsync, each=_mesh_args(root)) as mesh,
    ):
        addresses = [f"{node.host}:{node.port}" for node in mesh.nodes]
        return uvloop.run(_meshbus_appends(addresses, count, size, window))


def nats_appends(sync_always: bool, count: int, size: int, window: int) -> Appended:
    """One run on a fresh cluster of three `nats-server -js` nodes."""
    import uvloop

    from bench.jetstream import jetstream_add, jetstream_append, jetstream_cluster

    with jetstream_cluster(REPLICAS, sync_always) as cluster:
        first = cluster.nodes[0]
        leader = cluster.nodes[int(uvloop.run(jetstream_add(first.host, first.port, REPLICAS))[1:])]
        latencies: list[float] = []
        per_s = uvloop.run(
            jetstream_append(
                leader.host, leader.port, count, size, window,
                replicas=REPLICAS, latencies=latencies,
            )
        )  # fmt: skip
        return Appended.of(per_s, latencies)


@dataclass
class _Side:
    """One system of a durability row, for ``runs.alternate``: a fresh cluster a run."""

    kind: str
    run: Callable[[], Appended]


def _row(durability: str, sides: list[_Side], runs: int, title: str) -> dict[str, dict[str, float]]:
    """The runs of one row, the sides alternating: medians by kind, then figure."""
    p50s: dict[str, list[float]] = {}
    p99s: dict[str, list[float]] = {}

    def measure(side: _Side) -> tuple[float, tuple[str, ...]]:
        got = side.run()
        p50s.setdefault(side.kind, []).append(got.p50_ms)
        p99s.setdefault(side.kind, []).append(got.p99_ms)
        return got.per_s, (
            durability,
            f"{got.per_s:,.0f}",
            f"{got.p50_ms:.2f}",
            f"{got.p99_ms:.2f}",
        )

    per_s = alternate(
        [contextlib.nullcontext(side) for side in sides],
        runs,
        title,
        ("durability", "acked appends/s", "p50 ms", "p99 ms"),
        measure,
    )
    return {
        kind: {
            "per_s": per_s[kind],
            "p50_ms": statistics.median(p50s[kind]),
            "p99_ms": statistics.median(p99s[kind]),
        }
        for kind in per_s
    }


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def replicated_appends(count: int, size: int, window: int, runs: int, vs_nats: bool) -> None:
    """The rows ``always`` and ``default``; the last line has each row's medians and the
    ratios meshbus/nats (appends/s, p99), or `<row>_nats=none` where nats-server cannot
    run the row."""
    from bench.jetstream import JetStreamError, nats_server_version, sync_always_refused
    from meshbus.errors import MeshbusError

    refused = sync_always_refused() if vs_nats else ""
    if vs_nats:
        click.echo(f"against {nats_server_version()}", err=True)
    if refused:
        click.echo(f"no nats-server in the `always` row: {refused}", err=True)
    rows = [("always", "always", True), ("default", "normal", False)]
    load_before = _load()
    pairs: dict[str, str] = {}
    try:
        for durability, fsync, sync_always in rows:
            sides = [
                _Side("meshbus", functools.partial(meshbus_appends, fsync, count, size, window))
            ]
            if vs_nats and not (sync_always and refused):
                run = functools.partial(nats_appends, sync_always, count, size, window)
                sides.append(_Side("nats", run))
            title = (
                f"stream, {REPLICAS} replicas: {count:,} x {size} B, {window} in flight, "
                f"durability {durability}"
            )
            medians = _row(durability, sides, runs, title)
            for kind, figures in medians.items():
                pairs[f"{durability}_{kind}"] = f"{figures['per_s']:.0f}"
                pairs[f"{durability}_{kind}_p50_ms"] = f"{figures['p50_ms']:.2f}"
                pairs[f"{durability}_{kind}_p99_ms"] = f"{figures['p99_ms']:.2f}"
            if "nats" in medians:
                mine, theirs = medians["meshbus"], medians["nats"]
                pairs[f"{durability}_ratio"] = f"{mine['per_s'] / theirs['per_s']:.3f}"
                pairs[f"{durability}_p99_ratio"] = f"{mine['p99_ms'] / theirs['p99_ms']:.3f}"
            elif vs_nats:
                pairs[f"{durability}_nats"] = "none"
    except (JetStreamError, StreamBenchError, MeshbusError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"load average (1, 5, 15 min) before: {load_before}, after: {_load()}", err=True)
    click.echo(key_values(**pairs))


# -- failover ------------------------------------------------------------------------------------


@dataclass
class Failover:
    """One run: seconds from the leader's kill to a survivor naming the new leader and to
    appends acknowledged again; what was acknowledged and stored."""

    elected_s: float
    resumed_s: float
    acked: int
    stored: int
    lost: int  # acknowledged, and not in the stream
    duplicated: int  # stored more than once

    @classmethod
    def of(
        cls,
        killed_at: float,
        elected_at: float,
        acked: list[int],
        acked_at: list[float],
        stored: list[bytes],
    ) -> Failover:
        """``acked_at``: when each of ``acked`` was acknowledged; ``stored``: the stream."""
        # Acknowledged again: the end of the longest silence after the kill. Not merely the
        # first ack after it: one the dead leader sent just before its end may trail in.
        times = [killed_at, *(at for at in acked_at if at > killed_at)]
        gaps = [(later - earlier, later) for earlier, later in itertools.pairwise(times)]
        values = {b"%d" % value for value in acked}
        return cls(
            elected_at - killed_at,
            max(gaps)[1] - killed_at,
            len(values),
            len(stored),
            len(values - set(stored)),
            len(stored) - len(set(stored)),
        )


async def _acked_after(acked_at: list[float], moment: float) -> None:
    """Until a producer recording into ``acked_at`` has an append acknowledged after
    ``moment``."""
    deadline = time.monotonic() + _RESUME_TIMEOUT
    while not acked_at or acked_at[-1] <= moment:
        if time.monotonic() > deadline:
            raise StreamBenchError(f"no append acknowledged in the {_RESUME_TIMEOUT:.0f} s after")
        await asyncio.sleep(0.005)


class _Producer:
    """``window`` senders on one connector, each sending its own unique values reliably, one
    at a time (``send_reliable``: the connector resends until acknowledged), so ``window``
    appends are in flight; every acknowledgement is recorded with its time."""

    def __init__(self, conn: meshbus.Connector, window: int) -> None:
        self.acked: list[int] = []
        self.acked_at: list[float] = []
        self._conn, self._window = conn, window
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        publisher = await self._conn.register()
        self._tasks = [
            asyncio.create_task(self._send(publisher, first)) for first in range(self._window)
        ]

    async def _send(self, publisher: meshbus.Service, value: int) -> None:
        from meshbus.errors import DeliveryFailed

        while True:
            with contextlib.suppress(DeliveryFailed):  # given up: the next value
                await publisher.send_reliable(CAPTURE, b"%d" % value)
                self.acked.append(value)
                self.acked_at.append(time.monotonic())
            value += self._window

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _stored(addresses: list[str]) -> list[bytes]:
    """The stream's payloads, read once every replica of ``addresses`` has the same last
    seq twice in a row (a resend still held when the producer stopped may commit)."""
    async with contextlib.AsyncExitStack() as stack:
        conns = [
            await stack.enter_async_context(await meshbus.connect(a, server="benchcheck"))
            for a in addresses
        ]
        last: set[int] = set()
        deadline = time.monotonic() + _LEADER_TIMEOUT
        while True:
            seen = {(await conn.streams.info(STREAM)).last_seq for conn in conns}
            if len(seen) == 1 and seen == last:
                break
            if time.monotonic() > deadline:
                raise StreamBenchError(f"the replicas of {addresses} never agreed: {seen}")
            last = seen
            await asyncio.sleep(0.2)
        payloads: list[bytes] = []
        while page := await conns[0].streams.fetch(STREAM, len(payloads) + 1, 1000):
            if page[0].seq != len(payloads) + 1:
                raise StreamBenchError(f"after seq {len(payloads)} came seq {page[0].seq}")
            payloads += [message.payload for message in page]
    return payloads


async def meshbus_failover(
    root: str, window: int, raft_tick: float, resend_max: float, before: float, after: float
) -> Failover:
    from bench.brokers import MeshbusProcesses
    from meshbus import ReliableConfig, RetryPolicy
    from meshbus.broker.process import BrokerStartError

    # Nothing given up while the measurement lasts: only the first resends' times matter.
    retry = RetryPolicy(max_interval=resend_max, max_attempts=100)
    brokers = MeshbusProcesses()
    try:
        try:
            mesh = await brokers.mesh(
                REPLICAS, "--raft-tick", str(raft_tick), each=_mesh_args(root)
            )
        except BrokerStartError as exc:
            raise BenchSetupError(f"a meshbus broker did not start: {exc}") from exc
        addresses = [broker.address for broker in mesh]
        async with await meshbus.connect(addresses[0], server="benchadmin") as admin:
            await admin.streams.add(STREAM, CAPTURE, replicas=REPLICAS)
            leader = await _led(admin)
        await _captured_at(addresses)
        doomed = mesh[int(leader[1:])]
        survivors = [broker.address for broker in mesh if broker is not doomed]
        async with (
            await meshbus.connect(
                survivors[0], server="benchpub", reliable=ReliableConfig(retry=retry)
            ) as conn,
            await meshbus.connect(survivors[1], server="benchwatch") as watch,
        ):
            producer = _Producer(conn, window)
            await producer.start()
            await asyncio.sleep(before)
            if not producer.acked:
                raise StreamBenchError(f"nothing acknowledged in {before} s before the kill")
            killed_at = time.monotonic()
            doomed.process.kill()
            await _led(watch, not_by=leader)
            elected_at = time.monotonic()
            # The dead leader's acks may trail in just after the kill; not the new one's.
            await _acked_after(producer.acked_at, elected_at)
            await asyncio.sleep(after)
            await producer.stop()
        stored = await _stored(survivors)
    finally:
        await brokers.close()
    return Failover.of(killed_at, elected_at, producer.acked, producer.acked_at, stored)


async def nats_failover(
    cluster: Cluster, window: int, resend_max: float, before: float, after: float
) -> Failover:
    from bench.jetstream import (
        JetStreamError,
        JetStreamProducer,
        jetstream_add,
        jetstream_leader,
        jetstream_payloads,
    )

    first = cluster.nodes[0]
    leader = await jetstream_add(first.host, first.port, REPLICAS)
    doomed = cluster.nodes[int(leader[1:])]  # n<i> is node i
    producing, watching = (node for node in cluster.nodes if node is not doomed)
    producer = await JetStreamProducer.open(producing.host, producing.port, window, resend_max)
    publishing = asyncio.create_task(producer.run())
    try:
        await asyncio.sleep(before)
        if not producer.acked:
            raise StreamBenchError(f"nothing acknowledged in {before} s before the kill")
        killed_at = time.monotonic()
        os.kill(doomed.pid, signal.SIGKILL)
        deadline = killed_at + _RESUME_TIMEOUT
        while await jetstream_leader(watching.host, watching.port) in ("", leader):
            if time.monotonic() > deadline:
                raise StreamBenchError(f"JetStream elected no leader in {_RESUME_TIMEOUT} s")
            await asyncio.sleep(0.02)
        elected_at = time.monotonic()
        await _acked_after(producer.acked_at, elected_at)
        await asyncio.sleep(after)
    finally:
        publishing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await publishing
    await asyncio.sleep(0.5)  # what the survivors committed reaches both
    # A consumer to read with needs the meta group's leader, which may have died too.
    deadline = time.monotonic() + _RESUME_TIMEOUT
    while True:
        try:
            stored = await jetstream_payloads(watching.host, watching.port)
            break
        except (JetStreamError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    return Failover.of(killed_at, elected_at, producer.acked, producer.acked_at, stored)


def replicated_failover(
    window: int,
    runs: int,
    raft_tick: float,
    resend_max: float,
    vs_nats: bool,
    before: float = 1.0,
    after: float = 0.5,
) -> None:
    """``runs`` failovers, each on a fresh mesh (and, with ``vs_nats``, a fresh JetStream
    cluster, the two alternating); the last line has the medians and the sums of what was
    lost and duplicated (both must be 0)."""
    import uvloop

    from bench.jetstream import JetStreamError, jetstream_cluster
    from meshbus.errors import MeshbusError

    table = new_table(
        f"stream, {REPLICAS} replicas: the leader killed under {window} appends in flight "
        f"(meshbus --raft-tick {raft_tick}; resends 0.2 s, doubling, at most {resend_max} s "
        "apart)",
        ("run", "system", "elected s", "acked again s", "acked", "stored", "lost", "duplicated"),
    )
    results: dict[str, list[Failover]] = {}

    def meshbus_run() -> Failover:
        with tempfile.TemporaryDirectory(prefix="meshbus-bench-failover-") as root:
            return uvloop.run(meshbus_failover(root, window, raft_tick, resend_max, before, after))

    def nats_run() -> Failover:
        with jetstream_cluster(REPLICAS, sync_always=False) as cluster:
            return uvloop.run(nats_failover(cluster, window, resend_max, before, after))

    systems = [("meshbus", meshbus_run)] + ([("nats", nats_run)] if vs_nats else [])
    load_before = _load()
    try:
        for run in range(1, runs + 1):
            for kind, measure in systems:
                got = measure()
                results.setdefault(kind, []).append(got)
                table.add_row(
                    str(run), kind, f"{got.elected_s:.3f}", f"{got.resumed_s:.3f}",
                    f"{got.acked:,}", f"{got.stored:,}", str(got.lost), str(got.duplicated),
                )  # fmt: skip
    except (BenchSetupError, JetStreamError, StreamBenchError, MeshbusError) as exc:
        raise click.ClickException(str(exc)) from exc
    print_tables(table)
    click.echo(f"load average (1, 5, 15 min) before: {load_before}, after: {_load()}", err=True)
    pairs: dict[str, str] = {}
    for kind, runs_of in results.items():
        prefix = "" if kind == "meshbus" else f"{kind}_"
        pairs[f"{prefix}failover_s"] = f"{statistics.median(r.resumed_s for r in runs_of):.3f}"
        pairs[f"{prefix}elected_s"] = f"{statistics.median(r.elected_s for r in runs_of):.3f}"
        pairs[f"{prefix}acked"] = str(sum(r.acked for r in runs_of))
        pairs[f"{prefix}lost"] = str(sum(r.lost for r in runs_of))
        pairs[f"{prefix}duplicated"] = str(sum(r.duplicated for r in runs_of))
    click.echo(key_values(**pairs))
