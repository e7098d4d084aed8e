"""Durable consumers of a replicated stream (--replicas 3) on three real brokers: the
R=1 consumer's calls and errors, answered by the leader whichever broker is asked, with
the same state on every replica; and the leader killed with kill -9 while a consumer
takes and acknowledges, the consumer going on through the new leader.

What is promised across a failover (docs/guarantees.md, "Replicated streams"): every
message is delivered at least once; a message whose ack was answered (so committed) is
never delivered again; one delivered whose ack was not answered comes again once its
ack wait is over."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

import meshbus
from meshbus.client.streams import StreamMessage
from meshbus.errors import MeshbusError, StreamError
from meshbus.protocol.layout import ErrorCode
from tests.integration.helpers import wait_until
from tests.integration.test_cli_stream import stream_cli
from tests.integration.test_replicated_faults import FAST, RETRY, followers
from tests.integration.test_replicated_streams import (
    STREAM,
    Producer,
    Replicas,
    check_copies,
    led,
    replicated_stream,
)

pytestmark = pytest.mark.slow

ACK_WAIT = 1.0


async def consumer_states(replicas: Replicas, consumer: str) -> dict[str, tuple[int, int, int]]:
    """(next_seq, ack_floor, pending) of ``consumer`` as each running replica holds it
    (its committed state: a replica answers consumer_info itself)."""
    states = {}
    for name in replicas.names:
        if replicas.running(name):
            async with await meshbus.connect(replicas[name].address, server="check") as conn:
                info = await conn.streams.bind_consumer(STREAM, consumer).info()
            states[name] = (info["next_seq"], info["ack_floor"], info["pending"])
    return states


async def same_everywhere(replicas: Replicas, consumer: str, state: tuple[int, int, int]) -> None:
    async def in_step() -> bool:
        return set((await consumer_states(replicas, consumer)).values()) == {state}

    await wait_until(in_step, f"consumer {consumer} at {state} on every replica", timeout=20)


async def test_a_durable_consumer_of_a_replicated_stream(tmp_path) -> None:
    async with replicated_stream(tmp_path, *FAST) as (replicas, info):
        follower = replicas[followers(replicas, info.leader)[0]]
        async with await meshbus.connect(follower.address, server="c") as conn:
            publisher = await conn.register()
            for i in range(1, 11):
                await publisher.send_reliable(f"multicast:{STREAM}", b"m%d" % i)
            # Asked of a follower: the leader answers, once the change is committed.
            work = await conn.streams.consumer(STREAM, "work", ack_wait=30.0, max_deliver=3)
            taken = await work.next(4)
            assert [(m.seq, m.payload, m.delivery) for m in taken] == [
                (i, b"m%d" % i, 1) for i in range(1, 5)
            ]
            assert await work.ack([1, 2, 9]) == 2  # 9 was never delivered: it counts 0
            assert await work.ack([1]) == 0  # acknowledged already
            # The R=1 consumer's errors, with its codes.
            with pytest.raises(StreamError, match="already exists with a different") as exists:
                await conn.streams.consumer(STREAM, "work", ack_wait=5.0)
            assert exists.value.code == ErrorCode.STREAM_ERROR
            with pytest.raises(StreamError, match="no consumer named 'gone'") as missing:
                await conn.streams.bind_consumer(STREAM, "gone").next()
            assert missing.value.code == ErrorCode.NO_STREAM
            with pytest.raises(StreamError, match="invalid consumer name"):
                await conn.streams.consumer(STREAM, "no spaces")
            # The same consumer again: its state as it is.
            again = await conn.streams.consumer(STREAM, "work", ack_wait=30.0, max_deliver=3)
            assert [m.seq for m in await again.next(2)] == [5, 6]
            state = await again.info(current=True)  # the leader's
            assert (state["next_seq"], state["ack_floor"], state["pending"]) == (7, 2, 4)
        await same_everywhere(replicas, "work", (7, 2, 4))
        # The CLI, asked of the other follower.
        other = replicas[followers(replicas, info.leader)[1]]
        at = ("--broker", other.address)
        taken_cli = await stream_cli(
            "consumer", "next", STREAM, "work", "--count", "2", "--json", *at
        )
        assert taken_cli.code == 0, taken_cli.err
        rows = [json.loads(line) for line in taken_cli.out.splitlines()]
        assert [(r["seq"], r["payload"]) for r in rows] == [(7, "m7"), (8, "m8")]
        acked = await stream_cli("consumer", "ack", STREAM, "work", "3", "4", "5", *at)
        assert acked.code == 0, acked.err
        await same_everywhere(replicas, "work", (9, 5, 3))
        async with await meshbus.connect(other.address, server="c") as conn:
            assert (await conn.streams.info(STREAM)).consumers == ["work"]
            await conn.streams.bind_consumer(STREAM, "work").delete()

            async def gone_everywhere() -> bool:
                for name in replicas.names:
                    async with await meshbus.connect(replicas[name].address, server="k") as c:
                        if (await c.streams.info(STREAM)).consumers:
                            return False
                return True

            await wait_until(gone_everywhere, "the consumer deleted on every replica")


@dataclass
class Taker:
    """A durable consumer that takes and acknowledges, one batch at a time, until
    stopped, through whichever broker its connector is on (it fails over when its broker
    dies) and asking again after any error (no leader for a moment, a change not
    committed). Records every delivery, and when each ack was answered."""

    conn: meshbus.Connector
    # (seq, payload, delivery count, when it was asked for, when it came)
    delivered: list[tuple[int, bytes, int, float, float]] = field(default_factory=list)
    acked_at: dict[int, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    # Set ``forget``: the next batch taken is never acknowledged (as by a consumer that
    # crashed), its seqs put in ``forgotten``; then it waits for ``go``.
    forget: bool = False
    forgotten: list[int] = field(default_factory=list)
    go: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    async def on(cls, addresses: list[str]) -> Taker:
        conn = await meshbus.connect(
            addresses, server="taker", randomize_brokers=False, request_timeout=5.0
        )
        await conn.streams.consumer(STREAM, "work", ack_wait=ACK_WAIT, max_deliver=0)
        taker = cls(conn)
        taker.task = asyncio.create_task(taker._run())
        return taker

    async def _run(self) -> None:
        consumer = self.conn.streams.bind_consumer(STREAM, "work")
        to_ack: list[int] = []
        while True:
            try:
                if to_ack:
                    # Asked again until answered: an ack whose answer was lost with the
                    # leader may have been committed, and then counts 0 the second time.
                    await consumer.ack(to_ack)
                    now = time.monotonic()
                    for seq in to_ack:
                        self.acked_at.setdefault(seq, now)
                    to_ack = []
                # The leader starts a delivery's ack wait when it proposes it: after the
                # ask, before the answer's commit and its way back here.
                asked = time.monotonic()
                taken: list[StreamMessage] = await consumer.next(20)
                got = time.monotonic()
                self.delivered += [(m.seq, m.payload, m.delivery, asked, got) for m in taken]
                to_ack = [m.seq for m in taken]
                if taken and self.forget:
                    self.forget, self.forgotten, to_ack = False, to_ack, []
                    await self.go.wait()
                if taken:
                    continue
            except MeshbusError as exc:
                self.errors.append(str(exc))
            await asyncio.sleep(0.05)

    async def forget_a_batch(self, after: int) -> None:
        """Once ``after`` deliveries are acknowledged, take one batch and never
        acknowledge it (``forgotten``); returns once it is taken."""

        async def taken() -> bool:
            return len(self.acked_at) >= after

        await wait_until(taken, f"{after} messages acknowledged", timeout=20)
        self.forget = True

        async def forgotten() -> bool:
            return bool(self.forgotten)

        await wait_until(forgotten, "a batch taken and never acknowledged")

    async def stop(self) -> None:
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.conn.close()


def check_deliveries(
    takers: Sequence[Taker], stored: list[StreamMessage], fault_at: float | None = None
) -> None:
    """What docs/guarantees.md promises a durable consumer across failovers, checked
    against what the stream ``stored``, over what ``takers`` (of one consumer, one after
    the other) were delivered and acknowledged: every message delivered, as stored; none
    delivered again once its ack was answered; the delivery counts of a message rising
    with each delivery; and with ``fault_at``, each of the batch forgotten before that
    fault delivered again once its ack wait was over."""
    delivered = [d for taker in takers for d in taker.delivered]
    acked_at: dict[int, float] = {}
    for taker in takers:
        for seq, at in taker.acked_at.items():
            acked_at[seq] = min(at, acked_at.get(seq, at))
    payloads = {m.seq: m.payload for m in stored}
    # At least once: every message delivered, as stored.
    assert {seq for seq, *_ in delivered} == set(payloads)
    assert all(payload == payloads[seq] for seq, payload, *_ in delivered)
    # Never again once its ack was answered: before a fault or after it.
    again = [
        (seq, delivery)
        for seq, _, delivery, _, at in delivered
        if seq in acked_at and at > acked_at[seq]
    ]
    assert not again, f"delivered after its ack was answered: {again[:10]}"
    # What was delivered more than once came again with a higher delivery count
    # (higher by more than one when an answer was lost with the leader).
    counts: dict[int, int] = {}
    for seq, _, delivery, *_ in delivered:
        assert delivery > counts.get(seq, 0), (seq, delivery, counts.get(seq))
        counts[seq] = delivery
    if fault_at is None:
        return
    # What was delivered and not acknowledged before the fault came again from the
    # new leader, once its ack wait was over.
    forgotten = [seq for taker in takers for seq in taker.forgotten]
    assert forgotten
    first_at = {seq: asked for seq, _, _, asked, _ in reversed(delivered)}
    for seq in forgotten:
        again_at = [at for s, *_, at in delivered if s == seq and at > fault_at]
        assert again_at, f"{seq}, delivered and not acknowledged, never came again"
        assert again_at[0] - first_at[seq] >= ACK_WAIT, (seq, first_at[seq], again_at)


async def test_the_leader_killed_while_a_consumer_takes_and_acks(tmp_path) -> None:
    async with replicated_stream(tmp_path, *FAST) as (replicas, info):
        leader = info.leader
        survivor = followers(replicas, leader)[0]
        # A backlog, so that the consumer takes full batches, then a producer that goes
        # on through the kill.
        async with await meshbus.connect(replicas[survivor].address, server="b") as conn:
            publisher = await conn.register()
            await asyncio.gather(
                *(publisher.send_reliable(f"multicast:{STREAM}", b"b%d" % i) for i in range(200))
            )
        producer = await Producer.on(replicas[survivor], "v", RETRY)
        # On the leader first: its link dies with it, and the connector fails over.
        order = [leader, *followers(replicas, leader)]
        taker = await Taker.on([replicas[n].address for n in order])
        await taker.forget_a_batch(after=60)
        killed_at = time.monotonic()
        await replicas.kill(leader)
        taker.go.set()
        await producer.wait_acked(30, since=killed_at)
        await producer.stop()
        stored = await check_copies(replicas, [producer])
        last = stored[-1].seq

        async def all_acked() -> bool:
            return set(range(1, last + 1)) <= taker.acked_at.keys()

        await wait_until(all_acked, f"every one of {last} messages acknowledged", timeout=20)
        await taker.stop()
        check_deliveries([taker], stored, killed_at)
        assert any(at > killed_at for at in taker.acked_at.values())
        # The consumer's state is the same on every replica, the restarted one included.
        await replicas.restart(leader)
        await same_everywhere(replicas, "work", (last + 1, last, 0))


async def test_retention_by_age_is_applied_alike_by_every_replica(tmp_path) -> None:
    """A replicated stream's retention by age is an entry of its log, trimmed at the
    leader's clock by every replica: the same first seq everywhere, and a consumer's
    pending deliveries of what it removed gone alike."""
    replicas = await Replicas.start(tmp_path, 3, *FAST)
    try:
        first = replicas[replicas.names[0]]
        async with await meshbus.connect(first.address, server="c") as conn:
            await conn.streams.add(STREAM, f"multicast:{STREAM}", replicas=3, max_age=1.0)
            await led(conn, STREAM)
            publisher = await conn.register()
            for i in range(10):
                await publisher.send_reliable(f"multicast:{STREAM}", b"old%d" % i)
            work = await conn.streams.consumer(STREAM, "work")
            assert [m.seq for m in await work.next(3)] == [1, 2, 3]
            assert await work.ack([1]) == 1

            async def trimmed_everywhere() -> bool:
                seen = set()
                for name in replicas.names:
                    async with await meshbus.connect(replicas[name].address, server="k") as c:
                        info = await c.streams.info(STREAM)
                        seen.add((info.first_seq, info.messages))
                return seen == {(11, 0)}

            await wait_until(trimmed_everywhere, "every replica trimmed", timeout=10)
            await same_everywhere(replicas, "work", (11, 10, 0))  # 2 and 3 went with them
            for i in range(5):
                await publisher.send_reliable(f"multicast:{STREAM}", b"new%d" % i)
            assert [m.payload for m in await work.next(10)] == [b"new%d" % i for i in range(5)]
        await same_everywhere(replicas, "work", (16, 10, 5))
    finally:
        await replicas.close()
