"""One NATS client's connection (meshbus.broker.nats.connection) on a fake transport, on
the simulated loop: its greeting, a flood read in slices, a slow consumer, stale pings,
and what a closed connection leaves in the subject table (nothing)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from meshbus.broker.core.interest import LocalInterest
from meshbus.broker.core.subjects import SubjectTable
from meshbus.broker.nats.connection import (
    Flushes,
    NatsCloseReason,
    NatsConnection,
    Subscription,
)
from meshbus.broker.nats.interest import NatsInterest
from meshbus.broker.nats.peers import PeerMessages
from meshbus.broker.nats.router import NatsRouter
from meshbus.protocol.nats import NatsParser
from meshbus.testing.network import FakeTransport, attach, feed

QUIET = b'CONNECT {"verbose":false,"pedantic":false}\r\n'


class Server:
    """Connections sharing one table and router, as a listener's do."""

    def __init__(self, max_pending: int = 1 << 20) -> None:
        self.table: SubjectTable[Subscription] = SubjectTable()
        self.router = NatsRouter(self.table, PeerMessages(lambda: None), random.Random(3))
        # A broker with no peer: every change is known mesh-wide at once.
        self.interest = NatsInterest(
            self.table, LocalInterest(), lambda op, subject, extra: None,
            lambda then: then(), lambda subject: None,
        )  # fmt: skip
        self.flushes = Flushes()
        self.max_pending = max_pending
        self.closed: list[tuple[int, NatsCloseReason]] = []
        self._ids = 0

    def connect(self) -> tuple[NatsConnection, FakeTransport]:
        self._ids += 1
        conn = NatsConnection(
            self._ids,
            parser=NatsParser(),
            table=self.interest,
            router=self.router,
            flushes=self.flushes,
            info=lambda conn: b"INFO {}\r\n",
            max_pending=self.max_pending,
            max_subscriptions=10,
            on_open=lambda conn: None,
            on_close=lambda conn, reason: self.closed.append((conn.client_id, reason)),
        )
        return attach(conn, ("127.0.0.1", 5000 + self._ids))


async def test_greeted_with_info_then_answered() -> None:
    server = Server()
    conn, transport = server.connect()
    assert bytes(transport.captured) == b"INFO {}\r\n"
    feed(conn, QUIET + b"PING\r\nSUB a 1\r\nSUB a..b 2\r\nPUB a 2\r\nhi\r\n")
    assert bytes(transport.captured) == (
        b"INFO {}\r\nPONG\r\n-ERR 'Invalid Subject'\r\nMSG a 1 2\r\nhi\r\n"
    )


async def test_a_flood_is_handled_in_slices_and_all_of_it() -> None:
    server = Server(max_pending=1 << 30)
    receiver, received = server.connect()
    feed(receiver, QUIET + b"SUB flood 1\r\n")
    sender, sending = server.connect()
    count = 50_000
    feed(sender, QUIET + b"PUB flood 1\r\nx\r\n" * count)
    # Far more than a 5 ms slice of work: reading stopped, to go on at the next turns.
    assert not sending.reading
    for _ in range(100_000):  # loop turns, each a slice of the flood
        if sending.reading:
            break
        await asyncio.sleep(0)
    assert sending.reading
    assert received.captured.count(b"MSG flood 1 1\r\nx\r\n") == count


async def test_a_slow_consumer_is_aborted_and_leaves_the_table() -> None:
    server = Server(max_pending=4096)
    slow, slow_transport = server.connect()
    feed(slow, QUIET + b"SUB s 1\r\nSUB t 2\r\n")
    assert len(server.table) == 2
    sender, _ = server.connect()
    feed(sender, QUIET + b"PUB s 1000\r\n" + b"y" * 1000 + b"\r\n")
    assert not slow.closed
    feed(sender, (b"PUB s 1000\r\n" + b"y" * 1000 + b"\r\n") * 5)
    assert slow.closed
    assert slow_transport.aborted
    assert (slow.client_id, NatsCloseReason.SLOW_CONSUMER) in server.closed
    assert len(server.table) == 0
    assert not sender.closed


async def test_unanswered_pings_make_a_connection_stale() -> None:
    server = Server()
    conn, transport = server.connect()
    feed(conn, QUIET)
    conn.ping(2)  # heard from since the last tick: no ping needed
    conn.ping(2)
    conn.ping(2)
    server.flushes.flush()
    assert transport.captured.count(b"PING\r\n") == 2
    feed(conn, b"PONG\r\n")
    conn.ping(2)  # a PONG is hearing from it
    conn.ping(2)
    conn.ping(2)
    assert not conn.closed
    conn.ping(2)
    assert conn.closed
    assert bytes(transport.captured).endswith(b"-ERR 'Stale Connection'\r\n")
    assert transport.closing


async def test_a_ping_after_a_sub_is_answered_once_the_mesh_knows_it() -> None:
    """docs/nats.md, "Across the mesh": the PONG waits for every peer's confirmation of
    the interest change, and every PONG after it waits its turn; a PING with no change
    before it is answered at once."""
    server = Server()
    waiting: list[Callable[[], None]] = []
    server.interest = NatsInterest(
        server.table, LocalInterest(), lambda op, subject, extra: None,
        waiting.append, lambda subject: None,
    )  # fmt: skip
    conn, transport = server.connect()
    feed(conn, QUIET + b"PING\r\n")
    assert transport.captured.endswith(b"PONG\r\n")
    transport.captured.clear()
    feed(conn, b"SUB a 1\r\nPING\r\nPING\r\n")
    assert bytes(transport.captured) == b""
    assert len(waiting) == 2
    waiting.pop(0)()
    assert bytes(transport.captured) == b"PONG\r\n"
    feed(conn, b"PING\r\n")  # no change of its own, but a PONG still owed before it
    waiting.pop(0)()
    assert bytes(transport.captured) == b"PONG\r\n" * 2
    waiting.pop(0)()
    assert bytes(transport.captured) == b"PONG\r\n" * 3
    feed(conn, b"PING\r\n")
    assert bytes(transport.captured) == b"PONG\r\n" * 4
    assert waiting == []
