"""Heartbeats on the fake clock: a peer silent for ``heartbeat_misses`` intervals is dead,
and its routes leave; one that keeps talking stays. The test is the timer: it moves the
clock by an interval and calls ``housekeeping``, as the broker's own timer would."""

from __future__ import annotations

import math

import pytest

from meshbus.broker.core.endpoint import PeerInfo
from meshbus.broker.server import Broker
from meshbus.protocol.control import Load
from meshbus.testing import (
    FakeClock,
    FakeNetwork,
    address_of,
    build_mesh,
    connector,
    routes_everywhere,
    tick,
)

INTERVAL = 0.5
MISSES = 3


@pytest.fixture
async def pair(network: FakeNetwork) -> list[Broker]:
    return await build_mesh(
        network, 2, heartbeat_interval=INTERVAL, heartbeat_misses=MISSES, boost_window=30.0
    )


async def test_a_peer_silent_for_heartbeat_misses_intervals_is_closed_and_its_routes_leave(
    network: FakeNetwork, clock: FakeClock, pair: list[Broker]
) -> None:
    a, b = pair
    on_b = await connector(network, b, "on-b")
    address = await on_b.register("svc", 1)
    await network.settle()
    assert routes_everywhere(pair, address) == {"a": "b", "b": "local"}
    # The first check takes the link-up traffic as heard; then MISSES silent intervals.
    for _ in range(MISSES):
        await tick(network, [a], INTERVAL)
        assert a.peers.names() == ["b"]
    await tick(network, [a], INTERVAL)
    assert a.peers.names() == []
    assert a.links.closed["heartbeat-timeout"] == 1
    assert routes_everywhere(pair, address) == {"a": None, "b": "local"}
    # a closed its end, so b loses a too (its own services stay its own).
    assert b.peers.names() == []
    assert b.links.closed["client-eof"] == 1
    # A peer that went silent crashed: a takes more connectors for the boost window.
    assert a.mesh.stats.peers_crashed == 1
    assert a.mesh.capacity == math.ceil(a.config.max_connectors * a.config.capacity_boost)
    clock.advance(a.config.boost_window)
    assert a.mesh.capacity == a.config.max_connectors


async def test_a_peer_that_keeps_talking_is_not_closed(
    network: FakeNetwork, clock: FakeClock, pair: list[Broker]
) -> None:
    a, b = pair
    on_b = await connector(network, b, "on-b")
    address = await on_b.register("svc", 1)
    for _ in range(4 * MISSES):
        await tick(network, [a, b], INTERVAL)
    assert a.peers.names() == ["b"]
    assert b.peers.names() == ["a"]
    assert routes_everywhere(pair, address) == {"a": "b", "b": "local"}
    assert a.mesh.stats.peers_lost == b.mesh.stats.peers_lost == 0


async def test_a_hung_peer_is_declared_dead_by_the_broker_that_hears_nothing(
    network: FakeNetwork, clock: FakeClock, pair: list[Broker]
) -> None:
    """A hung host or a partition: both brokers talk, nothing gets through."""
    a, b = pair
    network.wire_between(address_of("a"), address_of("b")).hold()
    for _ in range(MISSES):
        await tick(network, [a, b], INTERVAL)
        assert (a.peers.names(), b.peers.names()) == (["b"], ["a"])
    await tick(network, [a, b], INTERVAL)
    assert (a.peers.names(), b.peers.names()) == ([], [])
    assert a.links.closed["heartbeat-timeout"] == b.links.closed["heartbeat-timeout"] == 1


async def test_a_peers_round_trip_is_timed_by_the_heartbeat_loads(
    network: FakeNetwork, clock: FakeClock, pair: list[Broker]
) -> None:
    """Each heartbeat LOAD is stamped with its sender's clock and echoes the stamp of
    the peer's last LOAD with how long it was held: the round trip is the time since our
    stamp less the holding, whichever way the delay was (stat's ``rtt_ms``, /metrics)."""
    a, b = pair

    def rtt_ms() -> float | None:
        [peer] = a.stat.brief()["peer_links"]
        return peer["rtt_ms"]  # type: ignore[no-any-return]

    assert rtt_ms() is None  # the LOADs of the join are not stamped
    wire = network.wire_between(address_of("a"), address_of("b"))
    await tick(network, [a], INTERVAL)  # a's stamped LOAD reaches b at once
    wire.hold()
    await tick(network, [b], INTERVAL)  # b echoes it, held 0.5 s; 0.2 s on the way back
    clock.advance(0.2)
    wire.release()
    await network.settle()
    assert rtt_ms() == pytest.approx(200)
    wire.hold()
    await tick(network, [a], INTERVAL)  # 0.3 s on the way out this time
    clock.advance(0.3)
    wire.release()
    await network.settle()
    await tick(network, [b], INTERVAL)
    assert rtt_ms() == pytest.approx(300)


async def test_an_echo_of_a_stamp_never_sent_times_nothing(clock: FakeClock) -> None:
    peer = PeerInfo(listen="b:1", slot=2, tag_in=1, tag_out=b"\0\0\0\1", clock=clock, budget=1.5)
    now = clock()
    peer.loaded(Load(sent_at=5.0, echo=now + 10, held=0.0))  # from the future
    peer.loaded(Load(sent_at=5.0, echo=now - 1, held=3.0))  # held longer than it was out
    assert peer.rtt is None
    peer.loaded(Load(sent_at=5.0, echo=now - 1, held=0.25))
    assert peer.rtt == pytest.approx(0.75)
