"""The mesh's events in the telemetry records (``MeshEvent`` of broker/mesh/membership.py):
each broker records the joins, drains, goodbyes and crashes it sees, and which peers it is linked to
with their connectors -- all a report has of a broker whose own streams died with it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from meshbus.broker.server import Broker
from meshbus.testing import FakeClock, FakeNetwork, address_of, build_mesh, connector

# Long enough that no record is written during a test: the events stay in waiting.
INTERVAL = 3600.0


def events(broker: Broker) -> list[tuple[str, str, str | None]]:
    return [(e["kind"], e["broker"], e["reason"]) for e in broker.telemetry.events]


async def test_joins_a_drain_a_goodbye_and_a_crash(network: FakeNetwork, clock: FakeClock) -> None:
    a, _, c, d = await build_mesh(network, 4, telemetry_interval=INTERVAL)
    # Each broker's first record (taken as it became ready) had its own join; the joins
    # of the brokers after it wait for the next one.
    assert events(a) == [("join", "b", None), ("join", "c", None), ("join", "d", None)]
    assert events(d) == []
    await c.mesh.drain(0.0)
    await c.mesh.stop()
    await network.settle()
    assert events(c) == [("join", "d", None), ("drain", "c", None)]  # not its goodbyes
    before = time.time()
    clock.advance(0.25)  # the fake clock: how long d has been silent when it crashes
    network.crash(address_of("d"))
    await network.settle()
    assert events(a)[3:] == [
        ("drain", "c", None),
        ("leave", "c", "peer-bye"),
        ("crash", "d", "connection-lost"),
    ]
    crash = a.telemetry.events[-1]
    assert crash["last_heard"] == pytest.approx(crash["at"] - 0.25)
    assert before <= crash["at"] <= time.time()


async def test_a_record_lists_the_peers_with_their_connectors(network: FakeNetwork) -> None:
    a, b = await build_mesh(network, 2, telemetry_interval=INTERVAL)
    await connector(network, b, "on-b")
    await connector(network, b, "on-b2")
    await network.settle()
    record: dict[str, Any] = a.telemetry.record(time.time(), [])
    assert record["peers"] == [
        {"name": "b", "address": address_of("b"), "connectors": 2, "draining": False}
    ]
    assert record["events"] == []


async def test_without_telemetry_no_event_waits(network: FakeNetwork) -> None:
    a, _ = await build_mesh(network, 2)
    assert a.telemetry.events == []
