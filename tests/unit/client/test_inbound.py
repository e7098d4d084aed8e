"""What a real connector receives, in one process (meshbus.testing.connect_over): the
messages of a message group are handed out in the group's order, exactly once, also
when the member fails over in the middle of the group and later messages overtake the
ones lost with its broker (docs/guarantees.md).
"""

from __future__ import annotations

from meshbus.address import Anycast
from meshbus.testing import FakeNetwork, address_of, build_mesh
from tests.unit.client.conftest import Connect

POOL = Anycast("pool")


async def test_a_group_s_messages_arrive_in_order_across_the_member_s_failover(
    network: FakeNetwork, connect: Connect
) -> None:
    await build_mesh(network, 3)
    member_conn = await connect(address_of("a"), "member")
    member = await member_conn.register()
    await member.join(POOL)
    got: list[bytes] = []
    member.add_listener(lambda message: got.append(message.payload))
    sender_conn = await connect(address_of("c"), "sender")
    sender = await sender_conn.register()

    async def send(*numbers: int) -> None:
        for n in numbers:
            await sender.send(POOL, b"%d" % n, group="g")

    await send(1, 2, 3)
    await network.settle()
    assert got == [b"1", b"2", b"3"]

    # 4 and 5 reach c and wait on its link to a, which dies with them.
    network.wire_between(address_of("c"), address_of("a")).hold()
    await send(4, 5)
    await network.settle()
    network.crash(address_of("a"))
    await network.settle()
    assert member_conn.failovers == 1
    assert member_conn.broker_name in ("b", "c")

    to_member = network.wire_between("member", member_conn.broker_address).transports[1]
    written = to_member.bytes_written
    await send(6, 7)  # straight to the member at its new broker
    await network.settle()
    assert to_member.bytes_written > written, "6 and 7 reached the member's connector"
    assert got == [b"1", b"2", b"3"], "which holds them for 4 and 5"
    assert sender_conn.unacked == 4, "a held message is not acknowledged"

    await network.advance(1.0)  # the sender's ack timeout: 4 and 5 go again
    assert got == [b"%d" % n for n in range(1, 8)]
    assert sender_conn.unacked == 0
