"""Who may answer a request (docs/protocol.md §7): brokers on the fake network and clock.
A forger's response is dropped and counted (``dropped_wrong_responder``) where the
request's entry is kept, and the real answer still goes through."""

from __future__ import annotations

import pytest

from meshbus.address import Anycast, Multicast
from meshbus.broker.server import Broker
from meshbus.protocol.layout import FLAG_REQUEST, FLAG_RESPONSE, ControlType
from meshbus.testing import FakeClient, FakeClock, FakeNetwork, build_mesh, connector

POOL = Anycast("pool").to_bytes()
TOPIC = Multicast("topic").to_bytes()


@pytest.fixture
async def pair(network: FakeNetwork) -> list[Broker]:
    return await build_mesh(network, 2, default_request_timeout=2.0)


async def registered(network: FakeNetwork, broker: Broker, name: str) -> tuple[FakeClient, bytes]:
    client = await connector(network, broker, name)
    return client, await client.register(name)


def answer(client: FakeClient, src: bytes, requester: bytes, request: int) -> None:
    client.send_data(requester, src, b"from " + src[:6], response_for=request, flags=FLAG_RESPONSE)


async def test_a_unicast_request_is_answered_by_its_destination_only(
    network: FakeNetwork, pair: list[Broker]
) -> None:
    a, b = pair
    requester, asking = await registered(network, a, "asker")
    server, serving = await registered(network, b, "server")
    local_forger, here = await registered(network, a, "forger")
    remote_forger, there = await registered(network, b, "forger")
    await network.settle()
    requester.send_data(serving, asking, b"?", msg_id=5, flags=FLAG_REQUEST)
    await network.settle()
    for client, forged in ((local_forger, here), (remote_forger, there)):
        for request in range(1, 9):
            answer(client, forged, asking, request)
    await network.settle()
    assert requester.take_data() == []
    assert a.stats.dropped_wrong_responder == 2, "request 5 twice; the rest found no entry"
    assert a.stats.late_responses == 14
    answer(server, serving, asking, 5)
    answer(server, serving, asking, 5)
    await network.settle()
    assert [f.src for f in requester.take_data()] == [serving]
    assert a.stats.late_responses == 15, "the duplicate"


@pytest.mark.parametrize("group", [POOL, TOPIC], ids=["anycast", "multicast"])
async def test_a_group_member_on_a_peer_is_checked_there_and_here(
    network: FakeNetwork, pair: list[Broker], group: bytes
) -> None:
    """b delivered the request to its member (picked it, for anycast): b alone can tell
    the member's answer from that of a connector beside it, and keeps an entry to."""
    a, b = pair
    requester, asking = await registered(network, a, "asker")
    member, working = await registered(network, b, "worker")
    await member.join(working, group)
    local_forger, here = await registered(network, a, "forger")
    remote_forger, there = await registered(network, b, "forger")
    await network.settle()
    requester.send_data(group, asking, b"?", msg_id=3, flags=FLAG_REQUEST)
    await network.settle()
    assert [f.payload for f in member.take_data()] == [b"?"]
    assert len(b.pending) == 1
    answer(remote_forger, there, asking, 3)
    await network.settle()
    assert b.stats.dropped_wrong_responder == 1, "b delivered to the member: b checks"
    answer(local_forger, here, asking, 3)
    await network.settle()
    assert a.stats.dropped_wrong_responder == 1, "a sent it to b: only b may answer"
    assert requester.take_data() == []
    answer(member, working, asking, 3)
    await network.settle()
    assert [f.src for f in requester.take_data()] == [working]
    assert (len(a.pending), len(b.pending)) == (0, 0)


async def test_an_unanswered_anycast_times_out_once_from_the_requesters_broker(
    network: FakeNetwork, clock: FakeClock, pair: list[Broker]
) -> None:
    a, b = pair
    requester, asking = await registered(network, a, "asker")
    member, working = await registered(network, b, "worker")
    await member.join(working, POOL)
    await network.settle()
    requester.send_data(POOL, asking, b"?", msg_id=3, flags=FLAG_REQUEST, timeout_ms=1000)
    await network.settle()
    assert len(b.pending) == 1, "the broker that picked keeps the pick"
    clock.advance(1.0)
    b.expire_requests()
    a.expire_requests()
    await network.settle()
    assert (b.stats.timeouts, a.stats.timeouts) == (0, 1)
    assert len(requester.take(ControlType.TIMEOUT)) == 1
    answer(member, working, asking, 3)
    await network.settle()
    assert requester.take_data() == []
    assert a.stats.late_responses == 1


async def test_a_multicast_request_is_answered_by_a_member_over_a_link_it_went_to(
    network: FakeNetwork, pair: list[Broker]
) -> None:
    a, b = pair
    requester, asking = await registered(network, a, "asker")
    near, near_member = await registered(network, a, "near")
    far, far_member = await registered(network, b, "far")
    outsider, outside = await registered(network, a, "outsider")
    for client, member in ((near, near_member), (far, far_member)):
        await client.join(member, TOPIC)
    await network.settle()
    # The far member answers over the peer link, the near one over its own; the second
    # request reuses the first's decision.
    for msg_id, client, member in ((1, far, far_member), (2, near, near_member)):
        requester.send_data(TOPIC, asking, b"?", msg_id=msg_id, flags=FLAG_REQUEST)
        await network.settle()
        answer(outsider, outside, asking, msg_id)
        await network.settle()
        assert requester.take_data() == []
        answer(client, member, asking, msg_id)
        await network.settle()
        assert [f.src for f in requester.take_data()] == [member]
    assert a.stats.dropped_wrong_responder == 2
