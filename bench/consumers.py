"""`python -m bench consumer`: what a durable consumer costs on a replicated stream.

A stream is filled with ``--count`` messages (not timed), then a durable consumer
takes them ``--batch`` at a time and acknowledges each batch before it takes the next
(``next`` then ``ack``, one round at a time, as an application that processes what it
takes does); with ``--consumers N``, N of them side by side, each taking all of it. The
figures are messages taken and acknowledged per second (all consumers together), and
the median time of one round (a ``next`` and its ``ack``), for a stream of one replica
(one broker) and of three (three brokers: each ``next`` and ``ack`` is a command in the
stream's Raft log, answered once a majority has fsynced it, a loop turn's commands in
one entry; docs/guarantees.md, "Durable consumers"). The consumers ask the R=3
stream's leader, so no relay is counted.

Every run starts its brokers afresh, each with a new data dir (``--fsync normal``: the
Raft log is fsynced whatever it says), the two sides in alternating order; the figures
are the medians over ``--runs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import click

from bench.report import key_values, new_table, print_tables
from bench.runs import count_option
from bench.servers import BenchSetupError, Server

if TYPE_CHECKING:
    from meshbus.client.streams import Consumer

STREAM = "bench"
CAPTURE = "multicast:bench.consumer"
_ACK_TIMEOUT = 600.0  # bounds the fill's wait_acked: only reached when acks stopped coming


class ConsumerBenchError(Exception):
    """What the consumer was given is not what the stream holds."""


async def fill_and_consume(
    servers: list[Server], replicas: int, count: int, batch: int, consumers: int
) -> tuple[float, float]:
    """Add the stream (``replicas`` of them), fill it, then have ``consumers`` durable
    consumers, side by side, each take all of it through its leader: (messages taken
    and acknowledged per second, all consumers together; median seconds of a round)."""
    import meshbus

    first = servers[0]
    async with await meshbus.connect(f"{first.host}:{first.port}", server="benchpub") as conn:
        await conn.streams.add(STREAM, CAPTURE, replicas=replicas)
        leader = ""
        for _ in range(200):
            info = await conn.streams.info(STREAM)
            leader = info.leader if replicas > 1 else info.broker
            if leader:
                break
            await asyncio.sleep(0.05)
        else:
            raise BenchSetupError(f"stream {STREAM} elected no leader within 10 s")
        publisher = await conn.register()
        for i in range(count):
            await publisher.send(CAPTURE, b"%d" % i, reliable=True)
        await conn.wait_acked(_ACK_TIMEOUT)
    chosen = servers[int(leader[1:])] if replicas > 1 else first  # broker b<i>: servers[i]
    async with await meshbus.connect(f"{chosen.host}:{chosen.port}", server="benchtake") as conn:
        takers = [await conn.streams.consumer(STREAM, f"bench{i}") for i in range(consumers)]
        rounds: list[float] = []
        start = time.perf_counter()
        await asyncio.gather(*(_take_all(taker, count, batch, rounds) for taker in takers))
        elapsed = time.perf_counter() - start
    return consumers * count / elapsed, statistics.median(rounds)


async def _take_all(consumer: Consumer, count: int, batch: int, rounds: list[float]) -> None:
    """Take the stream's ``count`` messages and acknowledge them, ``batch`` a round."""
    taken = 0
    while taken < count:
        began = time.perf_counter()
        messages = await consumer.next(batch)
        if not messages or messages[0].seq != taken + 1:
            got = messages[0].seq if messages else "nothing"
            raise ConsumerBenchError(f"after seq {taken} the consumer was given {got}")
        await consumer.ack(messages)
        rounds.append(time.perf_counter() - began)
        taken += len(messages)


@contextlib.contextmanager
def _brokers(replicas: int) -> Iterator[list[Server]]:
    from bench.cluster import meshbus_mesh
    from bench.servers import meshbus_broker

    with tempfile.TemporaryDirectory(prefix="meshbus-bench-consumer-") as root:
        if replicas == 1:
            with meshbus_broker("--data-dir", root) as server:
                yield [server]
        else:

            def own(i: int) -> tuple[str, ...]:
                return ("--name", f"b{i}", "--data-dir", f"{root}/{i}")

            with meshbus_mesh(replicas, each=own) as mesh:
                yield mesh.nodes


def _measure(replicas: int, count: int, batch: int, consumers: int) -> tuple[float, float]:
    import uvloop

    with _brokers(replicas) as servers:
        return uvloop.run(fill_and_consume(servers, replicas, count, batch, consumers))


@click.command()
@count_option(5_000, "Messages consumed per run and stream.")
@click.option(
    "--batch",
    type=click.IntRange(1, 100_000),
    default=100,
    show_default=True,
    help="Messages taken per next (and acknowledged per ack).",
)
@click.option(
    "--consumers",
    type=click.IntRange(1, 1000),
    default=1,
    show_default=True,
    help="Durable consumers taking the stream side by side, each all of it (on one "
    "connector): the changes of one loop turn go as one Raft entry.",
)
@click.option(
    "--runs",
    type=click.IntRange(1),
    default=3,
    show_default=True,
    help="Runs; each starts fresh brokers and stores. Medians are reported.",
)
def consumer(count: int, batch: int, consumers: int, runs: int) -> None:
    """Durable consumers: messages taken and acknowledged per second, and the time of one
    round (next + ack), on a stream of 1 replica and of 3.

    Last line: `r1=<msgs/s> r3=<msgs/s> ratio=<r3/r1> r1_round_ms=<ms> r3_round_ms=<ms>`.
    """
    from meshbus.errors import MeshbusError

    table = new_table(
        f"consumer: {count:,} messages, {batch} per next and ack, {consumers} consumer(s)",
        ("run", "replicas", "msgs/s", "round ms"),
    )
    rates: dict[int, list[float]] = {1: [], 3: []}
    round_times: dict[int, list[float]] = {1: [], 3: []}
    try:
        for run in range(1, runs + 1):
            for replicas in (1, 3) if run % 2 else (3, 1):
                rate, round_time = _measure(replicas, count, batch, consumers)
                rates[replicas].append(rate)
                round_times[replicas].append(round_time)
                table.add_row(str(run), str(replicas), f"{rate:,.0f}", f"{round_time * 1e3:.2f}")
    except (BenchSetupError, ConsumerBenchError, MeshbusError) as exc:
        raise click.ClickException(str(exc)) from exc
    r1, r3 = statistics.median(rates[1]), statistics.median(rates[3])
    ms1, ms3 = (statistics.median(round_times[r]) * 1e3 for r in (1, 3))
    table.add_section()
    table.add_row("median", "1", f"{r1:,.0f}", f"{ms1:.2f}")
    table.add_row("median", "3", f"{r3:,.0f}", f"{ms3:.2f}")
    print_tables(table)
    click.echo(
        key_values(
            r1=f"{r1:.0f}",
            r3=f"{r3:.0f}",
            ratio=f"{r3 / r1:.3f}",
            r1_round_ms=f"{ms1:.2f}",
            r3_round_ms=f"{ms3:.2f}",
        )
    )
