"""Forwarding decisions: a real Forwarder, RoutingTable, PendingTable and Outbox, and links
on capturing transports fed by hand (``Hub``) -- no broker, no network."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from meshbus.address import Anycast, Multicast, Unicast
from meshbus.broker.core.forward import Carry, Decision
from meshbus.broker.core.link import Link
from meshbus.protocol.codec import ControlFrame, DataFrame, Frame, encode_data
from meshbus.protocol.control import DeliveryFailure
from meshbus.protocol.layout import (
    DATA_HEADER_SIZE,
    FLAG_ECHO,
    FLAG_NOTIFY_DROP,
    FLAG_REQUEST,
    FLAG_RESPONSE,
    FLAG_TRACE,
    MIN_MAX_FRAME,
    ControlType,
)
from meshbus.testing import FakeClock, FakeTransport, Hub

A1 = Unicast("alpha", 1).to_bytes()
B1 = Unicast("beta", 1).to_bytes()
B2 = Unicast("beta", 2).to_bytes()
C1 = Unicast("gamma", 1).to_bytes()
R1 = Unicast("remote", 1).to_bytes()
NOBODY = Unicast("nobody", 1).to_bytes()
CHAT = Multicast("chat").to_bytes()
POOL = Anycast("pool").to_bytes()
TAG_FROM_Q = 0x0A0B0C0D  # what peer q gave us: we stamp it on frames we send q


class Spy:
    """Counts the frames that took the general path (a decision made, not reused)."""

    def __init__(self, hub: Hub, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        route = hub.forwarder.route_connector_frame

        def counted(
            link: Link, buf: bytearray, mv: memoryview, pos: int, total: int
        ) -> Decision | None:
            self.calls += 1
            return route(link, buf, mv, pos, total)

        monkeypatch.setattr(hub.forwarder, "route_connector_frame", counted)


def payloads(frames: Sequence[Frame]) -> list[bytes]:
    return [f.payload for f in frames if isinstance(f, DataFrame)]


def only_control(frames: Sequence[Frame]) -> ControlFrame:
    assert len(frames) == 1, frames
    frame = frames[0]
    assert isinstance(frame, ControlFrame)
    return frame


@pytest.fixture
async def hub(clock: FakeClock) -> Hub:
    return Hub(clock)


def register(hub: Hub, link: Link, *addresses: bytes) -> None:
    for address in addresses:
        hub.routing.add_service(address, link, link.session)


def a_and_b(hub: Hub) -> tuple[Link, Link]:
    """Two connectors: a owns A1, b owns B1."""
    a, b = hub.connector("a"), hub.connector("b")
    register(hub, a, A1)
    register(hub, b, B1)
    return a, b


async def test_a_unicast_decision_is_cached_and_reused_for_its_routing_key(
    hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = a_and_b(hub)
    spy = Spy(hub, monkeypatch)
    hub.feed(a, encode_data(B1, A1, b"one", msg_id=1))
    hub.feed(a, encode_data(B1, A1, b"two", msg_id=2), encode_data(B1, A1, b"six", msg_id=3))
    assert payloads(hub.received(b)) == [b"one", b"two", b"six"]
    assert spy.calls == 1, "same routing key: one decision for three frames in two reads"
    hub.feed(a, encode_data(B1, A1, b"longer", msg_id=4))
    assert payloads(hub.received(b)) == [b"longer"]
    assert spy.calls == 2, "the frame size is part of the key"
    assert (a.msgs_in, b.msgs_out) == (4, 4)


async def test_a_cached_decision_is_dropped_when_the_table_changes(
    hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, c = hub.connector("a"), hub.connector("b"), hub.connector("c")
    register(hub, a, A1)
    register(hub, b, B1)
    register(hub, c, C1)
    spy = Spy(hub, monkeypatch)
    hub.routing.join(B1, CHAT)
    hub.feed(a, encode_data(CHAT, A1, b"1"))
    hub.routing.join(C1, CHAT)  # a new member: the old decision would miss it
    hub.feed(a, encode_data(CHAT, A1, b"2"))
    assert spy.calls == 2
    assert payloads(hub.received(b)) == [b"1", b"2"]
    assert payloads(hub.received(c)) == [b"2"]


async def test_a_multicast_goes_once_per_link_with_members_and_not_back_to_the_sender(
    hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, c = hub.connector("a"), hub.connector("b"), hub.connector("c")
    register(hub, a, A1)
    register(hub, b, B1, B2)
    register(hub, c, C1)
    for member in (A1, B1, B2, C1):
        hub.routing.join(member, CHAT)
    frame = bytearray(encode_data(CHAT, A1, b"x"))
    decision = hub.forwarder.route_connector_frame(a, frame, memoryview(frame), 0, len(frame))
    assert isinstance(decision, Decision)
    assert decision.carry is Carry.PLAIN
    assert set(decision.targets) == {b, c}, "one copy per link; the sender's link skipped"
    spy = Spy(hub, monkeypatch)
    hub.feed(a, encode_data(CHAT, A1, b"1"), encode_data(CHAT, A1, b"2"))
    hub.feed(a, encode_data(CHAT, A1, b"3", flags=FLAG_ECHO))
    assert payloads(hub.received(b)) == [b"1", b"2", b"3"]
    assert payloads(hub.received(c)) == [b"1", b"2", b"3"]
    assert payloads(hub.received(a)) == [b"3"], "only with ECHO does it come back"
    assert spy.calls == 2, "one decision per routing key (ECHO is a flag, so another key)"


async def test_a_response_goes_back_along_the_pending_entry(hub: Hub) -> None:
    a, b = a_and_b(hub)
    hub.feed(a, encode_data(B1, A1, b"ask", msg_id=7, flags=FLAG_REQUEST, timeout_ms=1500))
    assert payloads(hub.received(b)) == [b"ask"]
    assert len(hub.pending) == 1
    assert hub.stats.requests == 1
    response = encode_data(A1, B1, b"answer", msg_id=99, response_for=7, flags=FLAG_RESPONSE)
    hub.feed(b, response)
    assert payloads(hub.received(a)) == [b"answer"]
    assert len(hub.pending) == 0
    hub.feed(b, response)  # the entry is gone: a second answer is late
    assert hub.received(a) == []
    assert hub.stats.late_responses == 1


async def test_a_request_decision_is_reused_and_records_each_request(
    hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = a_and_b(hub)
    spy = Spy(hub, monkeypatch)
    for msg_id in (1, 2, 3):
        hub.feed(a, encode_data(B1, A1, b"q", msg_id=msg_id, flags=FLAG_REQUEST))
    assert spy.calls == 1
    assert [f.msg_id for f in hub.received(b) if isinstance(f, DataFrame)] == [1, 2, 3]
    assert len(hub.pending) == 3
    expired = hub.pending.expire(hub.clock() + 30.0)  # timeout_ms 0: the default, 30 s
    assert sorted(e.msg_id for e in expired) == [1, 2, 3]


async def test_every_traced_request_records_its_hops(hub: Hub) -> None:
    """A traced request is carried out one frame at a time, never by a cached request
    decision, which would skip its entry and exit hops (docs/report.md)."""
    a, _ = a_and_b(hub)
    for msg_id in (1, 2):
        hub.feed(a, encode_data(B1, A1, b"q", msg_id=msg_id, flags=FLAG_REQUEST | FLAG_TRACE))
    assert [(hop, msg_id) for hop, _, msg_id, _ in hub.traced] == [
        ("entry", 1),
        ("exit", 1),
        ("entry", 2),
        ("exit", 2),
    ]
    assert len(hub.pending) == 2


@pytest.mark.parametrize(
    ("hops", "tag", "delivered"),
    [(1, "ours", True), (0, "ours", False), (2, "ours", False), (1, "other", False)],
    ids=["hop1-right-tag", "hop0", "hop2", "wrong-tag"],
)
async def test_a_peer_frame_with_a_wrong_hop_count_or_link_tag_is_dropped_and_counted(
    hub: Hub, hops: int, tag: str, delivered: bool
) -> None:
    p, a = hub.peer("p"), hub.connector("a")
    register(hub, a, A1)
    register(hub, p, R1)
    assert p.peer is not None
    link_tag = p.peer.tag_in if tag == "ours" else p.peer.tag_in + 1
    hub.feed(p, encode_data(A1, R1, b"hi", hops=hops, link_tag=link_tag))
    assert payloads(hub.received(a)) == ([b"hi"] if delivered else [])
    assert hub.stats.dropped_bad_hop == (0 if delivered else 1)


async def test_a_frame_from_a_peer_never_goes_to_another_peer(hub: Hub) -> None:
    p, q = hub.peer("p"), hub.peer("q", tag_out=TAG_FROM_Q)
    register(hub, p, R1)
    register(hub, q, B1)
    assert p.peer is not None
    hub.feed(p, encode_data(B1, R1, b"loop?", hops=1, link_tag=p.peer.tag_in))
    assert hub.received(q) == []
    assert hub.stats.dropped_no_route == 1


async def test_a_frame_to_a_peer_carries_hop_one_and_the_peers_tag(hub: Hub) -> None:
    a, q = hub.connector("a"), hub.peer("q", tag_out=TAG_FROM_Q)
    register(hub, a, A1)
    register(hub, q, B1)
    hub.feed(a, encode_data(B1, A1, b"out"), encode_data(B1, A1, b"out"))
    frames = [f for f in hub.received(q) if isinstance(f, DataFrame)]
    assert [(f.hops, f.link_tag, f.payload) for f in frames] == [(1, TAG_FROM_Q, b"out")] * 2


async def test_a_frame_larger_than_the_receivers_limit_is_dropped_and_counted(hub: Hub) -> None:
    a, small = hub.connector("a"), hub.connector("small", max_frame=256)
    register(hub, a, A1)
    register(hub, small, B1)
    big = b"x" * (300 - DATA_HEADER_SIZE)
    hub.feed(a, encode_data(B1, A1, big))
    assert hub.received(small) == []
    assert hub.stats.dropped_too_large == 1
    assert hub.received(a) == [], "a plain send is dropped silently"
    hub.feed(a, encode_data(B1, A1, big, msg_id=5, flags=FLAG_NOTIFY_DROP))
    assert hub.stats.dropped_too_large == 2
    failure = only_control(hub.received(a))
    assert failure.type == ControlType.NO_ROUTE
    assert isinstance(failure.body, DeliveryFailure)
    assert (failure.body.msg_id, failure.body.src, failure.body.dst) == (5, A1, B1)
    assert "maximum frame size" in failure.body.reason


async def test_a_multicast_skips_only_the_member_whose_limit_it_exceeds(hub: Hub) -> None:
    a, small, big = hub.connector("a"), hub.connector("small", 256), hub.connector("big")
    register(hub, a, A1)
    register(hub, small, B1)
    register(hub, big, C1)
    hub.routing.join(B1, CHAT)
    hub.routing.join(C1, CHAT)
    hub.feed(a, encode_data(CHAT, A1, b"x" * 400))
    assert hub.received(small) == []
    assert payloads(hub.received(big)) == [b"x" * 400]
    assert hub.stats.dropped_too_large == 1


@pytest.mark.parametrize("flags", [FLAG_NOTIFY_DROP, FLAG_REQUEST], ids=["notify", "request"])
async def test_no_route_is_told_to_a_sender_that_asked(hub: Hub, flags: int) -> None:
    a = hub.connector("a")
    register(hub, a, A1)
    hub.feed(a, encode_data(NOBODY, A1, b"?", msg_id=11, flags=flags, timeout_ms=100))
    failure = only_control(hub.received(a))
    assert (failure.type, failure.correlation) == (ControlType.NO_ROUTE, 0)
    assert isinstance(failure.body, DeliveryFailure)
    assert (failure.body.msg_id, failure.body.src, failure.body.dst) == (11, A1, NOBODY)
    assert len(hub.pending) == 0, "a request that went nowhere waits for nothing"
    assert hub.stats.dropped_no_route == 1


def refusals(frames: Sequence[Frame]) -> list[tuple[list[int], bytes]]:
    """Each NO_ROUTE's msg_ids (``msg_id`` and ``also``) and destination."""
    found = []
    for frame in frames:
        assert isinstance(frame, ControlFrame), frame
        assert frame.type == ControlType.NO_ROUTE, frame
        assert isinstance(frame.body, DeliveryFailure)
        found.append(([frame.body.msg_id, *frame.body.also], frame.body.dst))
    return found


async def test_no_route_answers_to_consecutive_frames_come_as_one_to_a_link_that_asked(
    hub: Hub,
) -> None:
    asked, plain = hub.connector("a", batched_no_route=True), hub.connector("c")
    register(hub, asked, A1)
    register(hub, plain, C1)
    notified = [
        (NOBODY, 1),
        (NOBODY, 2),
        (NOBODY, 3),
        (C1, 4),  # delivered: it goes to another link, and the batch goes on
        (NOBODY, 5),
        (B1, 6),  # another destination: another batch
        (NOBODY, 7),
    ]
    hub.feed(
        asked,
        *(encode_data(dst, A1, b"?", msg_id=i, flags=FLAG_NOTIFY_DROP) for dst, i in notified),
    )
    assert refusals(hub.received(asked)) == [([1, 2, 3, 5], NOBODY), ([6], B1), ([7], NOBODY)]
    assert payloads(hub.received(plain)) == [b"?"]
    hub.feed(
        plain, *(encode_data(NOBODY, C1, b"", msg_id=i, flags=FLAG_NOTIFY_DROP) for i in (1, 2))
    )
    assert refusals(hub.received(plain)) == [([1], NOBODY), ([2], NOBODY)], "did not ask"
    assert hub.stats.dropped_no_route == 8


async def test_a_batch_of_no_route_answers_stays_within_the_links_frame_limit(hub: Hub) -> None:
    small = hub.connector("a", max_frame=MIN_MAX_FRAME, batched_no_route=True)
    register(hub, small, A1)
    hub.feed(
        small, *(encode_data(NOBODY, A1, b"", msg_id=i, flags=FLAG_NOTIFY_DROP) for i in range(40))
    )
    transport = small.transport
    assert isinstance(transport, FakeTransport)
    data = bytes(transport.captured)
    batches = refusals(hub.received(small))
    assert [i for ids, _ in batches for i in ids] == list(range(40))
    assert len(batches) > 1
    assert len(data) <= len(batches) * MIN_MAX_FRAME


async def test_a_plain_send_with_no_route_is_dropped_silently_and_counted(hub: Hub) -> None:
    a = hub.connector("a")
    register(hub, a, A1)
    hub.feed(a, encode_data(NOBODY, A1, b"?"), encode_data(POOL, A1, b"?"))
    assert hub.received(a) == []
    assert hub.stats.dropped_no_route == 2


async def test_an_anycast_goes_to_a_local_member_before_a_peer(hub: Hub) -> None:
    a, b, q = hub.connector("a"), hub.connector("b"), hub.peer("q", tag_out=TAG_FROM_Q)
    register(hub, a, A1)
    register(hub, b, B1)
    register(hub, q, R1)
    hub.routing.join(B1, POOL)
    hub.routing.join(R1, POOL)
    for _ in range(20):
        hub.feed(a, encode_data(POOL, A1, b"job"))
    assert len(hub.received(b)) == 20
    assert hub.received(q) == []
    hub.routing.leave(B1, POOL)
    hub.feed(a, encode_data(POOL, A1, b"job"))
    assert payloads(hub.received(q)) == [b"job"], "no local member left: the peer's"


# -- runs over interleaved destinations (Link._process, runs.frames_in) ------------------------

B3 = Unicast("beta", 3).to_bytes()
R2 = Unicast("remote", 2).to_bytes()


async def test_interleaved_destinations_on_one_link_make_one_run_and_one_decision_each(
    hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = a_and_b(hub)
    register(hub, b, B2, B3)
    spy = Spy(hub, monkeypatch)
    frames = [encode_data((B1, B2, B3)[i % 3], A1, b"%04d" % i, msg_id=i) for i in range(300)]
    hub.feed(a, *frames)
    received = [f for f in hub.received(b) if isinstance(f, DataFrame)]
    assert [f.payload for f in received] == [b"%04d" % i for i in range(300)]
    assert [f.dst for f in received[:3]] == [B1, B2, B3]
    assert spy.calls == 3
    assert (a.msgs_in, b.msgs_out) == (300, 300)


async def test_a_run_over_interleaved_destinations_ends_at_a_frame_for_other_targets(
    hub: Hub,
) -> None:
    a, b = a_and_b(hub)
    register(hub, b, B2)
    c = hub.connector("c")
    register(hub, c, C1)
    frames = [encode_data((B1, B2)[i % 2], A1, b"%03d" % i) for i in range(40)]
    frames[25] = encode_data(C1, A1, b"c25")  # other targets
    frames[30] = encode_data(B1, A1, b"longer30")  # the same targets, another size
    frames[33] = encode_data(NOBODY, A1, b"n33")  # no route
    hub.feed(a, *frames, *frames)  # the second time every key is cached
    for_b = [b"%03d" % i for i in range(40) if i not in (25, 30, 33)]
    for_b.insert(29, b"longer30")
    assert payloads(hub.received(b)) == for_b * 2
    assert payloads(hub.received(c)) == [b"c25"] * 2
    assert hub.stats.dropped_no_route == 2
    assert (a.msgs_in, b.msgs_out + c.msgs_out) == (80, 78)


async def test_a_run_over_interleaved_destinations_stops_at_a_frame_cut_by_the_read(
    hub: Hub,
) -> None:
    a, b = a_and_b(hub)
    register(hub, b, B2)
    data = b"".join(encode_data((B1, B2)[i % 2], A1, b"%02d" % i) for i in range(50))
    cut = len(data) // 2 + 7  # inside a frame
    hub.feed(a, data[:cut])
    hub.feed(a, data[cut:])
    assert payloads(hub.received(b)) == [b"%02d" % i for i in range(50)]


async def test_interleaved_destinations_behind_one_peer_are_stamped_in_one_run(
    hub: Hub,
) -> None:
    a, q = hub.connector("a"), hub.peer("q", tag_out=TAG_FROM_Q)
    register(hub, a, A1)
    register(hub, q, R1, R2)
    hub.feed(a, *(encode_data((R1, R2)[i % 2], A1, b"%02d" % i) for i in range(20)))
    frames = [f for f in hub.received(q) if isinstance(f, DataFrame)]
    assert [(f.hops, f.link_tag, f.dst, f.payload) for f in frames] == [
        (1, TAG_FROM_Q, (R1, R2)[i % 2], b"%02d" % i) for i in range(20)
    ]


@pytest.mark.parametrize("seed", range(20))
async def test_any_mix_of_cached_keys_split_anywhere_is_delivered_in_order(
    hub: Hub, seed: int
) -> None:
    """Random frames over destinations on two links, no route, and two sizes, in random
    reads: each link gets exactly its frames, in order, and every frame is counted."""
    rng = random.Random(seed)
    a, b = a_and_b(hub)
    register(hub, b, B2)
    c = hub.connector("c")
    register(hub, c, C1)
    owner = {B1: b, B2: b, C1: c, NOBODY: None}
    sent: list[tuple[bytes, bytes]] = []
    for i in range(rng.randrange(50, 400)):
        dst = rng.choice((B1, B2, B1, B2, C1, NOBODY))
        sent.append((dst, (b"%04d" if rng.random() < 0.9 else b"long%04d") % i))
    data = b"".join(encode_data(dst, A1, payload) for dst, payload in sent)
    pos = 0
    while pos < len(data):
        step = rng.randrange(1, 3000)
        hub.feed(a, data[pos : pos + step])
        pos += step
    for link in (b, c):
        expected = [payload for dst, payload in sent if owner[dst] is link]
        assert payloads(hub.received(link)) == expected
    assert a.msgs_in == len(sent)
    assert hub.stats.dropped_no_route == sum(1 for dst, _ in sent if dst == NOBODY)


@pytest.mark.parametrize("seed", range(10))
async def test_long_same_key_runs_broken_anywhere_are_delivered_in_order(
    hub: Hub, seed: int
) -> None:
    """Runs of one key long enough to be checked a chunk at a time (hundreds of frames),
    broken by a frame for the same link, for another link, or of another size, anywhere."""
    rng = random.Random(seed)
    a, b = a_and_b(hub)
    register(hub, b, B2)
    c = hub.connector("c")
    register(hub, c, C1)
    sent: list[tuple[bytes, bytes]] = []
    for i in range(3000):
        odd = rng.random() < 0.003
        dst = rng.choice((B2, C1)) if odd else B1
        sent.append((dst, b"longer%04d" % i if odd and rng.random() < 0.3 else b"%04d" % i))
    data = b"".join(encode_data(dst, A1, payload) for dst, payload in sent)
    pos = 0
    while pos < len(data):
        step = rng.randrange(20_000, 300_000)
        hub.feed(a, data[pos : pos + step])
        pos += step
    assert payloads(hub.received(b)) == [p for dst, p in sent if dst in (B1, B2)]
    assert payloads(hub.received(c)) == [p for dst, p in sent if dst == C1]
    assert a.msgs_in == len(sent)


# -- bursts of requests and responses (Forwarder.forward) ----------------------------------


def request(msg_id: int, dst: bytes = B1, src: bytes = A1) -> bytes:
    return encode_data(dst, src, b"q%d" % msg_id, msg_id=msg_id, flags=FLAG_REQUEST)


def response(response_for: int, dst: bytes = A1, src: bytes = B1) -> bytes:
    return encode_data(
        dst, src, b"r%d" % response_for, response_for=response_for, flags=FLAG_RESPONSE
    )


async def test_a_burst_of_requests_past_the_cap_goes_up_to_it_and_the_rest_is_refused(
    hub: Hub,
) -> None:
    a = hub.connector("a")
    register(hub, a, A1, B1)  # a asks itself: its requests and refusals share one link
    hub.pending.max_per_link = 3
    hub.feed(a, *(request(i, dst=B1) for i in range(1, 6)))
    received = hub.received(a)
    assert [f.msg_id for f in received if isinstance(f, DataFrame)] == [1, 2, 3]
    refused = [f for f in received if isinstance(f, ControlFrame)]
    assert [f.type for f in refused] == [ControlType.NO_ROUTE] * 2
    assert [f.body.msg_id for f in refused if isinstance(f.body, DeliveryFailure)] == [4, 5]
    assert received.index(refused[0]) == 3, "the refusals come after the requests sent"
    assert (len(hub.pending), hub.stats.requests, a.msgs_in) == (3, 3, 5)


async def test_a_long_burst_of_requests_is_recorded_and_forwarded_whole(hub: Hub) -> None:
    a, b = a_and_b(hub)
    hub.feed(a, *(request(i) for i in range(1, 201)))
    assert [f.msg_id for f in hub.received(b) if isinstance(f, DataFrame)] == list(range(1, 201))
    assert (len(hub.pending), hub.stats.requests, a.msgs_in, b.msgs_out) == (200, 200, 200, 200)


async def test_a_burst_of_responses_goes_to_the_requester_save_the_late_and_the_forged(
    hub: Hub,
) -> None:
    a, b = a_and_b(hub)
    register(hub, b, B2)
    hub.feed(a, request(1), request(2, dst=B2), request(3), request(4))
    hub.received(b)
    # B1 answers 1, then 2 (a request to B2: not B1's to answer), 9 (no such request),
    # then 3 and 4: all with one routing key.
    hub.feed(b, response(1), response(2), response(9), response(3), response(4))
    assert payloads(hub.received(a)) == [b"r1", b"r3", b"r4"]
    assert (hub.stats.dropped_wrong_responder, hub.stats.late_responses) == (1, 1)
    assert len(hub.pending) == 1, "request 2 still waits for B2"
    hub.feed(b, response(2, src=B2))
    assert payloads(hub.received(a)) == [b"r2"]
    assert (b.msgs_in, a.msgs_out) == (6, 4)


async def test_a_burst_of_responses_for_a_requester_behind_a_peer_is_stamped(hub: Hub) -> None:
    b, q = hub.connector("b"), hub.peer("q", tag_out=TAG_FROM_Q)
    register(hub, b, B1)
    register(hub, q, R1)
    hub.feed(b, *(response(i, dst=R1) for i in range(1, 40)))
    frames = [f for f in hub.received(q) if isinstance(f, DataFrame)]
    assert [(f.hops, f.link_tag, f.response_for) for f in frames] == [
        (1, TAG_FROM_Q, i) for i in range(1, 40)
    ]
