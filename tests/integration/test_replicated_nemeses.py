"""More real faults (issue 27, "How it is proven", part 2), past those of
test_replicated_faults.py: a stream of five replicas losing two, then three, of them;
a membership change -- a wiped replica replaced by its new self -- while another replica
is paused; a drain of the leader while a follower is cut off; and a durable consumer
taking and acknowledging while its leader is cut off from the followers. The same
checks after each (``check_copies``, ``check_deliveries``): no acknowledged value lost,
none stored twice, the order kept, the copies equal; appends acknowledged again within a
few election timeouts while a majority is up, and never acknowledged while only a
minority is."""

from __future__ import annotations

import shutil
import signal
import time

import pytest

import meshbus
from meshbus.errors import MeshbusError
from tests.conftest import BrokerProcess
from tests.integration.helpers import RawLink, stat, wait_until
from tests.integration.test_replicated_consumers import Taker, check_deliveries, same_everywhere
from tests.integration.test_replicated_faults import (
    ELECTION,
    FAST,
    RESUME_WITHIN,
    RETRY,
    followers,
    leader_seen_by,
    led_by_another,
    refused_meanwhile,
    stopped_and_checked,
)
from tests.integration.test_replicated_streams import (
    STREAM,
    Consumer,
    Producer,
    check_copies,
    led,
    replicated_stream,
)

pytestmark = pytest.mark.slow


async def replaced(conn: meshbus.Connector, broker: BrokerProcess, what: str) -> None:
    """Until ``broker``, back with its data dir wiped, holds the stream again (as a new
    member: its old self held it, the new one holds nothing until the leader adds it), and
    the leader ``conn`` reaches has it once, as a voter that answers and holds its log but
    the last few entries, and no learner left: its old self removed, its new one
    promoted."""

    async def done() -> bool:
        if STREAM not in (await stat(broker))["streams"]["raft"]["streams"]:
            return False
        try:
            info = await conn.streams.info(STREAM, current=True)
        except MeshbusError:
            return False  # no leader for a moment
        states = [r for r in info.replica_states if r["broker"] == broker.name]
        if info.learners or len(states) != 1:
            return False
        return states[0]["state"] == "follower" and states[0]["lag"] <= 8 and states[0]["voter"]

    await wait_until(done, what, timeout=30)


async def test_five_replicas_lose_two_then_three_then_one_is_rebuilt_during_a_pause(
    tmp_path,
) -> None:
    """--replicas 5: two followers killed, appends go on; a third, they are refused; the
    three back, they resume. Then a follower's data dir wiped while another is paused: the
    leader replaces its old self by the new one (a learner that copies the log, the old
    voter removed, the learner promoted) with four of five voters up, one of them new."""
    async with replicated_stream(tmp_path, *FAST, count=5) as (replicas, info):
        home = info.leader  # the producer's broker: never faulted
        producer = await Producer.on(replicas[home], "v", RETRY)
        consumer = await Consumer.on(replicas[home])
        await producer.wait_acked(20)
        first, second, third, _ = followers(replicas, home)
        killed_at = time.monotonic()
        await replicas.kill(first, second)
        assert await producer.wait_acked(10, since=killed_at) < RESUME_WITHIN
        killed_at = time.monotonic()
        await replicas.kill(third)
        await refused_meanwhile(producer, since=killed_at + ELECTION)
        async with await meshbus.connect(replicas[home].address, server="c") as conn:
            assert await leader_seen_by(conn) == ""  # check-quorum: it stepped down
        for name in (first, second, third):
            await replicas.restart(name)
        restarted_at = time.monotonic()
        assert await producer.wait_acked(10, since=restarted_at) < RESUME_WITHIN

        async with await meshbus.connect(replicas[home].address, server="c") as conn:
            leader = (await led(conn, STREAM)).leader
            paused, wiped = [n for n in followers(replicas, leader) if n != home][:2]
            replicas.pause(paused)
            await replicas.kill(wiped)
            shutil.rmtree(replicas.data_dir(wiped))
            back = await replicas.restart(wiped)
            await replaced(conn, back, f"{wiped} replaced by its new self while {paused} sleeps")
        replicas.resume(paused)
        assert await producer.wait_acked(10, since=time.monotonic()) < RESUME_WITHIN
        await stopped_and_checked(replicas, [producer], consumer)


async def test_a_broker_joins_and_takes_the_place_of_a_paused_replica(tmp_path) -> None:
    """--replace-after 2: a follower paused (SIGSTOP), a fourth broker joins the mesh
    meanwhile and, once the follower has been silent for 2 s, takes its place (a learner
    that copies the log, the silent voter removed first, the learner promoted); appends
    go on throughout. The paused one, going again, is no member: it keeps its old copy,
    disturbs nobody (its pre-votes are not granted), and its clients' appends are
    acknowledged by the leader."""
    async with replicated_stream(tmp_path, *FAST, "--replace-after", "2") as (replicas, info):
        leader = info.leader
        paused, home = followers(replicas, leader)
        producer = await Producer.on(replicas[home], "v", RETRY)
        stranded = await Producer.on(replicas[paused], "p", RETRY)
        consumer = await Consumer.on(replicas[home])
        await producer.wait_acked(20)
        await stranded.wait_acked(5)
        paused_at = time.monotonic()
        replicas.pause(paused)
        await replicas.add("r3")
        assert await producer.wait_acked(10, since=paused_at) < RESUME_WITHIN
        async with await meshbus.connect(replicas[home].address, server="c") as conn:

            async def taken_over() -> bool:
                try:
                    info = await conn.streams.info(STREAM, current=True)
                except MeshbusError:
                    return False  # no leader for a moment
                caught_up = all(r["lag"] <= 8 for r in info.replica_states)
                return sorted(info.replicas) == sorted({leader, home, "r3"}) and caught_up

            await wait_until(taken_over, f"r3 a voter in place of {paused}", timeout=30)
            replicas.resume(paused)
            resumed_at = time.monotonic()
            assert await producer.wait_acked(20, since=resumed_at) < RESUME_WITHIN
            # Its clients' appends go to the leader.
            assert await stranded.wait_acked(10, since=resumed_at) < RESUME_WITHIN
            # Not disturbed: the leader is the one it was.
            assert (await conn.streams.info(STREAM)).leader == leader
        await producer.stop()
        await stranded.stop()
        await check_copies(replicas, [producer, stranded], consumer, removed=(paused,))
        await consumer.stop()


async def test_a_leader_drained_while_a_follower_is_cut_off(tmp_path) -> None:
    """The leader drained (held draining by a connector that ignores its MOVE) while one
    follower is cut off: it hands its leadership to the follower it reaches, and appends
    go on while it drains; once it is gone, one voter of three is reachable and nothing is
    acknowledged until the cut one is back."""
    grace = 20 * ELECTION
    async with replicated_stream(tmp_path, *FAST, "--drain-grace", str(grace)) as (replicas, info):
        leader = info.leader
        cut, live = followers(replicas, leader)
        producer = await Producer.on(replicas[live], "f", RETRY)
        consumer = await Consumer.on(replicas[live])
        await producer.wait_acked(20)
        replicas.cut_off(cut)
        assert await producer.wait_acked(10, since=time.monotonic()) < RESUME_WITHIN
        straggler = await RawLink.open(replicas[leader].address)
        try:
            await straggler.hello("straggler")
            await straggler.register("straggler", 1)
            async with await meshbus.connect(replicas[live].address, server="c") as conn:
                replicas[leader].process.send_signal(signal.SIGTERM)  # a drain
                await led_by_another(conn, leader, "the follower it reaches leading", grace / 2)
                assert await leader_seen_by(conn) == live
                exited = replicas[leader].process.returncode
                assert exited is None, f"the leader changed once it was gone ({exited})"
                assert await producer.wait_acked(10, since=time.monotonic()) < RESUME_WITHIN
        finally:
            await straggler.close()
        assert await replicas[leader].process.wait() == 0
        await refused_meanwhile(producer, since=time.monotonic() + ELECTION)
        replicas.reconnect(cut)
        healed_at = time.monotonic()
        assert await producer.wait_acked(10, since=healed_at) < RESUME_WITHIN
        await stopped_and_checked(replicas, [producer], consumer)


async def test_a_consumer_acks_while_its_leader_is_cut_off(tmp_path) -> None:
    """A durable consumer on the leader's broker takes and acknowledges while the leader is
    cut off from its followers (its clients still reach it): nothing is delivered or
    acknowledged by it alone; the followers elect another, and once the cut is healed the
    consumer goes on through it, from the committed state -- a batch it took before and
    never acknowledged comes again after its ack wait, nothing acknowledged comes again."""
    async with replicated_stream(tmp_path, *FAST) as (replicas, info):
        leader = info.leader
        outside = followers(replicas, leader)[0]
        producer = await Producer.on(replicas[outside], "v", RETRY)
        await producer.wait_acked(100)
        taker = await Taker.on([replicas[leader].address])
        await taker.forget_a_batch(after=60)
        cut_at = time.monotonic()
        replicas.cut_off(leader)
        failed = len(taker.errors)
        taker.go.set()
        assert await producer.wait_acked(10, since=cut_at) < RESUME_WITHIN

        async def refused() -> bool:
            return len(taker.errors) > failed

        await wait_until(refused, "the consumer refused by the cut-off leader", timeout=20)
        async with await meshbus.connect(replicas[leader].address, server="c") as conn:
            assert await leader_seen_by(conn) == ""  # check-quorum: it stepped down
        healed_at = time.monotonic()
        replicas.reconnect(leader)
        await producer.wait_acked(10, since=healed_at)
        await producer.stop()
        stored = await check_copies(replicas, [producer])
        last = stored[-1].seq

        async def all_acked() -> bool:
            return set(range(1, last + 1)) <= taker.acked_at.keys()

        await wait_until(all_acked, f"every one of {last} messages acknowledged", timeout=30)
        await taker.stop()
        # Cut off, the leader answered nothing it had not committed before.
        alone = (cut_at + ELECTION, healed_at)
        assert not [at for at in taker.acked_at.values() if alone[0] < at < alone[1]]
        assert not [got for *_, got in taker.delivered if alone[0] < got < alone[1]]
        check_deliveries([taker], stored, cut_at)
        await same_everywhere(replicas, "work", (last + 1, last, 0))
