"""LostCaptures across the mesh (meshbus.broker.core.captures), on brokers in one
process: a stream's broker lost, its groups answer MEMBERS with TRY_AGAIN where they
have no member -- on the broker that lost it, and on one that joins after and never saw
the stream's member (the marks come in the snapshot) --, until that broker is back."""

from __future__ import annotations

from meshbus.address import Multicast
from meshbus.protocol.control import Error, MembersRequest
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.storage.store import StreamConfig
from meshbus.testing import FakeNetwork, address_of, connector, start_broker

LEDGER = Multicast("ledger").to_bytes()


async def test_a_lost_stream_is_not_taken_for_no_member_even_by_a_newcomer(
    network: FakeNetwork,
) -> None:
    a = await start_broker(network, "a")
    b = await start_broker(network, "b", seeds=[address_of("a")])
    a.streams.host_local(StreamConfig("ledger", (LEDGER,)))
    await network.settle()
    assert len(b.routing.members(LEDGER)) == 1  # the stream's member, on a
    network.crash(address_of("a"))
    await network.settle()
    assert b.routing.members(LEDGER) == []
    assert b.lost_captures.holder(LEDGER, has_members=False) == "a"
    # A broker that joins now never sees the stream's member: b's snapshot says it went.
    c = await start_broker(network, "c", seeds=[address_of("b")])
    await network.settle()
    assert c.routing.members(LEDGER) == []
    assert c.lost_captures.holder(LEDGER, has_members=False) == "a"
    client = await connector(network, c)
    answer = await client.ask(ControlType.MEMBERS, MembersRequest(group=LEDGER))
    assert answer.type == ControlType.ERROR
    assert isinstance(answer.body, Error)
    assert answer.body.code == ErrorCode.TRY_AGAIN
    assert "the stream that captures it was on broker a" in answer.body.message
    # Back (with its stream gone: a memory store), its whole table says so: no mark left.
    await start_broker(network, "a", seeds=[address_of("b")])
    await network.settle()
    for broker in (b, c):
        assert broker.lost_captures.holder(LEDGER, has_members=False) is None
    answer = await client.ask(ControlType.MEMBERS, MembersRequest(group=LEDGER))
    assert answer.type == ControlType.MEMBER_LIST
