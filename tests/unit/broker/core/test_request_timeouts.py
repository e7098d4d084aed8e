"""Pending requests on the fake clock: a request not answered by its deadline gets one
TIMEOUT from the broker where it entered the mesh. The test is the sweeper: it moves
the clock and calls ``expire_requests``."""

from __future__ import annotations

import pytest

from meshbus.broker.server import Broker
from meshbus.protocol.codec import ControlFrame
from meshbus.protocol.control import DeliveryFailure
from meshbus.protocol.layout import FLAG_REQUEST, FLAG_RESPONSE, ControlType
from meshbus.testing import (
    FakeClient,
    FakeClock,
    FakeNetwork,
    address_of,
    build_mesh,
    connector,
    tick,
)


@pytest.fixture
async def pair(network: FakeNetwork) -> list[Broker]:
    return await build_mesh(network, 2, default_request_timeout=2.0)


async def two_ends(
    network: FakeNetwork, pair: list[Broker]
) -> tuple[FakeClient, bytes, FakeClient, bytes]:
    """A requester on a and a responder on b, both registered mesh-wide."""
    requester = await connector(network, pair[0], "requester")
    asking = await requester.register("asker")
    responder = await connector(network, pair[1], "responder")
    answering = await responder.register("server", 1)
    await network.settle()
    return requester, asking, responder, answering


def failures(client: FakeClient, type_: ControlType) -> list[DeliveryFailure]:
    found = []
    for frame in client.take(type_):
        assert isinstance(frame, ControlFrame)
        assert frame.correlation == 0
        assert isinstance(frame.body, DeliveryFailure)
        found.append(frame.body)
    return found


@pytest.mark.parametrize(("timeout_ms", "seconds"), [(1500, 1.5), (0, 2.0)], ids=["own", "default"])
async def test_an_unanswered_request_times_out_once_at_its_deadline(
    network: FakeNetwork,
    clock: FakeClock,
    pair: list[Broker],
    timeout_ms: int,
    seconds: float,
) -> None:
    a, _ = pair
    requester, asking, responder, answering = await two_ends(network, pair)
    requester.send_data(
        answering, asking, b"?", msg_id=9, flags=FLAG_REQUEST, timeout_ms=timeout_ms
    )
    await network.settle()
    assert [f.payload for f in responder.take_data()] == [b"?"], "delivered, never answered"
    clock.advance(seconds - 0.25)
    a.expire_requests()
    await network.settle()
    assert failures(requester, ControlType.TIMEOUT) == []
    clock.advance(0.25)
    a.expire_requests()
    await network.settle()
    timed_out = failures(requester, ControlType.TIMEOUT)
    assert [(t.msg_id, t.src, t.dst) for t in timed_out] == [(9, asking, answering)]
    assert a.stats.timeouts == 1
    for _ in range(120):  # a minute, the heartbeats keeping the peer link alive
        await tick(network, pair)
    a.expire_requests()
    await network.settle()
    assert failures(requester, ControlType.TIMEOUT) == [], "exactly once"
    assert a.stats.timeouts == 1
    # The answer comes after all: too late, dropped and counted where the request entered.
    responder.send_data(asking, answering, b"!", msg_id=1, response_for=9, flags=FLAG_RESPONSE)
    await network.settle()
    assert requester.take_data() == []
    assert a.stats.late_responses == 1


async def test_an_answered_request_never_times_out(
    network: FakeNetwork, clock: FakeClock, pair: list[Broker]
) -> None:
    a, b = pair
    requester, asking, responder, answering = await two_ends(network, pair)
    requester.send_data(answering, asking, b"?", msg_id=4, flags=FLAG_REQUEST, timeout_ms=500)
    await network.settle()
    responder.send_data(asking, answering, b"!", msg_id=1, response_for=4, flags=FLAG_RESPONSE)
    await network.settle()
    assert [f.payload for f in requester.take_data()] == [b"!"]
    clock.advance(10.0)
    for broker in pair:
        broker.expire_requests()
    await network.settle()
    assert failures(requester, ControlType.TIMEOUT) == []
    assert a.stats.timeouts == b.stats.timeouts == 0
    assert len(a.pending) == len(b.pending) == 0


async def test_a_request_through_a_peer_that_is_lost_fails_at_once_and_not_again(
    network: FakeNetwork, clock: FakeClock, pair: list[Broker]
) -> None:
    a, _ = pair
    requester, asking, _, answering = await two_ends(network, pair)
    requester.send_data(answering, asking, b"?", msg_id=5, flags=FLAG_REQUEST, timeout_ms=1000)
    await network.settle()
    network.crash(address_of("b"))
    await network.settle()
    lost = failures(requester, ControlType.NO_ROUTE)
    assert [(f.msg_id, f.src, f.dst) for f in lost] == [(5, asking, answering)]
    clock.advance(5.0)
    a.expire_requests()
    await network.settle()
    assert failures(requester, ControlType.TIMEOUT) == []
    assert a.stats.timeouts == 0
