"""Durable streams end to end, with real broker processes: capture, fetch, retention,
dedupe, durable consumers, surviving kill -9, and the errors a user sees.

``streams.add`` answers once every broker knows the capture, so a publisher on any
broker may publish right after it.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

import meshbus
from meshbus import Multicast
from meshbus.client.streams import StreamMessage
from meshbus.errors import DeliveryFailed, FrameTooLarge, StreamError, Timeout
from tests.conftest import BrokerProcess, start_broker, start_mesh, stop_all
from tests.integration.helpers import start_broker_process, wait_members


async def fetch_all(conn: meshbus.Connector, stream: str) -> list[StreamMessage]:
    """Every message of ``stream``, page by page (a page may be cut short by the frame size)."""
    out: list[StreamMessage] = []
    while page := await conn.streams.fetch(stream, out[-1].seq + 1 if out else 1, 1000):
        out += page
    return out


async def test_capture_and_fetch_through_another_broker(mesh2: list[BrokerProcess]) -> None:
    host, other = mesh2
    async with (
        await meshbus.connect(host.address, server="admin", operator=True) as admin,
        await meshbus.connect(other.address, server="pub") as conn,
    ):
        created = await admin.streams.add("orders", "multicast:orders")
        assert (created.broker, created.first_seq, created.last_seq) == (host.name, 1, 0)
        await wait_members(mesh2, Multicast("orders"), 1)
        publisher = await conn.register()
        before = time.time()
        await publisher.send_reliable("multicast:orders", b"first")
        await publisher.send_reliable(
            "multicast:orders", b"second", priority=7, headers={"Trace": "t2", "Kind": "sale"}
        )
        await publisher.send_reliable("multicast:orders", b"")
        after = time.time()
        # Every request below goes to `other`, which relays it to the host.
        got = await conn.streams.fetch("orders", 1, 10)
        assert [m.seq for m in got] == [1, 2, 3]
        assert [m.payload for m in got] == [b"first", b"second", b""]
        assert [m.priority for m in got] == [0, 7, 0]
        assert [m.headers for m in got] == [{}, {"Trace": "t2", "Kind": "sale"}, {}]
        assert {(m.src, m.dst, m.group, m.stream) for m in got} == {
            (publisher.address, Multicast("orders"), None, "orders")
        }
        assert before <= got[0].stored_at <= got[1].stored_at <= got[2].stored_at <= after
        assert [m.seq for m in await publisher.fetch("orders", 2, 1)] == [2]
        assert await conn.streams.fetch("orders", 4, 10) == []
        info = await conn.streams.info("orders")
        assert (info.name, info.broker, info.captures) == (
            "orders",
            host.name,
            ["multicast:orders"],
        )
        assert (info.first_seq, info.last_seq, info.messages, info.bytes) == (1, 3, 3, 11)
        assert info.consumers == []
        assert await conn.streams.list() == [{"name": "orders", "broker": host.name}]


async def test_retention_keeps_the_newest_max_msgs(broker: BrokerProcess) -> None:
    async with await meshbus.connect(broker.address, server="pub") as conn:
        await conn.streams.add("recent", "multicast:recent", max_msgs=5)
        publisher = await conn.register()
        for i in range(1, 9):
            await publisher.send_reliable("multicast:recent", b"m%d" % i)
        info = await conn.streams.info("recent")
        assert (info.first_seq, info.last_seq, info.messages, info.bytes) == (4, 8, 5, 10)
        got = await conn.streams.fetch("recent", 1, 100)
        assert [(m.seq, m.payload) for m in got] == [(i, b"m%d" % i) for i in range(4, 9)]


async def test_a_publish_id_is_stored_once(broker: BrokerProcess) -> None:
    async with await meshbus.connect(broker.address, server="pub") as conn:
        await conn.streams.add("payments", "multicast:payments")
        publisher = await conn.register()
        for attempt in (b"try1", b"try2", b"try3"):  # a publisher retrying one payment
            await publisher.send_reliable("multicast:payments", attempt, publish_id=b"pay-42")
        await publisher.send_reliable("multicast:payments", b"other", publish_id=b"pay-43")
        await publisher.send_reliable("multicast:payments", b"no id")
        got = await conn.streams.fetch("payments", 1, 100)
        assert [(m.seq, m.payload) for m in got] == [(1, b"try1"), (2, b"other"), (3, b"no id")]
        assert (await conn.streams.info("payments")).messages == 3


async def test_a_block_fetch_holds_what_fetch_does_and_fills_a_frame(
    broker: BrokerProcess,
) -> None:
    """``fetch_blocks`` (the Spark source's path) returns the same messages as ``fetch``,
    in the blocks the store keeps, and stops where the next block would overfill a frame
    -- cutting a first block down when it alone would."""
    async with await meshbus.connect(broker.address, server="bulk") as conn:
        await conn.streams.add("bulk", "multicast:bulk")
        publisher = await conn.register()
        await publisher.send_reliable("multicast:bulk", b"plain")
        await publisher.send_reliable("multicast:bulk", b"prio", priority=3)
        for i in range(30):
            await publisher.send("multicast:bulk", bytes([i]) * 100_000, reliable=True)
        await conn.wait_acked(30)
        rows = await conn.streams.fetch("bulk", 1, 2)
        pieces = await conn.streams.fetch_blocks("bulk", 1, 2)
        got = [(seq, piece.stored_at, *m) for piece in pieces
               for seq, *m in zip(piece.seqs, *piece.columns(), strict=True)]  # fmt: skip
        src, dst = publisher.address.to_bytes(), meshbus.Multicast("bulk").to_bytes()
        assert got == [
            (1, rows[0].stored_at, src, dst, b"plain", b"", 0, b"", b""),
            (2, rows[1].stored_at, src, dst, b"prio", b"", 3, b"", b""),
        ]
        big = await conn.streams.fetch_blocks("bulk", 3, 1000)
        seqs = [seq for piece in big for seq in piece.seqs]
        assert 3 < len(seqs) < 30  # 100 kB payloads: a 1 MiB frame holds some
        assert seqs == list(range(3, 3 + len(seqs)))
        assert big[0].columns().payload[0] == bytes([0]) * 100_000
        assert await conn.streams.fetch_blocks("bulk", 99, 10) == []


async def test_durable_consumer_acks_redelivers_and_gives_up(broker: BrokerProcess) -> None:
    async with await meshbus.connect(broker.address, server="work") as conn:
        await conn.streams.add("jobs", "multicast:jobs")
        publisher = await conn.register()
        for i in (1, 2, 3):
            await publisher.send_reliable("multicast:jobs", b"job%d" % i, headers={"N": str(i)})
        consumer = await conn.streams.consumer("jobs", "worker", ack_wait=0.3, max_deliver=2)
        assert (await conn.streams.info("jobs")).consumers == ["worker"]
        first = await consumer.next(10)
        assert [(m.seq, m.payload, m.delivery, m.headers) for m in first] == [
            (1, b"job1", 1, {"N": "1"}), (2, b"job2", 1, {"N": "2"}), (3, b"job3", 1, {"N": "3"})
        ]  # fmt: skip
        assert await consumer.ack(first[:1]) == 1
        assert await consumer.ack([1]) == 0  # acked already
        assert await consumer.next(10) == []  # nothing new, nothing due yet
        state = await consumer.info()
        assert (state["next_seq"], state["ack_floor"], state["pending"]) == (4, 1, 2)
        await asyncio.sleep(0.4)  # past ack_wait: 2 and 3 come again
        again = await consumer.next(10)
        assert [(m.seq, m.delivery) for m in again] == [(2, 2), (3, 2)]
        assert await consumer.ack([2]) == 1
        await asyncio.sleep(0.4)  # 3 was delivered max_deliver times: given up, not sent
        assert await consumer.next(10) == []
        state = await consumer.info()
        assert (state["ack_floor"], state["pending"], state["dropped"]) == (3, 0, 1)


async def test_an_offline_consumer_gets_what_it_missed(mesh2: list[BrokerProcess]) -> None:
    host, other = mesh2
    async with await meshbus.connect(host.address, server="pub") as pub_conn:
        await pub_conn.streams.add("mail", "multicast:mail")
        publisher = await pub_conn.register()
        async with await meshbus.connect(other.address, server="mailer") as first_conn:
            consumer = await first_conn.streams.consumer("mail", "mailer")
            await publisher.send_reliable("multicast:mail", b"mail1")
            await publisher.send_reliable("multicast:mail", b"mail2")
            assert await consumer.ack(await consumer.next(10)) == 2
        # No connector of the consumer exists while these are published.
        for i in range(3, 8):
            await publisher.send_reliable("multicast:mail", b"mail%d" % i)
        async with await meshbus.connect(other.address, server="mailer") as second_conn:
            consumer = await second_conn.streams.consumer("mail", "mailer")
            missed = await consumer.next(100)
            assert [(m.seq, m.payload, m.delivery) for m in missed] == [
                (i, b"mail%d" % i, 1) for i in range(3, 8)
            ]
            assert await consumer.ack(missed) == 5
            assert await consumer.next(100) == []
            assert (await consumer.info())["ack_floor"] == 7


async def test_kill_9_keeps_every_acknowledged_message(tmp_path: Path) -> None:
    data_dir = str(tmp_path / "host")
    host = await start_broker("--data-dir", data_dir)
    other = await start_broker("--seed", host.address)
    running = [host, other]
    try:
        async with await meshbus.connect(other.address, server="pub") as conn:
            failed: list[DeliveryFailed] = []
            conn.on_delivery_failed(failed.append)
            async with await meshbus.connect(host.address, server="op", operator=True) as op:
                await op.streams.add("ledger", "multicast:ledger")
            await wait_members(running, Multicast("ledger"), 1)
            publisher = await conn.register()
            for i in range(2000):
                await publisher.send("multicast:ledger", b"entry-%d" % i, reliable=True)
            await conn.wait_acked(30)
            assert (failed, conn.unacked) == ([], 0)
            consumer = await conn.streams.consumer("ledger", "auditor", ack_wait=1.0)
            taken = await consumer.next(10)
            taken_at = time.monotonic()
            assert await consumer.ack(taken[:5]) == 5
        host.process.kill()
        assert await host.process.wait() == -9
        running.remove(host)
        host = await start_broker("--data-dir", data_dir, "--seed", other.address)
        running.append(host)
        async with await meshbus.connect(host.address, server="audit") as conn:
            info = await conn.streams.info("ledger")
            assert (info.broker, info.first_seq, info.last_seq, info.messages) == (
                host.name, 1, 2000, 2000
            )  # fmt: skip
            stored = await fetch_all(conn, "ledger")
            assert [m.seq for m in stored] == list(range(1, 2001))
            assert [m.payload for m in stored] == [b"entry-%d" % i for i in range(2000)]
            consumer = await conn.streams.consumer("ledger", "auditor", ack_wait=1.0)
            state = await consumer.info()
            assert (state["next_seq"], state["ack_floor"], state["pending"]) == (11, 5, 5)
            await asyncio.sleep(max(0.0, taken_at + 1.1 - time.monotonic()))
            redelivered = await consumer.next(5)
            assert [(m.seq, m.delivery) for m in redelivered] == [(s, 2) for s in range(6, 11)]
    finally:
        assert await stop_all(running) == [0] * len(running)


async def test_a_send_to_a_stream_whose_host_is_down_is_refused_not_counted_delivered(
    tmp_path: Path,
) -> None:
    """A reliable multicast to a group without members succeeds at once (nobody to miss
    it). A stream's group loses its member when the stream's broker goes: a send then
    would be stored nowhere, so it raises Timeout, until the stream is back; once the
    stream is deleted, "no member" is the answer again."""
    data_dir = str(tmp_path / "host")
    host = await start_broker("--data-dir", data_dir)
    other = await start_broker("--seed", host.address)
    running = [host, other]
    try:
        async with await meshbus.connect(host.address, server="op", operator=True) as op:
            await op.streams.add("ledger", "multicast:ledger")
        await wait_members(running, Multicast("ledger"), 1)
        async with await meshbus.connect(other.address, server="pub") as conn:
            publisher = await conn.register()
            assert await publisher.send_reliable("multicast:ledger", b"before") > 0
            host.process.kill()
            assert await host.process.wait() == -9
            running.remove(host)
            await asyncio.sleep(1.1)  # the member cache of the send above is stale
            with pytest.raises(Timeout) as refused:
                await publisher.send_reliable("multicast:ledger", b"lost?", timeout=1.0)
            assert f"the stream that captures it was on broker {host.name}" in str(refused.value)
            host = await start_broker("--data-dir", data_dir, "--seed", other.address)
            running.append(host)
            assert await publisher.send_reliable("multicast:ledger", b"after", timeout=10) > 0
            stored = await fetch_all(conn, "ledger")
            assert [m.payload for m in stored] == [b"before", b"after"]
            await conn.streams.delete("ledger")
            await wait_members(running, Multicast("ledger"), 0)
            await asyncio.sleep(1.1)  # the member cache of the send above is stale
            assert await publisher.send_reliable("multicast:ledger", b"nobody") == 0
    finally:
        assert await stop_all(running) == [0] * len(running)


async def test_an_unknown_stream_is_a_stream_error(mesh2: list[BrokerProcess]) -> None:
    expected = (
        "no stream named 'nope' on this broker; "
        "create it with `meshbus stream add nope --capture ...`"
    )
    async with await meshbus.connect(mesh2[0].address, server="user") as conn:
        with pytest.raises(StreamError) as info_error:
            await conn.streams.info("nope")
        assert str(info_error.value) == expected
        with pytest.raises(StreamError) as fetch_error:
            await conn.streams.fetch("nope")
        assert str(fetch_error.value) == expected
        with pytest.raises(StreamError, match="no stream named 'nope'"):
            await conn.streams.consumer("nope", "reader")
        with pytest.raises(StreamError, match="no stream named 'nope'"):
            await conn.streams.delete("nope")


async def test_a_stream_whose_host_is_down_is_unreachable_not_missing() -> None:
    host, other = mesh = await start_mesh(2)
    try:
        await _host_killed_then_asked(host, other)
    finally:
        assert await stop_all(mesh) == [-9, 0]


async def _host_killed_then_asked(host: BrokerProcess, other: BrokerProcess) -> None:
    async with await meshbus.connect(host.address, server="admin") as admin:
        await admin.streams.add("results", "multicast:results")
    host.process.kill()  # kill -9: the host says nothing, its peer sees the link drop
    await host.process.wait()
    async with await meshbus.connect(other.address, server="user") as conn:
        deadline = time.monotonic() + 10
        while True:
            with pytest.raises(StreamError) as error:
                await conn.streams.info("results")
            if "unreachable" in str(error.value) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)  # the request was relayed before the link dropped
        assert re.fullmatch(
            rf"stream 'results' is hosted by broker {host.name}, unreachable from this broker "
            r"since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \(\d+ s ago\); it is back when its "
            r"broker is -- adding a stream of the same name elsewhere would make a second one",
            str(error.value),
        ), str(error.value)
        with pytest.raises(StreamError, match="unreachable"):
            await conn.streams.fetch("results")
        with pytest.raises(StreamError, match="no stream named 'other'"):
            await conn.streams.info("other")


@pytest.mark.parametrize(
    ("captures", "refused"),
    [
        (["anycast:login"], "anycast:login"),
        (["game:7"], "game:7"),
        (["multicast:fine", "anycast:pool"], "anycast:pool"),
    ],
)
async def test_a_capture_must_be_multicast(
    broker: BrokerProcess, captures: list[str], refused: str
) -> None:
    async with await meshbus.connect(broker.address, server="user") as conn:
        with pytest.raises(StreamError) as error:
            await conn.streams.add("bad", captures)
        assert str(error.value) == f"a stream captures multicast addresses, not {refused}"
        assert await conn.streams.list() == []


# -- regressions: each of these lost messages once -------------------------------------------


async def test_publishing_through_another_broker_right_after_add(
    mesh2: list[BrokerProcess],
) -> None:
    host, other = mesh2
    async with (
        await meshbus.connect(host.address, server="admin", operator=True) as admin,
        await meshbus.connect(other.address, server="pub") as conn,
    ):
        publisher = await conn.register()
        lost = []
        for i in range(30):
            await admin.streams.add(f"race{i}", f"multicast:race{i}")
            await publisher.send_reliable(f"multicast:race{i}", b"x")
            if len(await admin.streams.fetch(f"race{i}")) != 1:
                lost.append(i)
        assert lost == []


async def test_publishing_right_after_add_when_the_address_was_used_before(
    broker: BrokerProcess,
) -> None:
    async with await meshbus.connect(broker.address, server="pub") as conn:
        publisher = await conn.register()
        assert await publisher.send_reliable("multicast:late", b"nobody") == 0
        await conn.streams.add("late", "multicast:late")
        await publisher.send_reliable("multicast:late", b"stored?")
        assert [m.payload for m in await conn.streams.fetch("late")] == [b"stored?"]


async def test_a_data_dir_serves_one_broker(tmp_path: Path) -> None:
    """Two brokers on one --data-dir would both write streams.db: the second one refuses
    to start, saying why, and the first keeps running."""
    first = await start_broker("--data-dir", str(tmp_path))
    try:
        second = await start_broker_process("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path))
        _, err = await asyncio.wait_for(second.communicate(), 20)
        assert second.returncode == 1
        assert "in use by another broker" in err.decode()
        async with await meshbus.connect(first.address, server="still") as conn:
            await conn.ping()
    finally:
        await stop_all([first])


async def test_a_batch_is_stored_and_delivered_row_by_row_once(broker: BrokerProcess) -> None:
    """``send_batch``: frames split below the link's max_frame, each row a message of its
    own for the stream and for a plain member, in order; sent again from a new connector
    (a retried Spark task), every row is dropped by its publish id."""
    rows = [(b"row %04d " % i * 10, b"job-7/%d" % i, i % 3) for i in range(500)]
    async with (
        await meshbus.connect(broker.address, server="admin") as admin,
        await meshbus.connect(broker.address, server="member") as conn,
    ):
        await admin.streams.add("batches", "multicast:batches")
        member = await conn.register()
        await member.join("multicast:batches")
        got: list[meshbus.Message] = []
        member.add_listener(got.append)
        for attempt in range(2):
            async with await meshbus.connect(
                broker.address, server="writer", max_frame=8192
            ) as writer:
                sender = await writer.register()
                frames = await sender.send_batch("multicast:batches", rows)
                await writer.wait_acked(10)
                assert writer.unacked == 0
            assert len(frames) > 5  # 500 rows of ~110 bytes do not fit one 8 KiB frame
            assert sum(count for _, count in frames) == 500
            stored = await fetch_all(admin, "batches")
            assert [(m.seq, m.payload, m.priority) for m in stored] == [
                (i + 1, payload, priority) for i, (payload, _, priority) in enumerate(rows)
            ], f"attempt {attempt}"
            assert {str(m.dst) for m in stored} == {"multicast:batches"}
            assert [(m.payload, m.priority) for m in got] == [(p, pr) for p, _, pr in rows]
            assert {str(m.dst) for m in got} == {"multicast:batches"}


async def test_a_batch_row_too_large_for_a_frame_fails_before_sending(
    broker: BrokerProcess,
) -> None:
    async with await meshbus.connect(broker.address, server="writer", max_frame=4096) as conn:
        await conn.streams.add("big", "multicast:big")
        sender = await conn.register()
        with pytest.raises(FrameTooLarge, match="exceeds the maximum frame size of 4096"):
            await sender.send_batch("multicast:big", [(b"small", b"1"), (b"x" * 5000, b"2")])
        assert (await conn.streams.info("big")).messages == 0
