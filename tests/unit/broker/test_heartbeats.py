"""Heartbeats on the fake clock: a peer silent for ``heartbeat_misses`` intervals is dead,
and its routes leave; one that keeps talking stays. The test is the timer: it moves the
clock by an interval and calls ``housekeeping``, as the broker's own timer would."""

from __future__ import annotations

import math

import pytest

from meshbus.broker.server import Broker
from tests.unit.broker.fakes import (
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
