"""Bad input over raw sockets: the offending link gets an ERROR frame and is closed; the broker
and every other link keep working, and nothing they had in flight is lost.

Each fatal case runs while a healthy connector pair (established before the bad link) is
in the middle of a burst: half of it is sent before the bad link connects, the other half
while it misbehaves. The receiver must get the whole burst, in order, and nothing else --
so a spoofed or truncated frame that leaked through would show up in its sequence.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import pytest

import meshbus
from meshbus.protocol import (
    DEFAULT_MAX_FRAME,
    ControlFrame,
    ControlType,
    DataFlags,
    ErrorCode,
    encode_control,
)
from meshbus.protocol.control import Empty, Error, Hello, Membership, Register, Welcome
from meshbus.protocol.layout import CONTROL_HEADER, FATAL_ERRORS, KIND_CONTROL, KIND_DATA
from tests.integration.helpers import (
    IO_TIMEOUT,
    Pair,
    RawLink,
    assert_next_is,
    data_frame,
    recv_payloads,
)

BURST = 4000


def seq(i: int) -> bytes:
    return b"burst:%d" % i


async def run_during_burst(pair: Pair, action: Callable[[], Awaitable[None]]) -> None:
    """Send a burst a -> b around ``action``; assert all of it arrives, in order, alone."""
    receiver = asyncio.create_task(recv_payloads(pair.b, BURST, timeout=30))
    half = BURST // 2
    for i in range(half):
        await pair.a.send(pair.b.address, seq(i))

    async def second_half() -> None:
        for i in range(half, BURST):
            await pair.a.send(pair.b.address, seq(i))
            if i % 100 == 0:
                await asyncio.sleep(0)  # let the bad link's I/O interleave with the burst

    await asyncio.gather(action(), second_half())
    assert await receiver == [seq(i) for i in range(BURST)]
    # The path still works afterwards, and nothing stray was queued behind the burst.
    await pair.roundtrip(b"after the bad link")


def control_raw(ctype: int, body: bytes, correlation: int = 1, *, version: int = 1) -> bytes:
    """A control frame with an arbitrary type and body bytes."""
    header = CONTROL_HEADER.pack(
        CONTROL_HEADER.size - 4 + len(body), KIND_CONTROL, version, ctype, correlation
    )
    return header + body


def prefix(length: int, kind: int = KIND_DATA, version: int = 1) -> bytes:
    return length.to_bytes(4, "big") + bytes((kind, version))


# -- the fatal cases ---------------------------------------------------------------------


@dataclass
class Ctx:
    own: bytes  # an address the bad link registered (b"" when it did not get that far)
    pair: Pair


@dataclass
class Case:
    id: str
    stage: str  # "none": raw socket only; "hello": handshake done; "registered": + REGISTER
    build: Callable[[Ctx], bytes]
    code: ErrorCode


NOBODY = meshbus.Unicast("nobody", 1)


def _hello(version: int = 1) -> bytes:
    frame = bytearray(encode_control(ControlType.HELLO, Hello(name="bad")))
    frame[5] = version
    return bytes(frame)


CASES = [
    Case("garbage-zeros", "none", lambda c: bytes(32), ErrorCode.UNKNOWN_KIND),
    Case(
        "garbage-http",
        "none",
        lambda c: b"GET / HTTP/1.1\r\nHost: meshbus\r\n\r\n",
        ErrorCode.FRAME_TOO_LARGE,
    ),
    Case(
        "garbage-after-hello",
        "hello",
        lambda c: b"\x00\x00\x00\x08\xde\xad\xbe\xef\x00\x01\x02\x03",
        ErrorCode.UNKNOWN_KIND,
    ),
    # Only the 4-byte prefix is sent: the broker must answer without waiting for a body.
    Case("oversized-length", "none", lambda c: b"\xff\xff\xff\xff", ErrorCode.FRAME_TOO_LARGE),
    Case(
        "oversized-length-registered",
        "registered",
        lambda c: b"\xff\xff\xff\xff",
        ErrorCode.FRAME_TOO_LARGE,
    ),
    Case(
        "oversized-by-one-byte",
        "registered",
        lambda c: prefix(DEFAULT_MAX_FRAME - 4 + 1),
        ErrorCode.FRAME_TOO_LARGE,
    ),
    Case(
        "shorter-than-header",
        "registered",
        lambda c: prefix(2) + b"\x00" * 8,
        ErrorCode.PROTOCOL_ERROR,
    ),
    Case("unknown-kind", "hello", lambda c: prefix(60, kind=9) + bytes(58), ErrorCode.UNKNOWN_KIND),
    Case("unsupported-version-hello", "none", lambda c: _hello(2), ErrorCode.UNSUPPORTED_VERSION),
    Case(
        "unsupported-version-data",
        "registered",
        lambda c: prefix(60, version=0) + data_frame(NOBODY, c.own)[6:],
        ErrorCode.UNSUPPORTED_VERSION,
    ),
    Case(
        "hello-body-protocol-2",
        "none",
        lambda c: encode_control(ControlType.HELLO, Hello(protocol=2)),
        ErrorCode.UNSUPPORTED_VERSION,
    ),
    Case(
        "data-before-handshake",
        "none",
        lambda c: data_frame(c.pair.b.address, c.pair.a.address, b"spoof"),
        ErrorCode.NOT_HANDSHAKEN,
    ),
    Case(
        "register-before-handshake",
        "none",
        lambda c: encode_control(ControlType.REGISTER, Register(server="bad"), 3),
        ErrorCode.NOT_HANDSHAKEN,
    ),
    Case(
        "ping-before-handshake",
        "none",
        lambda c: encode_control(ControlType.PING, Empty(), 3),
        ErrorCode.NOT_HANDSHAKEN,
    ),
    Case(
        "unknown-control-before-handshake",
        "none",
        lambda c: control_raw(999, b"\x80"),
        ErrorCode.NOT_HANDSHAKEN,
    ),
    # Spoofing the healthy sender's address towards the healthy receiver: if it leaked
    # through, the receiver's burst sequence would contain it.
    Case(
        "source-not-owned-spoof",
        "registered",
        lambda c: data_frame(c.pair.b.address, c.pair.a.address, b"spoof"),
        ErrorCode.ADDRESS_NOT_OWNED,
    ),
    Case(
        "source-not-owned-unregistered",
        "hello",
        lambda c: data_frame(c.pair.b.address, meshbus.Unicast("bad", 1), b"spoof"),
        ErrorCode.ADDRESS_NOT_OWNED,
    ),
    Case(
        "source-not-owned-request",
        "registered",
        lambda c: data_frame(
            c.pair.b.address,
            c.pair.a.address,
            b"spoof",
            msg_id=1,
            flags=int(DataFlags.REQUEST),
            timeout_ms=1000,
        ),
        ErrorCode.ADDRESS_NOT_OWNED,
    ),
    Case(
        "malformed-hello-body",
        "none",
        lambda c: control_raw(ControlType.HELLO, b"\xc1"),
        ErrorCode.PROTOCOL_ERROR,
    ),
    Case(
        "malformed-register-body",
        "hello",
        lambda c: control_raw(ControlType.REGISTER, msgspec.msgpack.encode({"instance": 1})),
        ErrorCode.PROTOCOL_ERROR,
    ),
    Case(
        "malformed-join-body",
        "registered",
        lambda c: control_raw(
            ControlType.JOIN, msgspec.msgpack.encode({"member": 5, "group": "x"})
        ),
        ErrorCode.PROTOCOL_ERROR,
    ),
    Case(
        "request-and-response-flags",
        "registered",
        lambda c: data_frame(
            c.pair.b.address, c.own, b"x", flags=int(DataFlags.REQUEST | DataFlags.RESPONSE)
        ),
        ErrorCode.PROTOCOL_ERROR,
    ),
    Case(
        "destination-unknown-cast-type",
        "registered",
        lambda c: data_frame(b"\x07" + bytes(15), c.own, b"x"),
        ErrorCode.PROTOCOL_ERROR,
    ),
]


async def open_bad_link(address: str, stage: str) -> tuple[RawLink, bytes]:
    link = await RawLink.open(address)
    own = b""
    if stage in ("hello", "registered"):
        await link.hello("bad")
    if stage == "registered":
        own = await link.register("bad", 1)
    return link, own


async def assert_rejected(link: RawLink, code: ErrorCode) -> Error:
    """The broker sends exactly one ERROR frame with ``code`` and closes the link."""
    frames = await link.read_until_closed()
    assert frames, "the broker closed the link without an ERROR frame"
    assert len(frames) == 1, f"expected one ERROR frame, got {frames!r}"
    (frame,) = frames
    assert isinstance(frame, ControlFrame)
    assert frame.type == ControlType.ERROR, frame
    assert isinstance(frame.body, Error)
    assert frame.body.code == code, (
        f"expected {code.name}, got {ErrorCode(frame.body.code).name}: {frame.body.message}"
    )
    assert frame.body.message, "an ERROR frame must say what went wrong"
    return frame.body


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_fatal_bad_input(broker, healthy_pair, case):
    async def misbehave() -> None:
        link, own = await open_bad_link(broker.address, case.stage)
        try:
            await link.send(case.build(Ctx(own, healthy_pair)))
            await assert_rejected(link, case.code)
        finally:
            await link.close()

    await run_during_burst(healthy_pair, misbehave)
    # A new link can still connect and handshake.
    fresh = await RawLink.open(broker.address)
    try:
        await fresh.hello()
        await fresh.ping()
    finally:
        await fresh.close()
    stat = await healthy_pair.conn_a.stat()
    assert stat["counters"]["links_closed"].get("protocol-error") == 1
    if case.stage == "registered":
        assert "bad:1" not in stat["service_addresses"], (
            "a closed link's services must be withdrawn"
        )


def test_fatal_codes_are_declared_fatal():
    """layout.FATAL_ERRORS lists the codes after which the sender is disconnected; every
    code the broker closes a link with (test_fatal_bad_input) must be in it, since the
    client classifies errors by that set."""
    closing = {case.code for case in CASES}
    assert closing <= FATAL_ERRORS, f"closing but not declared fatal: {closing - FATAL_ERRORS}"


async def test_good_frames_before_bad_one_in_same_write_are_delivered(broker, healthy_pair):
    link, own = await open_bad_link(broker.address, "registered")
    try:
        good = [data_frame(healthy_pair.b.address, own, b"good%d" % i) for i in range(3)]
        bad = data_frame(healthy_pair.b.address, healthy_pair.a.address, b"spoof")
        after = data_frame(healthy_pair.b.address, own, b"after the bad frame")
        await link.send(b"".join(good) + bad + after)
        await assert_rejected(link, ErrorCode.ADDRESS_NOT_OWNED)
    finally:
        await link.close()
    assert await recv_payloads(healthy_pair.b, 3) == [b"good0", b"good1", b"good2"]
    await healthy_pair.roundtrip(b"nothing else")


# -- truncated frames and aborted links --------------------------------------------------


TRUNCATIONS = {
    "length-only": 3,
    "partial-header": 30,
    "partial-payload": 64 + 500,
}


@pytest.mark.parametrize("cut", TRUNCATIONS.values(), ids=TRUNCATIONS.keys())
async def test_truncated_frame_then_eof(broker, healthy_pair, cut):
    """EOF inside a frame: the link still allows an answer (half-close), so the broker
    reports the truncated frame in an ERROR frame before closing, and delivers none of it."""

    async def misbehave() -> None:
        link, own = await open_bad_link(broker.address, "registered")
        try:
            frame = data_frame(healthy_pair.b.address, own, bytes(1000))
            await link.send(frame[:cut])
            link.writer.write_eof()
            await assert_rejected(link, ErrorCode.PROTOCOL_ERROR)
        finally:
            await link.close()

    await run_during_burst(healthy_pair, misbehave)


async def test_eof_between_frames_closes_quietly(broker, healthy_pair):
    link, own = await open_bad_link(broker.address, "registered")
    try:
        await link.send(data_frame(healthy_pair.b.address, own, b"last words"))
        link.writer.write_eof()
        assert await link.read_until_closed() == []
    finally:
        await link.close()
    await assert_next_is(healthy_pair.b, b"last words")


@pytest.mark.parametrize("cut", TRUNCATIONS.values(), ids=TRUNCATIONS.keys())
async def test_raw_link_reset_mid_frame(broker, healthy_pair, cut):
    async def misbehave() -> None:
        link, own = await open_bad_link(broker.address, "registered")
        frame = data_frame(healthy_pair.b.address, own, bytes(1000))
        await link.send(frame * 5 + frame[:cut])
        link.abort()
        # The first five whole frames may or may not have been read before the reset;
        # whatever arrives is whole. Wait until the broker has dropped the link.
        await wait_service_gone(healthy_pair.conn_a, "bad:1")

    extra: list[bytes] = []
    await run_during_burst_tolerating(healthy_pair, misbehave, bytes(1000), extra)
    assert len(extra) <= 5, "a truncated frame was delivered"


async def wait_service_gone(conn: meshbus.Connector, address: str) -> None:
    """Bounded poll of the broker's service list (the change happens on another link)."""
    for _ in range(int(IO_TIMEOUT / 0.01)):
        if address not in (await conn.stat())["service_addresses"]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{address} is still registered")


async def run_during_burst_tolerating(
    pair: Pair, action: Callable[[], Awaitable[None]], extra: bytes, seen_extra: list[bytes]
) -> None:
    """Like run_during_burst, but ``pair.b`` may also get copies of ``extra`` from another
    sender; the burst itself must still be complete and in order."""
    half = BURST // 2
    for i in range(half):
        await pair.a.send(pair.b.address, seq(i))
    await action()
    for i in range(half, BURST):
        await pair.a.send(pair.b.address, seq(i))
    await pair.a.send(pair.b.address, b"end")
    burst: list[bytes] = []
    async with asyncio.timeout(30):
        while (payload := (await pair.b.recv()).payload) != b"end":
            if payload == extra:
                seen_extra.append(payload)
            else:
                burst.append(payload)
    assert burst == [seq(i) for i in range(BURST)]


async def test_connector_killed_mid_burst(broker, healthy_pair):
    """A connector whose transport is aborted while it streams: the broker stays up, the
    receiver gets an in-order prefix of what was sent, and the dead one's services go."""
    victim_rx = await healthy_pair.conn_b.register()
    # No failover: the process is gone for good, it does not come back elsewhere.
    doomed = await meshbus.connect(broker.address, server="doomed", failover=False)
    sender = await doomed.register(instance=5)
    count = 20_000

    async def action() -> None:
        for i in range(count):
            await sender.send(victim_rx.address, seq(i))
            if i == count // 2:
                assert doomed._parts.links.current is not None
                doomed._parts.links.current.abort()
                break
        await wait_service_gone(healthy_pair.conn_a, "doomed:5")

    await run_during_burst(healthy_pair, action)
    await healthy_pair.a.send(victim_rx.address, b"end")
    got: list[bytes] = []
    async with asyncio.timeout(30):
        while (payload := (await victim_rx.recv()).payload) != b"end":
            got.append(payload)
    assert got == [seq(i) for i in range(len(got))], "frames of the killed connector reordered"
    # The fixed address of the dead connector is free again.
    async with await meshbus.connect(broker.address, server="doomed") as again:
        assert (await again.register(instance=5)).address == meshbus.Unicast("doomed", 5)


# -- non-fatal refusals: the link stays open ------------------------------------------


UNSUPPORTED_CONTROLS = {
    "unknown-type-999": lambda: control_raw(999, b"\x80", correlation=42),
    "unknown-type-empty-body": lambda: control_raw(500, b"", correlation=42),
    "welcome-from-connector": lambda: encode_control(ControlType.WELCOME, Welcome(), 42),
    "pong-from-connector": lambda: encode_control(ControlType.PONG, Empty(), 42),
}


@pytest.mark.parametrize("build", UNSUPPORTED_CONTROLS.values(), ids=UNSUPPORTED_CONTROLS.keys())
async def test_unsupported_control_keeps_link_open(broker, healthy_pair, build):
    link, own = await open_bad_link(broker.address, "registered")
    try:
        await link.send(build())
        frame = await link.read_control()
        assert frame.type == ControlType.ERROR
        assert isinstance(frame.body, Error)
        assert frame.body.code == ErrorCode.UNSUPPORTED_CONTROL
        assert frame.correlation == 42
        await link.ping()
        # Still a working link: it can send data.
        await link.send(data_frame(healthy_pair.b.address, own, b"from the raw link"))
        await assert_next_is(healthy_pair.b, b"from the raw link")
    finally:
        await link.close()


async def test_refused_control_requests_keep_link_open(broker):
    link, own = await open_bad_link(broker.address, "registered")
    try:
        refusals = [
            (encode_control(ControlType.HELLO, Hello(), 50), ErrorCode.ALREADY_HANDSHAKEN),
            (
                encode_control(ControlType.REGISTER, Register(server="bad", instance=1), 51),
                ErrorCode.ADDRESS_IN_USE,
            ),
            (
                encode_control(ControlType.REGISTER, Register(server="x" * 12, instance=1), 52),
                ErrorCode.INVALID_ADDRESS,
            ),
            (
                encode_control(
                    ControlType.JOIN,
                    Membership(
                        member=meshbus.Unicast("other", 1).to_bytes(),
                        group=meshbus.Multicast("g").to_bytes(),
                    ),
                    53,
                ),
                ErrorCode.NOT_REGISTERED,
            ),
            (
                encode_control(
                    ControlType.JOIN,
                    Membership(member=own, group=meshbus.Unicast("other", 1).to_bytes()),
                    54,
                ),
                ErrorCode.INVALID_ADDRESS,
            ),
        ]
        for frame_bytes, code in refusals:
            await link.send(frame_bytes)
            frame = await link.read_control()
            assert frame.type == ControlType.ERROR, frame
            assert isinstance(frame.body, Error)
            assert frame.body.code == code, frame.body
            assert frame.correlation == int.from_bytes(frame_bytes[8:12], "big")
        await link.ping()
    finally:
        await link.close()
