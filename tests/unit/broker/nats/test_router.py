"""Where a NATS client's message goes (meshbus.broker.nats.router), with real
connections that are not on a socket yet: what each would write is read from its
queued output, parsed back as a client would."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from meshbus.broker.core.interest import LocalInterest, PeerInterest
from meshbus.broker.core.subjects import SubjectTable
from meshbus.broker.nats.connection import Flushes, NatsConnection, Subscription
from meshbus.broker.nats.interest import NatsInterest
from meshbus.broker.nats.peers import PeerMessages
from meshbus.broker.nats.router import NatsRouter
from meshbus.protocol.codec import ControlFrame, FrameDecoder
from meshbus.protocol.control import NatsMessages
from meshbus.protocol.layout import ControlType
from meshbus.protocol.nats import NatsParser, Publish, Subscribe, Unsubscribe, encode_msg


class Clients:
    """Connections on one table and router, driven by the operations a client sends."""

    def __init__(self, seed: int = 1) -> None:
        self.table: SubjectTable[Subscription] = SubjectTable()
        self.router = NatsRouter(self.table, PeerMessages(lambda: None), random.Random(seed))
        # A broker with no peer: every change is known mesh-wide at once.
        self.interest = NatsInterest(
            self.table, LocalInterest(), lambda op, subject, extra: None,
            lambda then: then(), lambda subject: None,
        )  # fmt: skip
        self.flushes = Flushes()
        self._ids = 0

    def connect(
        self,
        connect: bytes = b'{"verbose":false,"headers":true,"no_responders":true}',
        max_pending: int = 1 << 20,
    ) -> NatsConnection:
        self._ids += 1
        parser = NatsParser()
        parser.feed(b"CONNECT " + connect + b"\r\n")
        assert parser.next_event() is not None
        return NatsConnection(
            self._ids,
            parser=parser,
            table=self.interest,
            router=self.router,
            flushes=self.flushes,
            info=lambda conn: b"",
            max_pending=max_pending,
            max_subscriptions=100,
            on_open=lambda conn: None,
            on_close=lambda conn, reason: None,
        )


def subscribe(conn: NatsConnection, subject: bytes, sid: bytes, queue: bytes = b"") -> None:
    conn._handle(Subscribe(subject, queue, sid))


def messages(conn: NatsConnection) -> list[tuple[bytes, bytes]]:
    """Each message queued for ``conn`` -- its MSG or HMSG line and its data -- read as a
    client reads them (a run of messages is queued as one write), and forget them."""
    out = b"".join(conn._out)
    conn._out.clear()
    found = []
    pos = 0
    while pos < len(out):
        end = out.index(b"\r\n", pos)
        line = out[pos:end]
        size = int(line.split()[-1])
        found.append((line, out[end + 2 : end + 2 + size]))
        assert out[end + 2 + size : end + 4 + size] == b"\r\n"
        pos = end + 4 + size
    return found


def taken(conn: NatsConnection) -> list[bytes]:
    """The MSG or HMSG line of each message queued for ``conn``, and forget them."""
    return [line for line, _ in messages(conn)]


def test_one_copy_per_matching_sid() -> None:
    clients = Clients()
    a = clients.connect()
    subscribe(a, b"x.*", b"1")
    subscribe(a, b"x.>", b"2")
    subscribe(a, b"y", b"3")
    clients.router.publish(a, Publish(b"x.y", b"", 0, b"hi"))
    assert sorted(taken(a)) == [b"MSG x.y 1 2", b"MSG x.y 2 2"]


@pytest.mark.parametrize("seed", range(5))
def test_a_queue_group_gets_one_copy_and_every_member_gets_some(seed: int) -> None:
    clients = Clients(seed)
    members = [clients.connect() for _ in range(3)]
    for member in members:
        subscribe(member, b"work", b"1", b"g")
    publisher = clients.connect()
    for _ in range(60):
        clients.router.publish(publisher, Publish(b"work", b"", 0, b""))
    counts = [len(taken(member)) for member in members]
    assert sum(counts) == 60
    assert all(counts)


def test_echo_off_skips_the_publishers_own_and_picks_another_member() -> None:
    clients = Clients()
    quiet = clients.connect(b'{"verbose":false,"echo":false}')
    other = clients.connect()
    subscribe(quiet, b"e", b"1")
    subscribe(quiet, b"e", b"2", b"g")
    subscribe(other, b"e", b"9", b"g")
    for _ in range(10):
        clients.router.publish(quiet, Publish(b"e", b"", 0, b""))
    assert taken(quiet) == []
    assert taken(other) == [b"MSG e 9 0"] * 10


def test_no_responders_go_to_the_requesters_own_reply_subscription() -> None:
    clients = Clients()
    requester = clients.connect()
    bystander = clients.connect()
    subscribe(requester, b"_INBOX.r.*", b"5")
    subscribe(bystander, b"_INBOX.>", b"6")  # matches the reply, but it is not the requester's
    clients.router.publish(requester, Publish(b"nobody", b"_INBOX.r.1", 0, b""))
    [line] = taken(requester)
    assert line.startswith(b"HMSG _INBOX.r.1 5 ")
    assert taken(bystander) == []
    assert clients.router.no_responders == 1
    # Without no_responders in its CONNECT, nothing.
    old_style = clients.connect(b'{"verbose":false}')
    subscribe(old_style, b"_INBOX.o.*", b"1")
    clients.router.publish(old_style, Publish(b"nobody", b"_INBOX.o.1", 0, b""))
    assert taken(old_style) == []


def test_a_request_that_reached_someone_gets_no_503() -> None:
    clients = Clients()
    requester, responder = clients.connect(), clients.connect()
    subscribe(requester, b"_INBOX.r.*", b"1")
    subscribe(responder, b"svc", b"1")
    clients.router.publish(requester, Publish(b"svc", b"_INBOX.r.1", 0, b"q"))
    assert taken(requester) == []
    assert taken(responder) == [b"MSG svc 1 _INBOX.r.1 1"]


def test_unsub_max_ends_the_subscription_after_that_many() -> None:
    clients = Clients()
    a = clients.connect()
    subscribe(a, b"m", b"1")
    a._handle(Unsubscribe(b"1", 2))
    for _ in range(4):
        clients.router.publish(a, Publish(b"m", b"", 0, b""))
    assert taken(a) == [b"MSG m 1 0"] * 2
    assert a.subs == {}
    assert len(clients.table) == 0


def test_headers_are_stripped_for_a_client_without_them() -> None:
    clients = Clients()
    with_headers = clients.connect()
    without = clients.connect(b'{"verbose":false}')
    subscribe(with_headers, b"h", b"1")
    subscribe(without, b"h", b"2")
    header = b"NATS/1.0\r\nA: b\r\n\r\n"
    clients.router.publish(with_headers, Publish(b"h", b"", len(header), header + b"body"))
    assert with_headers._out == [b"HMSG h 1 %d %d\r\n%bbody\r\n" % (18, 22, header)]
    assert without._out == [b"MSG h 2 4\r\nbody\r\n"]


# -- runs: a read's PUBs at once -----------------------------------------------------------


def test_a_run_goes_where_each_of_its_subjects_does_in_order() -> None:
    clients = Clients()
    xs, ys, publisher = clients.connect(), clients.connect(), clients.connect()
    subscribe(xs, b"x.*", b"1")
    subscribe(ys, b"y", b"2")
    subjects = [b"x.a", b"x.a", b"y", b"x.b", b"y", b"y", b"z", b"x.a"]
    run = [(subject, b"", 0, b"%d" % i) for i, subject in enumerate(subjects)]
    clients.router.publish_many(publisher, run)
    assert b"".join(xs._out) == b"".join(
        encode_msg(subject, b"1", b"", b"%d" % i)
        for i, subject in enumerate(subjects)
        if subject.startswith(b"x.")
    )
    assert taken(ys) == [b"MSG y 2 1"] * 3
    assert clients.router.msgs_in == len(subjects)


def test_a_subscription_that_gets_its_max_in_a_run_gets_no_more() -> None:
    clients = Clients()
    capped, other, publisher = clients.connect(), clients.connect(), clients.connect()
    subscribe(capped, b"m", b"1")
    capped._handle(Unsubscribe(b"1", 2))
    subscribe(other, b"m", b"1")
    clients.router.publish_many(publisher, [(b"m", b"", 0, b"")] * 5)
    assert taken(capped) == [b"MSG m 1 0"] * 2
    assert taken(other) == [b"MSG m 1 0"] * 5
    assert capped.subs == {}


def test_a_subscriber_closed_as_a_slow_consumer_in_a_run_gets_no_more() -> None:
    clients = Clients()
    slow = clients.connect(max_pending=250)
    other, publisher = clients.connect(), clients.connect()
    subscribe(slow, b"s", b"1")
    subscribe(other, b"s", b"1")
    clients.router.publish_many(publisher, [(b"s", b"", 0, bytes(100))] * 10)
    # A run is handed to each subscription whole, in one write: the slow one's passed
    # its limit.
    assert slow.closed
    assert slow._out == []
    assert len(clients.table) == 1  # the slow one's subscription left the table
    clients.router.publish_many(publisher, [(b"s", b"", 0, bytes(100))] * 10)
    assert len(taken(other)) == 20
    assert clients.router.msgs_out == 10 + 10 + 10


def test_a_run_stops_when_its_publisher_closes() -> None:
    clients = Clients()
    publisher = clients.connect(max_pending=250)  # its own messages come back (echo)
    other = clients.connect()
    subscribe(publisher, b"e", b"1")
    subscribe(other, b"e", b"1")
    clients.router.publish_many(publisher, [(b"e", b"", 0, bytes(100))] * 10)
    assert publisher.closed
    assert len(taken(other)) == 3
    assert clients.router.msgs_in == 3


def test_meshbus_is_asked_once_a_run_and_handed_only_what_may_reach_it() -> None:
    asked: list[bytes] = []
    handed: list[bytes] = []

    def reaches(subject: bytes) -> bool:
        asked.append(subject)
        return subject.startswith(b"mb.")

    def to_meshbus(message: tuple[bytes, bytes, int, bytes]) -> int:
        handed.append(message[3])
        return 1

    clients = Clients()
    clients.router = NatsRouter(
        clients.table, PeerMessages(lambda: None), random.Random(1), to_meshbus, reaches
    )
    requester = clients.connect()
    subscribe(requester, b"_INBOX.r.*", b"9")
    run = [(b"mb.x", b"_INBOX.r.1", 0, b"1"), (b"mb.x", b"", 0, b"2"), (b"nats", b"", 0, b"3")]
    run += [(b"nats", b"_INBOX.r.2", 0, b"4"), (b"mb.x", b"_INBOX.r.3", 0, b"5")]
    clients.router.publish_many(requester, run)
    assert asked == [b"mb.x", b"nats", b"mb.x"]
    assert handed == [b"1", b"2", b"5"]
    # The request that reached neither a subscription nor meshbus: no responders.
    [line] = taken(requester)
    assert line.startswith(b"HMSG _INBOX.r.2 9 ")


def test_replies_to_one_inbox_each_go_on_their_own_subject() -> None:
    # Replies on new subjects that the table answers alike (one inbox pattern) share the
    # plan of the first; a literal subscription among them, and one that got its max,
    # change where the next goes.
    clients = Clients()
    requester, other, responder = clients.connect(), clients.connect(), clients.connect()
    subscribe(requester, b"_INBOX.r.*", b"1")
    subscribe(other, b"_INBOX.r.>", b"2")
    other._handle(Unsubscribe(b"2", 2))
    run = [(b"_INBOX.r.%d" % i, b"", 0, b"%d" % i) for i in range(4)]
    clients.router.publish_many(responder, run)
    assert taken(requester) == [b"MSG _INBOX.r.%d 1 1" % i for i in range(4)]
    assert taken(other) == [b"MSG _INBOX.r.0 2 1", b"MSG _INBOX.r.1 2 1"]
    subscribe(other, b"_INBOX.r.5", b"3")
    run = [(b"_INBOX.r.%d" % i, b"", 0, b"") for i in (4, 5, 6)]
    clients.router.publish_many(responder, run)
    assert taken(requester) == [b"MSG _INBOX.r.%d 1 0" % i for i in (4, 5, 6)]
    assert taken(other) == [b"MSG _INBOX.r.5 3 0"]


# -- across the mesh: peers' interest in the same table ------------------------------------


class PeerLink:
    """What the router and the peer output use of a peer's link: its name, its frame
    limit, and the frames written to it."""

    def __init__(self, name: str, max_frame: int = 1 << 20) -> None:
        self.name = name
        self.max_frame = max_frame
        self.frames: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.frames.append(data)

    def rows(self) -> list[tuple[Any, ...]]:
        rows = []
        for frame in self.frames:
            decoder = FrameDecoder(self.max_frame)
            decoder.feed(frame)
            [decoded] = decoder.frames()
            assert isinstance(decoded, ControlFrame)
            assert decoded.type == ControlType.NATS_MSGS
            assert isinstance(decoded.body, NatsMessages)
            rows += decoded.body.msgs
        self.frames.clear()
        return rows


class Mesh(Clients):
    """Clients of this broker, and peers whose interest is in the same table."""

    def __init__(self, seed: int = 1) -> None:
        super().__init__(seed)
        self.routes_flushed = 0
        self.peers = PeerMessages(self._flush_routes)
        self.router = NatsRouter(self.table, self.peers, random.Random(seed))
        self.interest = NatsInterest(
            self.table, LocalInterest(), lambda op, subject, extra: None,
            lambda then: then(), lambda subject: None,
        )  # fmt: skip
        self.remote = PeerInterest(self.table, 100, 100, lambda subject: None)

    def _flush_routes(self) -> None:
        self.routes_flushed += 1


async def test_a_peer_gets_one_frame_however_many_of_its_clients_match() -> None:
    mesh = Mesh()
    b, c = PeerLink("b"), PeerLink("c")
    mesh.remote.apply(b, b"x.*", b"", 1)
    mesh.remote.apply(b, b"x.>", b"", 1)
    mesh.remote.apply(c, b"y", b"", 1)
    publisher = mesh.connect()
    mesh.router.publish(publisher, Publish(b"x.y", b"_INBOX.1", 0, b"hi"))
    mesh.router.publish(publisher, Publish(b"x.z", b"", 0, b"there"))
    await asyncio.sleep(0)  # the peers' rows leave at the end of the loop turn
    assert b.rows() == [
        (b"x.y", b"_INBOX.1", 0, b"hi", True, []),
        (b"x.z", b"", 0, b"there", True, []),
    ]
    assert b.frames == []
    assert c.rows() == []
    assert mesh.routes_flushed == 1  # route operations before the messages
    # A request that went to a peer reached someone: no 503.
    assert mesh.router.no_responders == 0


@pytest.mark.parametrize("seed", range(3))
async def test_a_queue_group_across_brokers_is_picked_at_the_origin_by_weight(
    seed: int,
) -> None:
    mesh = Mesh(seed)
    b = PeerLink("b")
    local = mesh.connect()
    subscribe(local, b"jobs", b"1", b"workers")
    mesh.remote.apply(b, b"jobs", b"workers", 3)  # three members on b
    publisher = mesh.connect()
    for i in range(400):
        mesh.router.publish(publisher, Publish(b"jobs", b"", 0, b"%d" % i))
    await asyncio.sleep(0)
    here = len(taken(local))
    there = b.rows()
    assert here + len(there) == 400  # each message once
    assert all(row[4:] == (False, [b"workers"]) for row in there)
    assert 240 <= len(there) <= 360  # about three in four


async def test_a_peers_message_goes_to_the_clients_here_only() -> None:
    mesh = Mesh()
    b = PeerLink("b")
    plain, member1, member2 = mesh.connect(), mesh.connect(), mesh.connect()
    subscribe(plain, b"news.*", b"1")
    subscribe(member1, b"news.*", b"1", b"q")
    subscribe(member2, b"news.>", b"1", b"q")
    mesh.remote.apply(PeerLink("c"), b"news.>", b"", 1)  # never sent on: one hop
    rows = [
        (b"news.a", b"", 0, b"1", True, []),  # plain subscribers only
        (b"news.b", b"", 0, b"2", False, [b"q"]),  # one member of q only
        (b"news.c", b"", 0, b"3", True, [b"q", b"gone"]),  # q's members here left
    ]
    mesh.router.from_peer(b, 0, NatsMessages(msgs=rows))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert taken(plain) == [b"MSG news.a 1 1", b"MSG news.c 1 1"]
    assert len(taken(member1)) + len(taken(member2)) == 2
    assert mesh.router.dropped_from_peers == 1
    assert mesh.routes_flushed == 0


async def test_a_peers_frame_of_many_subjects_goes_row_by_row() -> None:
    mesh = Mesh()
    a, b = mesh.connect(), mesh.connect()
    subscribe(a, b"s.*", b"1")
    subscribe(b, b"s.b", b"2")
    b._handle(Unsubscribe(b"2", 1))  # ends within the frame
    rows = [
        (b"s.a", b"", 0, b"1", True, []),
        (b"s a", b"", 0, b"2", True, []),  # invalid: dropped, the rest goes on
        (b"s.a", b"", 0, b"3", True, []),
        (b"s.b", b"", 0, b"4", True, []),
        (b"s.b", b"re ply", 0, b"5", True, []),  # invalid too
        (b"s.b", b"", 0, b"6", True, []),
        (b"s.a", b"", 0, b"7", True, []),
    ]
    mesh.router.from_peer(PeerLink("p"), 0, NatsMessages(msgs=rows))  # type: ignore[arg-type]
    assert [data for _, data in messages(a)] == [b"1", b"3", b"4", b"6", b"7"]
    assert taken(b) == [b"MSG s.b 2 1"]
    assert mesh.router.dropped_from_peers == 2
    assert mesh.router.from_peers == 5


async def test_a_turns_rows_to_a_peer_go_in_one_frame_when_they_fit() -> None:
    mesh = Mesh()
    b = PeerLink("b")
    mesh.remote.apply(b, b"t", b"", 1)
    publisher = mesh.connect()
    mesh.router.publish_many(publisher, [(b"t", b"", 0, b"%d" % i) for i in range(500)])
    await asyncio.sleep(0)
    assert len(b.frames) == 1
    assert [row[3] for row in b.rows()] == [b"%d" % i for i in range(500)]
    assert mesh.peers.stats.frames_out == 1


@pytest.mark.parametrize(
    "row",
    [
        (b"a b", b"", 0, b"x", True, []),  # a blank would break the client's MSG line
        (b"news.a", b"re ply", 0, b"x", True, []),
        (b"news.a", b"", 5, b"x", True, []),  # headers longer than the message
        (b"news.a", b"", 0, b"x", False, [b"q q"]),
    ],
)
async def test_a_peers_invalid_message_is_dropped(row: tuple[Any, ...]) -> None:
    mesh = Mesh()
    a = mesh.connect()
    subscribe(a, b"news.a", b"1")
    mesh.router.from_peer(PeerLink("b"), 0, NatsMessages(msgs=[row]))  # type: ignore[arg-type,list-item]
    assert taken(a) == []
    assert mesh.router.dropped_from_peers == 1


async def test_peer_frames_stay_within_max_frame() -> None:
    mesh = Mesh()
    small = PeerLink("small", max_frame=4096)
    mesh.remote.apply(small, b"big", b"", 1)
    publisher = mesh.connect()
    for _ in range(10):
        mesh.router.publish(publisher, Publish(b"big", b"", 0, bytes(1000)))
    mesh.router.publish(publisher, Publish(b"big", b"", 0, bytes(5000)))  # never fits
    await asyncio.sleep(0)
    assert all(len(frame) <= 4096 for frame in small.frames)
    assert len(small.frames) == 4
    assert len(small.rows()) == 10
    assert mesh.peers.stats.too_large == 1
