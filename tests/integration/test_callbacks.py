"""Every handler that can be added can be removed: ``on_undeliverable``,
``on_delivery_failed``, ``on_suspected_dead``, ``on_service_left`` and
``Service.add_listener`` each return the function that removes it.

Each test keeps a second handler that is never removed: it proves the event after
the removal did happen, so the removed handler's silence is not just a slow broker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

import meshbus
from meshbus import Unicast
from tests.conftest import BrokerProcess

IO_TIMEOUT = 5.0

# Give up on a reliable send after two quick attempts, and suspect its receiver at once.
QUICK = meshbus.ReliableConfig(
    retry=meshbus.RetryPolicy(ack_timeout=0.02, max_interval=0.02, max_attempts=2),
    suspicion=1,
)


@pytest.fixture
async def conn(broker: BrokerProcess) -> AsyncIterator[meshbus.Connector]:
    async with await meshbus.connect(broker.address, server="cb", reliable=QUICK) as conn:
        yield conn


async def until(condition: asyncio.Event) -> None:
    async with asyncio.timeout(IO_TIMEOUT):
        await condition.wait()


class Counted:
    """A handler that counts its calls and sets ``reached`` at the ``target``-th."""

    def __init__(self, target: int = 0) -> None:
        self.calls: list[object] = []
        self.target = target
        self.reached = asyncio.Event()

    def __call__(self, value: object) -> None:
        self.calls.append(value)
        if len(self.calls) == self.target:
            self.reached.set()


async def test_on_undeliverable_handler_can_be_removed(conn: meshbus.Connector) -> None:
    svc = await conn.register()
    removed, kept = Counted(), Counted(target=2)
    remove = conn.on_undeliverable(removed)
    conn.on_undeliverable(kept)
    await svc.send(Unicast("nobody", 1), b"first", notify=True)
    async with asyncio.timeout(IO_TIMEOUT):
        while not kept.calls:  # noqa: ASYNC110 - the report comes as a frame, no event
            await asyncio.sleep(0.01)
    remove()
    remove()  # harmless
    await svc.send(Unicast("nobody", 2), b"second", notify=True)
    await until(kept.reached)
    assert len(removed.calls) == 1


@pytest.mark.parametrize(
    ("on", "first"),
    [
        (meshbus.Connector.on_delivery_failed, meshbus.DeliveryFailed),
        (meshbus.Connector.on_suspected_dead, str),
    ],
)
async def test_a_given_up_send_handler_can_be_removed(
    conn: meshbus.Connector,
    on: Callable[[meshbus.Connector, Counted], Callable[[], None]],
    first: type,
) -> None:
    """A reliable send given up calls both kinds of handler before wait_acked returns."""
    svc = await conn.register()
    removed, kept = Counted(), Counted()
    remove = on(conn, removed)
    on(conn, kept)
    await svc.send(Unicast("nobody", 1), b"first", reliable=True)
    await conn.wait_acked(IO_TIMEOUT)
    assert len(removed.calls) == len(kept.calls) == 1
    assert isinstance(kept.calls[0], first)
    remove()
    await svc.send(Unicast("nobody", 2), b"second", reliable=True)
    await conn.wait_acked(IO_TIMEOUT)
    assert (len(removed.calls), len(kept.calls)) == (1, 2)


async def test_on_service_left_handler_can_be_removed(
    conn: meshbus.Connector, broker: BrokerProcess
) -> None:
    removed, kept = Counted(), Counted(target=2)
    remove = await conn.on_service_left(removed)
    await conn.on_service_left(kept)
    async with await meshbus.connect(broker.address, server="leaver") as other:
        first, second = await other.register(), await other.register()
        await first.unregister()
        async with asyncio.timeout(IO_TIMEOUT):
            while not kept.calls:  # noqa: ASYNC110 - LEFT comes as a frame, no event
                await asyncio.sleep(0.01)
        remove()
        await second.unregister()
        await until(kept.reached)
    assert removed.calls == [[str(first.address)]]
    assert kept.calls == [[str(first.address)], [str(second.address)]]


async def test_a_listener_can_be_removed_and_the_queue_comes_back(
    conn: meshbus.Connector,
) -> None:
    svc, sender = await conn.register(), await conn.register()
    removed, kept = Counted(), Counted(target=2)
    remove = svc.add_listener(removed)
    remove_kept = svc.add_listener(kept)
    await sender.send(svc.address, b"one")
    async with asyncio.timeout(IO_TIMEOUT):
        while not kept.calls:  # noqa: ASYNC110 - listeners are called from the link
            await asyncio.sleep(0.01)
    remove()
    await sender.send(svc.address, b"two")
    await until(kept.reached)
    assert [m.payload for m in removed.calls] == [b"one"]  # type: ignore[attr-defined]
    with pytest.raises(meshbus.NoQueue):
        await svc.recv(timeout=0.01)
    remove_kept()
    await sender.send(svc.address, b"three")
    assert (await svc.recv(timeout=IO_TIMEOUT)).payload == b"three"
    assert len(kept.calls) == 2


async def test_a_listener_added_to_a_full_inbox_gets_the_rest_too(broker: BrokerProcess) -> None:
    """The inbox empties into the listener, so the links that stopped reading while it was
    full read again."""
    async with (
        await meshbus.connect(broker.address, server="sender") as sending,
        await meshbus.connect(broker.address, server="reader", max_inbox=5) as reading,
    ):
        sender, reader = await sending.register(), await reading.register()
        total = 50
        for i in range(total):
            await sender.send(reader.address, b"%d" % i)
        async with asyncio.timeout(IO_TIMEOUT):
            while len(reader._mailbox._inbox) < 5:  # noqa: ASYNC110 - no event for "full"
                await asyncio.sleep(0.01)
        got = Counted(target=total)
        reader.add_listener(got)
        await until(got.reached)
        assert [m.payload for m in got.calls] == [b"%d" % i for i in range(total)]  # type: ignore[attr-defined]
