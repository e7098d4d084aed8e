"""The error tree across the calls that need a broker.

* Every public method of a connector, a service and the stream client, given a value
  it cannot use, raises ``InvalidArgument`` (a ``ValueError``) -- before any I/O, so
  the connector is as good as before.
* A timeout, wherever it comes from (the broker's TIMEOUT, the local deadline of a
  receive, waiting for acknowledgements), is caught by ``except TimeoutError``.
* A link that broke, and a connector that was closed, are caught by
  ``except ConnectionError``.

The calls that need no broker are in tests/unit/test_errors.py.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest

import meshbus
from meshbus import Anycast, InvalidArgument, Multicast, Unicast
from tests.conftest import BrokerProcess, start_broker

NOBODY = Unicast("nobody", 9)


@dataclass
class Bus:
    conn: meshbus.Connector
    svc: meshbus.Service


@pytest.fixture
async def bus(broker: BrokerProcess) -> AsyncIterator[Bus]:
    async with await meshbus.connect(broker.address, server="errors") as conn:
        yield Bus(conn, await conn.register())


CALLS: dict[str, Callable[[Bus], Awaitable[object]]] = {
    # Connector
    "register, instance 0": lambda b: b.conn.register(instance=0),
    "register, instance above the fixed range": lambda b: b.conn.register(instance=65536),
    "register, negative instance": lambda b: b.conn.register(instance=-1),
    "drain_broker, negative grace": lambda b: b.conn.drain_broker(grace=-1),
    "drain_broker, NaN grace": lambda b: b.conn.drain_broker(grace=math.nan),
    "wait_acked, negative timeout": lambda b: b.conn.wait_acked(timeout=-1),
    "streams.add, capture not an address": lambda b: b.conn.streams.add("s", "nocolon"),
    "streams.add, a limit beyond 64 bits": lambda b: b.conn.streams.add(
        "s", "multicast:s", max_msgs=1 << 70
    ),
    "streams.fetch, a seq beyond 64 bits": lambda b: b.conn.streams.fetch("s", from_seq=1 << 70),
    # Within 64 bits, beyond what the broker's decoder takes (its PROTOCOL_ERROR would
    # close the link): refused before it is sent.
    "streams.add, a limit the broker refuses": lambda b: b.conn.streams.add(
        "s", "multicast:s", max_msgs=2**64 - 1
    ),
    "streams.consumer, a start the broker refuses": lambda b: b.conn.streams.consumer(
        "s", "c", start_seq=2**64 - 1
    ),
    # Service: sending
    "send, address without ':'": lambda b: b.svc.send("nocolon", b"x"),
    "send, instance 0": lambda b: b.svc.send("game01:0", b"x"),
    "send, final without a group": lambda b: b.svc.send(NOBODY, b"x", final=True),
    "send, reliable final without a group": lambda b: b.svc.send(
        NOBODY, b"x", reliable=True, final=True
    ),
    "send, a group to a multicast address": lambda b: b.svc.send(Multicast("m"), b"x", group="g"),
    "send, a group to a unicast address": lambda b: b.svc.send(NOBODY, b"x", group="g"),
    "send, group id too long": lambda b: b.svc.send(Anycast("a"), b"x", group="g" * 1025),
    "send, priority out of range": lambda b: b.svc.send(NOBODY, b"x", priority=1 << 31),
    "send, negative priority out of range": lambda b: b.svc.send(
        NOBODY, b"x", priority=-(1 << 31) - 1
    ),
    "send, reliable priority out of range": lambda b: b.svc.send(
        NOBODY, b"x", reliable=True, priority=1 << 63
    ),
    "send, publish id too long": lambda b: b.svc.send(NOBODY, b"x", publish_id=bytes(1025)),
    "send_reliable, address without ':'": lambda b: b.svc.send_reliable("nocolon", b"x"),
    "send_reliable, final without a group": lambda b: b.svc.send_reliable(NOBODY, b"x", final=True),
    "send_reliable, a group to a multicast address": lambda b: b.svc.send_reliable(
        Multicast("m"), b"x", group="g"
    ),
    "send_reliable, publish id too long": lambda b: b.svc.send_reliable(
        NOBODY, b"x", publish_id=bytes(1025)
    ),
    "request, timeout 0": lambda b: b.svc.request(NOBODY, b"x", timeout=0),
    "request, negative timeout": lambda b: b.svc.request(NOBODY, b"x", timeout=-1),
    "request, NaN timeout": lambda b: b.svc.request(NOBODY, b"x", timeout=math.nan),
    "request, address without ':'": lambda b: b.svc.request("nocolon", b"x"),
    "publish, wildcard subject": lambda b: b.svc.publish("a.*", b"x"),
    "publish, empty subject": lambda b: b.svc.publish("", b"x"),
    "publish, reliable to a subject with ':'": lambda b: b.svc.publish("a:b", b"x", reliable=True),
    "publish, priority out of range": lambda b: b.svc.publish(
        "t", b"x", priority=1 << 40, reliable=True
    ),
    "broadcast, priority out of range": lambda b: b.svc.broadcast(b"x", priority=1 << 40),
    "subscribe_other, address without ':'": lambda b: b.svc.subscribe_other("t", "nocolon"),
    "subscribe_other, subject too long": lambda b: b.svc.subscribe_other("t" * 20000, NOBODY),
    "unsubscribe_other, empty subject": lambda b: b.svc.unsubscribe_other("", NOBODY),
    # Service: membership
    "join, a unicast address": lambda b: b.svc.join(NOBODY),
    "join, address without ':'": lambda b: b.svc.join("nocolon"),
    "leave, a unicast address": lambda b: b.svc.leave("game01:1"),
    "subscribe, subject too long": lambda b: b.svc.subscribe("x" * 20000),
    "subscribe, one bad subject of several": lambda b: b.svc.subscribe(["fine", "a..b"]),
    "unsubscribe, empty subject": lambda b: b.svc.unsubscribe(""),
}


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
async def test_a_bad_value_is_an_invalid_argument_before_any_io(
    bus: Bus, call: Callable[[Bus], Awaitable[object]]
) -> None:
    with pytest.raises(InvalidArgument) as raised:
        await call(bus)
    assert isinstance(raised.value, ValueError)
    assert str(raised.value)
    # Nothing was sent or changed: the link is as good as before.
    assert bus.conn.unacked == 0
    assert bus.svc.groups == frozenset()
    await bus.conn.ping()


async def test_every_timeout_is_a_timeout_error(bus: Bus) -> None:
    silent = await bus.conn.register()  # registered, never answers
    with pytest.raises(TimeoutError) as raised:
        await bus.svc.recv(timeout=0.05)
    assert isinstance(raised.value, meshbus.Timeout)
    with pytest.raises(TimeoutError) as raised:  # the broker's TIMEOUT
        await bus.svc.request(silent.address, b"hello?", timeout=0.1)
    assert isinstance(raised.value, meshbus.Timeout)
    assert raised.value.timeout == 0.1
    await bus.svc.send(NOBODY, b"x", reliable=True)  # resent until given up: seconds
    with pytest.raises(TimeoutError) as raised:
        await bus.conn.wait_acked(timeout=0.05)
    assert isinstance(raised.value, meshbus.Timeout)
    assert raised.value.timeout == 0.05


async def test_a_lost_link_and_a_closed_connector_are_connection_errors() -> None:
    broker = await start_broker()
    conn = await meshbus.connect(broker.address, server="doomed", failover=False, keepalive=0)
    try:
        svc = await conn.register()
        silent = await conn.register()
        pending = asyncio.ensure_future(svc.request(silent.address, b"x", timeout=30))
        await conn.ping()  # the request is at the broker
        broker.process.kill()
        with pytest.raises(ConnectionError) as raised:
            await asyncio.wait_for(pending, 5)
        assert isinstance(raised.value, meshbus.ConnectionLost)
        with pytest.raises(ConnectionError):
            await svc.send(silent.address, b"after")
        with pytest.raises(ConnectionError):
            await conn.ping()
    finally:
        await conn.close()
        await broker.process.wait()


async def test_a_closed_connector_is_a_connection_error(broker: BrokerProcess) -> None:
    conn = await meshbus.connect(broker.address, server="closed")
    svc = await conn.register()
    await conn.close()
    for call in (
        lambda: svc.send(NOBODY, b"x"),
        lambda: svc.recv(timeout=1),
        lambda: conn.register(),
        lambda: conn.stat(),
    ):
        with pytest.raises(ConnectionError) as raised:
            await call()
        assert isinstance(raised.value, meshbus.NotConnected)
