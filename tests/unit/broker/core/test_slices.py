"""Never stall: a link's pipelined burst of control frames is handled in slices, so the
other links get their turns in between (docs/architecture.md, the event loop's budget).
Here the slice is 0 s: each loop turn handles one of the burst's frames."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from meshbus.address import Unicast
from meshbus.broker.core import slices
from meshbus.broker.core.link import Link
from meshbus.protocol.codec import ControlFrame, encode_control, encode_data
from meshbus.protocol.control import ROLE_OPERATOR, Empty, Error, Register, StatRequest, Stats
from meshbus.protocol.layout import FLAG_REQUEST, ControlType
from meshbus.testing import (
    FakeNetwork,
    broker_side,
    build_mesh,
    connect_client,
    connector,
    start_broker,
)

BURST = 500


async def test_a_burst_of_registrations_yields_to_other_links_and_is_answered_in_order(
    network: FakeNetwork, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slices, "SLICE", 0.0)
    broker = await start_broker(network, "a", max_services=BURST)
    bulk = await connector(network, broker, "bulk")
    pinger = await connector(network, broker, "pinger")
    bulk.send(
        b"".join(
            encode_control(ControlType.REGISTER, Register(server="svc"), correlation)
            for correlation in range(1, BURST + 1)
        )
    )
    pinger.send_control(ControlType.PING, Empty(), 7)
    answered_at_pong = -1
    for _ in range(10 * BURST):
        await asyncio.sleep(0)  # one loop turn of the simulated loop
        if answered_at_pong < 0 and pinger.controls():
            answered_at_pong = len(bulk.controls())
        if len(bulk.controls()) == BURST:
            break
    assert 0 <= answered_at_pong < BURST // 2, "the ping waited behind the whole burst"
    answers = bulk.take()
    assert all(isinstance(f, ControlFrame) for f in answers)
    assert [f.correlation for f in answers if isinstance(f, ControlFrame)] == list(
        range(1, BURST + 1)
    )
    assert {f.type for f in answers if isinstance(f, ControlFrame)} == {ControlType.REGISTERED}
    assert broker.routing.service_count == BURST


@pytest.mark.parametrize("flood", ["requests past the cap", "plain frames to nowhere"])
async def test_a_flood_of_data_frames_yields_to_other_links(
    network: FakeNetwork, monkeypatch: pytest.MonkeyPatch, flood: str
) -> None:
    """Data frames are timed too: dear ones (refused requests) every few frames, cheap
    ones (a run to nowhere) after each big read. Read in one go, as a socket's backlog is,
    the flood is handled a slice per loop turn, and a ping on another link is answered
    long before it is done."""
    monkeypatch.setattr(slices, "SLICE", 0.0)
    broker = await start_broker(network, "a", max_requests=1)
    bulk = await connector(network, broker, "bulk")
    pinger = await connector(network, broker, "pinger")
    asker = await bulk.register("asker")
    nowhere = Unicast("nobody", 1).to_bytes()
    count = 60_000
    if flood == "requests past the cap":
        frames = (
            encode_data(asker, asker, b"", msg_id=i, flags=FLAG_REQUEST, timeout_ms=60_000)
            for i in range(count)
        )
    else:
        frames = (encode_data(nowhere, asker, b"x" * 40) for _ in range(count))
    bulk.send(b"".join(frames))
    pinger.send_control(ControlType.PING, Empty(), 7)
    link = broker_side(bulk)
    handled_at_pong = -1
    for _ in range(10 * count):
        await asyncio.sleep(0)
        if handled_at_pong < 0 and pinger.controls():
            handled_at_pong = link.msgs_in
        if link.msgs_in == count:
            break
    assert link.msgs_in == count
    assert 0 <= handled_at_pong < count // 4, (handled_at_pong, "the ping waited for the flood")


async def test_a_slice_counts_its_first_frame(
    network: FakeNetwork, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slice's clock starts before the first control frame of a read, not after it: a
    peer's ROUTES frame is milliseconds of work, and a read's callback must not run a
    whole frame before it even starts to count. With a zero slice, a callback handles one
    frame, then yields the loop (blocks the link until its next turn)."""
    monkeypatch.setattr(slices, "SLICE", 0.0)
    broker = await start_broker(network, "a")
    client = await connector(network, broker, "pinger")
    steps: list[str] = []
    on_control, block = Link._on_control, Link.block

    def handled(link: Link, frame: bytes) -> None:
        steps.append("frame")
        on_control(link, frame)

    def yielded(link: Link) -> None:
        steps.append("yield")
        block(link)

    monkeypatch.setattr(Link, "_on_control", handled)
    monkeypatch.setattr(Link, "block", yielded)
    client.send(b"".join(encode_control(ControlType.PING, Empty(), c) for c in range(1, 6)))
    for _ in range(100):
        await asyncio.sleep(0)
        if len(client.controls()) == 5:
            break
    assert steps == ["frame", "yield"] * 5, steps


async def test_a_big_connectors_services_leave_every_table_in_slices(
    network: FakeNetwork, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connector with 3,500 services closes: the first thousand leave at once, the rest
    one step per loop turn (here every step is its own slice), and the peer hears of
    every one."""
    monkeypatch.setattr(slices, "SLICE", 0.0)
    a, b = await build_mesh(network, 2, max_services=5_000)
    big = await connector(network, a, "big")
    big.send(
        b"".join(
            encode_control(ControlType.REGISTER, Register(server="svc"), correlation)
            for correlation in range(1, 3_501)
        )
    )
    await network.settle()
    assert a.routing.service_count == b.routing.service_count == 3_500
    big.close()
    left: list[int] = []
    while a.routing.service_count:
        await asyncio.sleep(0)
        left.append(a.routing.service_count)
    assert left[0] >= 1_000, "the closed link's services left in one go"
    await network.settle()
    assert a.routing.service_count == b.routing.service_count == 0


async def test_a_detailed_stat_past_the_default_frame_limit_comes_in_pages(
    network: FakeNetwork,
) -> None:
    """60,000 services make a detailed answer of about 2.5 MB, past the 1 MiB frame: the
    first STATS names the pages, each further page is asked for, and together they are
    the whole answer."""
    broker = await start_broker(network, "a", max_services=60_000)
    owner = await connector(network, broker, "owner")
    link = broker_side(owner)
    for i in range(1, 60_001):
        broker.routing.add_service(Unicast("svc", i).to_bytes(), link)
    operator = connect_client(network, broker, "op")
    await operator.hello(ROLE_OPERATOR)
    first = await operator.ask(ControlType.STAT, StatRequest(detail=True))
    assert isinstance(first.body, Stats)
    assert first.body.pages > 1
    blobs = [first.body.blob]
    for page in range(1, first.body.pages):
        more = await operator.ask(ControlType.STAT, StatRequest(detail=True, page=page))
        assert isinstance(more.body, Stats)
        assert more.body.page == page
        blobs.append(more.body.blob)
    data = msgspec.msgpack.decode(b"".join(blobs))
    assert len(data["service_addresses"]) == 60_000
    again = await operator.ask(ControlType.STAT, StatRequest(detail=True, page=1))
    assert isinstance(again.body, Error), "the pages are gone once all were asked for"
    assert not operator.closed
