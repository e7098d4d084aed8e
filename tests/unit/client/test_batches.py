"""Batch frames between real connectors in one process (meshbus.testing): every row
arrives as a message of its own, in order, once -- also when the whole batch is sent
again -- and a batch the receiver cannot read is dropped and never acknowledged."""

from __future__ import annotations

from meshbus import Message
from meshbus.protocol.batch import BATCH_ROWS, pack_rows
from meshbus.testing import FakeNetwork, address_of, build_mesh
from tests.unit.client.conftest import Connect


async def test_rows_arrive_as_messages_in_order_once(
    network: FakeNetwork, connect: Connect
) -> None:
    await build_mesh(network, 2)
    member_conn = await connect(address_of("a"), "member")
    member = await member_conn.register()
    await member.join("multicast:scores")
    got: list[Message] = []
    member.add_listener(got.append)
    sender_conn = await connect(address_of("b"), "sender")
    sender = await sender_conn.register()
    rows = [(b"score %d" % i, b"match-1/%d" % i, i) for i in range(50)]

    for _ in range(2):  # the second time, as a retried job would: every row a duplicate
        frames = await sender.send_batch("multicast:scores", rows)
        assert [count for _, count in frames] == [50]
        await network.settle()
        assert sender_conn.unacked == 0
    assert [(m.payload, m.priority) for m in got] == [(p, pr) for p, _, pr in rows]
    assert {(str(m.src), str(m.dst)) for m in got} == {(str(sender.address), "multicast:scores")}


async def test_a_batch_the_receiver_cannot_read_is_dropped_unacknowledged(
    network: FakeNetwork, connect: Connect
) -> None:
    await build_mesh(network, 1)
    member_conn = await connect(address_of("a"), "member")
    member = await member_conn.register()
    got: list[Message] = []
    member.add_listener(got.append)
    sender_conn = await connect(address_of("a"), "sender")
    sender = await sender_conn.register()
    reliable = sender._parts.reliable
    good_rows = next(pack_rows([(b"fine", b"id-1")], 1000))[0]
    # Not msgpack; well-formed rows, but in a format this connector does not know.
    for batch, payload in ((BATCH_ROWS, b"\xc1 not msgpack"), (BATCH_ROWS + 1, good_rows)):
        await reliable.send(
            sender._raw, member.address.to_bytes(), payload, echo=False, group=b"",
            final=False, priority=0, publish_id=b"", wait=False, batch=batch,
        )  # fmt: skip
    await network.settle()
    assert got == []
    assert member_conn.dropped == 2
    assert sender_conn.unacked == 2  # resent on its timer, and given up in the end
