"""The sans-IO codec: encoding, the incremental decoder, and the prefix checks.

Decoders are tested the h11 way: input fed whole, one byte at a time, and with
trailing bytes; then hypothesis throws arbitrary bytes at them.
"""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from meshbus.address import Anycast, Multicast, Unicast
from meshbus.errors import FrameTooLarge, MeshbusError, ProtocolError
from meshbus.protocol import (
    DEFAULT_MAX_FRAME,
    PROTOCOL_VERSION,
    ControlFrame,
    ControlType,
    DataFlags,
    DataFrame,
    ErrorCode,
    FrameDecoder,
    FrameError,
    OversizedFrame,
    check_data_flags,
    decode_body,
    describe,
    encode_control,
    encode_data,
    frame_extent,
)
from meshbus.protocol.control import (
    BODY_TYPES,
    OP_ADD,
    OP_JOIN,
    AddressBody,
    Auth,
    Body,
    BrokerInfo,
    Brokers,
    Bye,
    Challenge,
    Claim,
    DeliveryFailure,
    Drain,
    Empty,
    Error,
    GroupBind,
    GroupBound,
    GroupEnd,
    Groups,
    Hello,
    Left,
    Load,
    MemberList,
    Membership,
    MembersRequest,
    Move,
    NatsMessages,
    RaftEntryBody,
    RaftFrame,
    RaftJoinBody,
    RaftMemberBody,
    RaftMessageBody,
    RaftSnapshotBody,
    Ready,
    Register,
    Relayed,
    Revoked,
    Routed,
    Routes,
    StatRequest,
    Stats,
    StreamReply,
    StreamRequest,
    SubjectInterest,
    TraceReport,
    Welcome,
)
from meshbus.protocol.layout import (
    CONTROL_HEADER_SIZE,
    DATA_HEADER_SIZE,
    KIND_CONTROL,
    KIND_DATA,
    MIN_MAX_FRAME,
    OFF_DST,
    OFF_FLAGS,
    OFF_HOPS,
    OFF_LINK_TAG,
    OFF_MSG_ID,
    OFF_RESPONSE_FOR,
    OFF_SRC,
    OFF_TIMEOUT_MS,
    ROUTING_KEY_SIZE,
)

DST = Unicast("game01", 65537).to_bytes()
SRC = Unicast("login", 1).to_bytes()
GROUP = Multicast("chat.lobby").to_bytes()


def drain(decoder: FrameDecoder) -> list[DataFrame | ControlFrame]:
    frames = []
    while (frame := decoder.next_frame()) is not None:
        frames.append(frame)
    return frames


def control_bytes(ctype: int, body: bytes, correlation: int = 0) -> bytes:
    """A control frame with a raw body, bypassing the encoder's body checks."""
    length = CONTROL_HEADER_SIZE + len(body) - 4
    return struct.pack(">IBBHI", length, KIND_CONTROL, PROTOCOL_VERSION, ctype, correlation) + body


def decode_one(data: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> DataFrame | ControlFrame:
    decoder = FrameDecoder(max_frame)
    decoder.feed(data)
    frame = decoder.next_frame()
    assert frame is not None
    assert decoder.buffered == 0
    return frame


# -- layout ---------------------------------------------------------------------------


def test_header_sizes_and_offsets() -> None:
    assert DATA_HEADER_SIZE == 64
    assert CONTROL_HEADER_SIZE == 12
    assert (OFF_FLAGS, OFF_HOPS, OFF_DST, OFF_SRC) == (6, 7, 8, 24)
    assert (OFF_LINK_TAG, OFF_MSG_ID, OFF_RESPONSE_FOR, OFF_TIMEOUT_MS) == (40, 44, 52, 60)
    assert ROUTING_KEY_SIZE == 40
    assert DEFAULT_MAX_FRAME == 1024 * 1024


def test_data_frame_fields_sit_at_their_offsets() -> None:
    """The broker reads dst at 8 and src at 24 without decoding; pin every offset."""
    frame = encode_data(
        DST,
        SRC,
        b"payload",
        msg_id=0x0102030405060708,
        response_for=0x1112131415161718,
        flags=int(DataFlags.REQUEST | DataFlags.ECHO),
        hops=3,
        link_tag=0xA1A2A3A4,
        timeout_ms=0xB1B2B3B4,
    )
    assert len(frame) == 64 + 7
    assert frame[0:4] == (64 + 7 - 4).to_bytes(4, "big")
    assert frame[4] == KIND_DATA == 1
    assert frame[5] == PROTOCOL_VERSION == 1
    assert frame[6] == 0x05
    assert frame[7] == 3
    assert frame[8:24] == DST
    assert frame[24:40] == SRC
    assert frame[40:44] == b"\xa1\xa2\xa3\xa4"
    assert frame[44:52] == bytes(range(1, 9))
    assert frame[52:60] == bytes(range(0x11, 0x19))
    assert frame[60:64] == b"\xb1\xb2\xb3\xb4"
    assert frame[64:] == b"payload"


def test_control_frame_header_layout() -> None:
    frame = encode_control(ControlType.PING, Empty(), correlation=0x01020304)
    assert frame == b"\x00\x00\x00\x09\x02\x01\x00\x0e\x01\x02\x03\x04\x80"


# -- data frames ------------------------------------------------------------------------


def test_data_frame_round_trip() -> None:
    frame = decode_one(
        encode_data(
            DST,
            SRC,
            b"hello",
            msg_id=42,
            response_for=7,
            flags=int(DataFlags.RESPONSE),
            hops=1,
            link_tag=9,
            timeout_ms=1500,
        )
    )
    assert frame == DataFrame(
        dst=DST,
        src=SRC,
        payload=b"hello",
        msg_id=42,
        response_for=7,
        flags=2,
        hops=1,
        link_tag=9,
        timeout_ms=1500,
    )


def test_data_frame_defaults_and_empty_payload() -> None:
    raw = encode_data(GROUP, SRC, b"")
    assert len(raw) == 64
    assert decode_one(raw) == DataFrame(dst=GROUP, src=SRC, payload=b"")


def test_encode_data_accepts_buffers() -> None:
    a = encode_data(DST, SRC, b"xyz")
    assert encode_data(DST, SRC, bytearray(b"xyz")) == a
    assert encode_data(DST, SRC, memoryview(b"xyz")) == a


def test_encode_data_too_large() -> None:
    limit = MIN_MAX_FRAME
    fits = encode_data(DST, SRC, b"x" * (limit - 64), max_frame=limit)
    assert len(fits) == limit
    with pytest.raises(FrameTooLarge) as info:
        encode_data(DST, SRC, b"x" * (limit - 63), max_frame=limit)
    assert info.value.size == limit + 1
    assert info.value.limit == limit
    assert isinstance(info.value, ProtocolError)


def test_encode_data_too_large_default_limit() -> None:
    with pytest.raises(FrameTooLarge) as info:
        encode_data(DST, SRC, bytes(DEFAULT_MAX_FRAME))
    assert info.value.size == DEFAULT_MAX_FRAME + 64
    assert info.value.limit == DEFAULT_MAX_FRAME


def test_encode_control_too_large() -> None:
    with pytest.raises(FrameTooLarge) as info:
        encode_control(ControlType.BYE, Bye(reason="x" * 300), max_frame=256)
    assert info.value.limit == 256
    assert info.value.size > 256


def test_frame_of_exactly_max_frame_is_accepted() -> None:
    raw = encode_data(DST, SRC, b"p" * (300 - 64), max_frame=300)
    assert len(raw) == 300
    frame = decode_one(raw, max_frame=300)
    assert isinstance(frame, DataFrame)
    assert frame.payload == b"p" * 236
    with pytest.raises(OversizedFrame):
        decode_one(raw, max_frame=299)


# -- flags ------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", range(256))
def test_check_data_flags(flags: int) -> None:
    valid = flags & 0x03 != 0x03  # every bit has a meaning; only this pair contradicts
    if valid:
        check_data_flags(flags)
    else:
        with pytest.raises(FrameError) as info:
            check_data_flags(flags)
        assert info.value.code is ErrorCode.PROTOCOL_ERROR


@pytest.mark.parametrize("flags", [0x83, 0xFF, 0x03, 0x07])
def test_decoder_rejects_bad_flags(flags: int) -> None:
    # The encoder does not check flags; the decoder must.
    raw = encode_data(DST, SRC, b"", flags=flags)
    with pytest.raises(FrameError) as info:
        decode_one(raw)
    assert info.value.code is ErrorCode.PROTOCOL_ERROR


def test_flag_values() -> None:
    assert int(DataFlags.REQUEST) == 0x01
    assert int(DataFlags.RESPONSE) == 0x02
    assert int(DataFlags.ECHO) == 0x04
    assert int(DataFlags.NOTIFY_DROP) == 0x08
    assert int(DataFlags.EXT) == 0x10
    assert int(DataFlags.RELIABLE) == 0x20
    assert int(DataFlags.ACK) == 0x40
    assert int(DataFlags.TRACE) == 0x80


# -- control frames -------------------------------------------------------------------------

SAMPLE_BODIES: dict[ControlType, Body] = {
    ControlType.HELLO: Hello(name="game01", max_frame=65536),
    ControlType.WELCOME: Welcome(broker="broker-7400", slot=3, max_frame=65536),
    ControlType.REGISTER: Register(server="game01", instance=5),
    ControlType.REGISTERED: AddressBody(address=DST),
    ControlType.UNREGISTER: AddressBody(address=DST),
    ControlType.JOIN: Membership(member=DST, group=GROUP),
    ControlType.LEAVE: Membership(member=DST, group=Anycast("login").to_bytes()),
    ControlType.OK: Empty(),
    ControlType.ERROR: Error(code=int(ErrorCode.ADDRESS_IN_USE), message="taken"),
    ControlType.TIMEOUT: DeliveryFailure(msg_id=2**64 - 1, src=SRC, dst=DST),
    ControlType.NO_ROUTE: DeliveryFailure(msg_id=17, src=SRC, dst=GROUP),
    ControlType.STAT: StatRequest(detail=False),
    ControlType.STATS: Stats(data={"n": 1, "list": [1, "a", None], "nested": {"x": 1.5}}),
    ControlType.PING: Empty(),
    ControlType.PONG: Empty(),
    ControlType.BYE: Bye(reason="done"),
    ControlType.BROKERS: Brokers(
        brokers=[BrokerInfo(name="b1", address="127.0.0.1:7400", slot=1, ready=True)]
    ),
    ControlType.ROUTES: Routes(
        ops=[(OP_ADD, DST, b"s" * 16), (OP_JOIN, DST, GROUP)], snapshot=True, complete=True
    ),
    ControlType.CLAIM: Claim(key=DST, session=b"s" * 16),
    ControlType.RELEASE: Claim(key=DST),
    ControlType.LOAD: Load(connectors=3, capacity=50, slot=2, ready=True),
    ControlType.READY: Ready(counts={"b1": 10, "b2": 0}),
    ControlType.DRAINING: Empty(),
    ControlType.MOVE: Move(address="127.0.0.1:7401", reason="rebalance"),
    ControlType.DRAIN: Drain(grace=2.5),
    ControlType.ROUTED: Routed(seq=42),
    ControlType.SYNCED: Empty(),
    ControlType.MEMBERS: MembersRequest(group=b"\x02" + bytes(15), pick=True),
    ControlType.MEMBER_LIST: MemberList(members=[b"\x01" + bytes(14) + b"\x01"]),
    ControlType.GROUP_BIND: GroupBind(group=b"\x03" + bytes(15), key=b"order-17", expiry=60.0),
    ControlType.GROUP_BOUND: GroupBound(member=b"\x01" + bytes(15), reassigned=True),
    ControlType.GROUP_END: GroupEnd(group=b"\x03" + bytes(15), key=b"order-17"),
    ControlType.GROUPS: Groups(ops=[(b"\x03" + bytes(15), b"g", b"\x01" + bytes(15), 300.0)]),
    ControlType.STREAM: StreamRequest(op="fetch", stream="results", from_seq=5),
    ControlType.STREAM_REPLY: StreamReply(messages=[(1, 2.5, b"s", b"d", b"", 0, b"p", 1, b"")]),
    ControlType.RELAYED: Relayed(type=31, body=b"\x80"),
    ControlType.WATCH: Empty(),
    ControlType.LEFT: Left(addresses=[b"\x01" + bytes(15)]),
    ControlType.TRACE: TraceReport(src=SRC, msg_id=7, dst=DST, sent_at=1.5, received_at=1.75),
    ControlType.REVOKED: Revoked(address=SRC, reason="split"),
    ControlType.CHALLENGE: Challenge(nonce=bytes(range(32))),
    ControlType.AUTH: Auth(user="alice", signature=bytes(64)),
    ControlType.RAFT: RaftFrame(
        group="orders",
        messages=[
            RaftMessageBody(
                kind=4,
                sender=1,
                to=2,
                term=3,
                index=7,
                log_term=3,
                entries=[RaftEntryBody(3, 8, b"data"), RaftEntryBody(3, 9, voters=[1, 2, 3])],
                commit=7,
                snapshot=RaftSnapshotBody(5, 2, [1, 2, 3]),
            )
        ],
        incarnation=2**62,
        join=RaftJoinBody(4, 2**62, [RaftMemberBody(1, "b1"), RaftMemberBody(4, "b4", 2**62)]),
    ),
    ControlType.NATS_MSGS: NatsMessages(
        msgs=[(b"orders.new", b"_INBOX.x.1", 12, b"NATS/1.0\r\n\r\nhi", False, [b"workers"])]
    ),
    ControlType.SUBSCRIBE: SubjectInterest(
        member=Unicast("game01", 5).to_bytes(), subject=b"game.*.chat", queue=b"chatters"
    ),
    ControlType.UNSUBSCRIBE: SubjectInterest(
        member=Unicast("game01", 5).to_bytes(), subject=b"game.eu-west-zone7.>"
    ),
}


def test_every_control_type_has_a_sample_and_a_body_type() -> None:
    assert set(SAMPLE_BODIES) == set(ControlType)
    assert set(BODY_TYPES) == set(ControlType)
    for ctype, body in SAMPLE_BODIES.items():
        assert type(body) is BODY_TYPES[ctype]


@pytest.mark.parametrize("ctype", list(ControlType), ids=lambda t: t.name)
def test_control_round_trip(ctype: ControlType) -> None:
    body = SAMPLE_BODIES[ctype]
    raw = encode_control(ctype, body, correlation=0xDEADBEEF)
    assert raw[4] == KIND_CONTROL
    assert int.from_bytes(raw[6:8], "big") == int(ctype)
    frame = decode_one(raw)
    assert isinstance(frame, ControlFrame)
    assert frame.type == ctype
    assert frame.correlation == 0xDEADBEEF
    assert type(frame.body) is type(body)
    assert frame.body == body


def test_control_defaults_are_omitted_and_restored() -> None:
    raw = encode_control(ControlType.HELLO, Hello())
    assert raw[12:] == b"\x80"  # every field is at its default: an empty map
    frame = decode_one(raw)
    assert isinstance(frame, ControlFrame)
    assert frame.body == Hello(protocol=1, role="connector", name="", max_frame=DEFAULT_MAX_FRAME)


def test_control_bodies_ignore_unknown_fields() -> None:
    body = msgspec.msgpack.encode({"name": "x", "future": [1, 2, {"a": b"b"}], "max_frame": 999})
    frame = decode_one(control_bytes(ControlType.HELLO, body, 5))
    assert frame == ControlFrame(ControlType.HELLO, Hello(name="x", max_frame=999), 5)


@pytest.mark.parametrize("ctype", [0, 99, 200, 0xFFFF])
def test_unknown_control_type_decodes_with_body_none(ctype: int) -> None:
    frame = decode_one(control_bytes(ctype, b"\xff\x00not msgpack", 3))
    assert frame == ControlFrame(ctype, None, 3)
    assert decode_body(ctype, b"\xc1") is None


def test_describe() -> None:
    assert describe(14) == "PING"
    assert describe(999) == "control type 999"


@pytest.mark.parametrize(
    ("ctype", "body"),
    [
        (ControlType.REGISTER, b"\x80"),  # missing required 'server'
        (ControlType.REGISTER, msgspec.msgpack.encode({"server": 5})),  # wrong type
        (ControlType.ERROR, msgspec.msgpack.encode({"code": "x"})),
        (ControlType.TIMEOUT, msgspec.msgpack.encode({"msg_id": 1, "src": b"x"})),  # no dst
        (ControlType.REGISTERED, msgspec.msgpack.encode({"address": "text, not bin"})),
        (ControlType.HELLO, b"\x01"),  # not a map
        (ControlType.HELLO, b"\x81\xa4name"),  # truncated
        (ControlType.OK, b""),  # empty body
        (ControlType.OK, b"\x80\x80"),  # trailing bytes
        (ControlType.PING, b"\xc1"),  # never-used msgpack byte
        (ControlType.STATS, msgspec.msgpack.encode({"data": [1, 2]})),
    ],
)
def test_malformed_control_body(ctype: ControlType, body: bytes) -> None:
    with pytest.raises(FrameError) as info:
        decode_one(control_bytes(ctype, body))
    assert info.value.code is ErrorCode.PROTOCOL_ERROR
    assert ctype.name in str(info.value)


@pytest.mark.parametrize(
    ("ctype", "body"),
    [
        (ControlType.BYE, b"\x81\xa6reason\xa1\xff"),
        (ControlType.HELLO, b"\x81\xa4name\xa2\xff\xfe"),
        (ControlType.REGISTER, b"\x81\xa6server\xa1\xff"),
        (ControlType.STATS, b"\x81\xa4data\x81\xa2\xff\xfe\x01"),
    ],
    ids=["BYE", "HELLO", "REGISTER", "STATS-key"],
)
def test_invalid_utf8_in_control_body_is_a_protocol_error(ctype: ControlType, body: bytes) -> None:
    """A msgpack str that is not UTF-8 is a malformed body, not a UnicodeDecodeError."""
    with pytest.raises(FrameError) as info:
        decode_one(control_bytes(ctype, body))
    assert info.value.code is ErrorCode.PROTOCOL_ERROR


@pytest.mark.parametrize(
    ("ctype", "body"),
    [
        (ControlType.STATS, b"\x81\xa4data\x81\xa1x" + b"\x91" * 1500 + b"\xc0"),
        # An unknown field is skipped, but skipping it still walks the nesting.
        (ControlType.HELLO, b"\x81\xa1z" + b"\x91" * 1500 + b"\xc0"),
    ],
    ids=["STATS", "HELLO-unknown-field"],
)
def test_deeply_nested_control_body_is_a_protocol_error(ctype: ControlType, body: bytes) -> None:
    """Deep nesting fits easily in a 1 MiB frame; it must not escape as RecursionError."""
    with pytest.raises(FrameError) as info:
        decode_one(control_bytes(ctype, body))
    assert info.value.code is ErrorCode.PROTOCOL_ERROR


# -- frame_extent ------------------------------------------------------------------------------


def test_frame_extent_needs_four_bytes() -> None:
    raw = encode_data(DST, SRC, b"abc")
    for n in range(4):
        assert frame_extent(raw, 0, n, DEFAULT_MAX_FRAME) == 0


def test_frame_extent_incomplete_then_complete() -> None:
    raw = encode_data(DST, SRC, b"abc")
    for n in range(4, len(raw)):
        assert frame_extent(raw, 0, n, DEFAULT_MAX_FRAME) == 0
    assert frame_extent(raw, 0, len(raw), DEFAULT_MAX_FRAME) == len(raw)
    assert frame_extent(raw + b"\x00" * 10, 0, len(raw) + 10, DEFAULT_MAX_FRAME) == len(raw)


def test_frame_extent_at_an_offset() -> None:
    a = encode_control(ControlType.PING, Empty())
    b = encode_data(DST, SRC, b"12345")
    buf = bytearray(a + b)
    assert frame_extent(buf, 0, len(buf), DEFAULT_MAX_FRAME) == len(a)
    assert frame_extent(buf, len(a), len(buf), DEFAULT_MAX_FRAME) == len(b)
    assert frame_extent(memoryview(buf), len(a), len(buf) - 1, DEFAULT_MAX_FRAME) == 0


def test_oversized_length_is_refused_from_the_prefix_alone() -> None:
    prefix = (2048 - 4).to_bytes(4, "big")  # claims a 2048-byte frame
    with pytest.raises(OversizedFrame) as info:
        frame_extent(prefix, 0, 4, 1024)
    assert info.value.size == 2048
    assert info.value.limit == 1024
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE
    assert isinstance(info.value, FrameTooLarge)
    assert isinstance(info.value, ProtocolError)


def test_decoder_refuses_oversized_frame_as_soon_as_length_arrives() -> None:
    decoder = FrameDecoder(max_frame=1024)
    decoder.feed(b"\xff\xff")
    assert decoder.next_frame() is None
    decoder.feed(b"\xff")
    assert decoder.next_frame() is None
    decoder.feed(b"\xff")  # the 4th byte: now the decoder knows, without any body
    with pytest.raises(OversizedFrame) as info:
        decoder.next_frame()
    assert info.value.size == 0xFFFFFFFF + 4
    assert info.value.limit == 1024


@pytest.mark.parametrize("kind", [0, 3, 0xFF])
def test_unknown_kind(kind: int) -> None:
    raw = bytearray(encode_data(DST, SRC, b""))
    raw[4] = kind
    with pytest.raises(FrameError) as info:
        frame_extent(raw, 0, 6, DEFAULT_MAX_FRAME)  # six bytes are enough to tell
    assert info.value.code is ErrorCode.UNKNOWN_KIND


@pytest.mark.parametrize("version", [0, 2, 0xFF])
def test_unsupported_version(version: int) -> None:
    raw = bytearray(encode_control(ControlType.PING, Empty()))
    raw[5] = version
    with pytest.raises(FrameError) as info:
        frame_extent(raw, 0, 6, DEFAULT_MAX_FRAME)
    assert info.value.code is ErrorCode.UNSUPPORTED_VERSION


@pytest.mark.parametrize(
    ("kind", "total"), [(KIND_DATA, 63), (KIND_DATA, 6), (KIND_CONTROL, 11), (KIND_CONTROL, 4)]
)
def test_length_shorter_than_header(kind: int, total: int) -> None:
    raw = (total - 4).to_bytes(4, "big") + bytes((kind, PROTOCOL_VERSION)) + b"\x00" * 100
    with pytest.raises(FrameError) as info:
        frame_extent(raw, 0, len(raw), DEFAULT_MAX_FRAME)
    assert info.value.code is ErrorCode.PROTOCOL_ERROR


# -- the incremental decoder -------------------------------------------------------------------

STREAM_FRAMES: list[DataFrame | ControlFrame] = [
    ControlFrame(ControlType.HELLO, Hello(name="n"), 1),
    DataFrame(dst=DST, src=SRC, payload=b"first"),
    DataFrame(dst=GROUP, src=SRC, payload=b"", msg_id=2, flags=int(DataFlags.ECHO)),
    ControlFrame(ControlType.STATS, Stats(data={"a": [1, 2]}), 2),
    DataFrame(dst=DST, src=SRC, payload=bytes(range(256)) * 3, msg_id=3, timeout_ms=10),
    ControlFrame(77, None, 9),
]


def encode_frame(frame: DataFrame | ControlFrame) -> bytes:
    if isinstance(frame, DataFrame):
        return encode_data(
            frame.dst,
            frame.src,
            frame.payload,
            msg_id=frame.msg_id,
            response_for=frame.response_for,
            flags=frame.flags,
            hops=frame.hops,
            link_tag=frame.link_tag,
            timeout_ms=frame.timeout_ms,
        )
    if frame.body is None:
        return control_bytes(frame.type, b"\x80", frame.correlation)
    return encode_control(ControlType(frame.type), frame.body, frame.correlation)


STREAM = b"".join(encode_frame(f) for f in STREAM_FRAMES)


def test_decoder_fed_whole() -> None:
    decoder = FrameDecoder()
    decoder.feed(STREAM)
    assert drain(decoder) == STREAM_FRAMES
    assert decoder.buffered == 0
    assert decoder.next_frame() is None


def test_decoder_fed_one_byte_at_a_time() -> None:
    decoder = FrameDecoder()
    frames = []
    for i in range(len(STREAM)):
        decoder.feed(STREAM[i : i + 1])
        frames.extend(drain(decoder))
    assert frames == STREAM_FRAMES
    assert decoder.buffered == 0


def test_decoder_with_trailing_bytes_keeps_the_partial_frame() -> None:
    last = encode_data(DST, SRC, b"the next one", msg_id=99)
    for cut in (1, 4, 5, 6, 40, len(last) - 1):
        decoder = FrameDecoder()
        decoder.feed(STREAM + last[:cut])
        assert drain(decoder) == STREAM_FRAMES
        assert decoder.buffered == cut
        decoder.feed(last[cut:])
        assert drain(decoder) == [DataFrame(dst=DST, src=SRC, payload=b"the next one", msg_id=99)]
        assert decoder.buffered == 0


def test_decoder_accepts_buffers() -> None:
    decoder = FrameDecoder()
    decoder.feed(bytearray(STREAM[:100]))
    decoder.feed(memoryview(STREAM)[100:])
    assert drain(decoder) == STREAM_FRAMES


def test_decoder_is_poisoned_after_an_error() -> None:
    decoder = FrameDecoder()
    good = encode_control(ControlType.PING, Empty())
    bad = bytearray(good)
    bad[5] = 9  # version 9
    decoder.feed(good + bytes(bad) + good)
    assert drain_one(decoder) == ControlFrame(ControlType.PING, Empty(), 0)
    with pytest.raises(FrameError) as first:
        decoder.next_frame()
    assert first.value.code is ErrorCode.UNSUPPORTED_VERSION
    # The good frame after it is never returned: the stream cannot be trusted again.
    with pytest.raises(FrameError) as again:
        decoder.next_frame()
    assert again.value is first.value
    with pytest.raises(FrameError):
        decoder.feed(good)


def test_decoder_is_poisoned_after_a_bad_body() -> None:
    decoder = FrameDecoder()
    decoder.feed(control_bytes(ControlType.REGISTER, b"\x80"))
    with pytest.raises(FrameError):
        decoder.next_frame()
    with pytest.raises(FrameError):
        decoder.next_frame()


def drain_one(decoder: FrameDecoder) -> DataFrame | ControlFrame | None:
    return decoder.next_frame()


# -- properties ----------------------------------------------------------------------------------

MAX_FRAMES = [MIN_MAX_FRAME, 300, 1024, DEFAULT_MAX_FRAME]


def _header_then_noise() -> st.SearchStrategy[bytes]:
    """A plausible prefix followed by random bytes: reaches the body decoders far more often."""

    @st.composite
    def build(draw: st.DrawFn) -> bytes:
        kind = draw(st.sampled_from([KIND_DATA, KIND_CONTROL, 0, 3]))
        body = draw(st.binary(max_size=400))
        header_rest = draw(st.binary(min_size=6, max_size=58))
        if kind == KIND_CONTROL:
            ctype = draw(st.sampled_from([*list(ControlType), 0, 99]))
            header_rest = int(ctype).to_bytes(2, "big") + header_rest[2:6]
        rest = header_rest + body
        length = draw(st.one_of(st.just(len(rest) + 2), st.integers(0, 2**32 - 1)))
        version = draw(st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, 2]))
        return length.to_bytes(4, "big") + bytes((kind, version)) + rest

    return build()


def _msgpack_bodies() -> st.SearchStrategy[bytes]:
    """Control frames whose body is valid-ish msgpack with random content and random damage."""
    # Raw tokens the encoder would never write: fixstr headers over arbitrary (often
    # non-UTF-8) bytes, and arrays nested deeper than any sane body.
    raw_strs = st.binary(max_size=31).map(lambda b: msgspec.Raw(bytes([0xA0 | len(b)]) + b))
    deep = st.integers(0, 3000).map(lambda n: msgspec.Raw(b"\x91" * n + b"\xc0"))
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.text(),
        st.binary(),
        raw_strs,
        deep,
    )
    values = st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    )

    @st.composite
    def build(draw: st.DrawFn) -> bytes:
        ctype = draw(st.sampled_from(list(ControlType)))
        # Mostly the body type's own field names, so the values reach the typed decoders.
        names = [f.encode_name for f in msgspec.structs.fields(BODY_TYPES[ctype])]
        keys = st.sampled_from([*names, "x"]) if names else st.just("x")
        body = msgspec.msgpack.encode(draw(st.dictionaries(keys, values, max_size=4)))
        if draw(st.booleans()) and body:
            i = draw(st.integers(0, len(body) - 1))
            body = body[:i] + bytes([draw(st.integers(0, 255))]) + body[i + 1 :]
        return control_bytes(ctype, body)

    return build()


def _feed_all(decoder: FrameDecoder, chunks: list[bytes]) -> None:
    for chunk in chunks:
        decoder.feed(chunk)
        while decoder.next_frame() is not None:
            pass


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.one_of(
        st.binary(max_size=600),
        _header_then_noise(),
        st.lists(_header_then_noise(), max_size=3).map(b"".join),
        _msgpack_bodies(),
    ),
    max_frame=st.sampled_from(MAX_FRAMES),
    chunk=st.integers(1, 700),
)
@example(data=control_bytes(ControlType.BYE, b"\x81\xa6reason\xa1\xff"), max_frame=1024, chunk=700)
@example(
    data=control_bytes(ControlType.STATS, b"\x81\xa4data\x81\xa1x" + b"\x91" * 1500 + b"\xc0"),
    max_frame=DEFAULT_MAX_FRAME,
    chunk=700,
)
def test_any_bytes_yield_frames_or_protocol_error(data: bytes, max_frame: int, chunk: int) -> None:
    decoder = FrameDecoder(max_frame)
    chunks = [data[i : i + chunk] for i in range(0, len(data), chunk)]
    error: ProtocolError | None = None
    try:
        _feed_all(decoder, chunks)
    except ProtocolError as exc:
        error = exc
    if error is None:
        assert decoder.buffered <= len(data)
        return
    assert isinstance(error, MeshbusError)
    # Every decoding error carries the code to send to the peer.
    assert getattr(error, "code", None) in set(ErrorCode)
    # Poisoned: the same error again.
    with pytest.raises(ProtocolError) as again:
        decoder.next_frame()
    assert again.value is error


addresses16 = st.binary(min_size=16, max_size=16)
valid_flags = st.sampled_from([f for f in range(16) if f & 3 != 3])

data_frames = st.builds(
    DataFrame,
    dst=addresses16,
    src=addresses16,
    payload=st.binary(max_size=300),
    msg_id=st.integers(0, 2**64 - 1),
    response_for=st.integers(0, 2**64 - 1),
    flags=valid_flags,
    hops=st.integers(0, 255),
    link_tag=st.integers(0, 2**32 - 1),
    timeout_ms=st.integers(0, 2**32 - 1),
)
control_frames = st.builds(
    lambda t, corr: ControlFrame(t, SAMPLE_BODIES[t], corr),
    st.sampled_from(list(ControlType)),
    st.integers(0, 2**32 - 1),
)


@given(
    frames=st.lists(st.one_of(data_frames, control_frames), max_size=8),
    cuts=st.lists(st.integers(0, 4000), max_size=10),
)
def test_valid_frames_split_anywhere_decode_back(
    frames: list[DataFrame | ControlFrame], cuts: list[int]
) -> None:
    stream = b"".join(encode_frame(f) for f in frames)
    points = sorted({c % (len(stream) + 1) for c in cuts})
    pieces = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    decoder = FrameDecoder()
    out: list[DataFrame | ControlFrame] = []
    for piece in pieces:
        decoder.feed(piece)
        out.extend(drain(decoder))
    assert out == frames
    assert decoder.buffered == 0


# -- frames(): the one-pass decoding of a read ------------------------------------------------


def _frames_or_error(
    decoder: FrameDecoder, chunks: list[bytes], one_pass: bool
) -> tuple[list[DataFrame | ControlFrame], type[ProtocolError] | None, object]:
    """What ``decoder`` makes of ``chunks``: the frames, and the error it ended with (its
    class and code), taking the frames with ``frames()`` or with ``next_frame()``."""
    out: list[DataFrame | ControlFrame] = []
    try:
        for chunk in chunks:
            decoder.feed(chunk)
            if one_pass:
                while batch := decoder.frames():
                    out.extend(batch)
            else:
                while (frame := decoder.next_frame()) is not None:
                    out.append(frame)
    except ProtocolError as exc:
        return out, type(exc), getattr(exc, "code", None)
    return out, None, None


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.one_of(
        st.binary(max_size=600),
        _header_then_noise(),
        st.lists(st.one_of(_header_then_noise(), data_frames.map(encode_frame)), max_size=4).map(
            b"".join
        ),
    ),
    max_frame=st.sampled_from(MAX_FRAMES),
    chunk=st.integers(1, 700),
)
def test_frames_takes_what_next_frame_takes(data: bytes, max_frame: int, chunk: int) -> None:
    """The one-pass decoding accepts exactly the frames the frame-by-frame one does, and
    stops at the same broken rule -- after handing out the frames before it."""
    chunks = [data[i : i + chunk] for i in range(0, len(data), chunk)]
    one_pass = _frames_or_error(FrameDecoder(max_frame), chunks, one_pass=True)
    one_by_one = _frames_or_error(FrameDecoder(max_frame), chunks, one_pass=False)
    assert one_pass == one_by_one


def test_frames_hands_out_the_frames_before_a_broken_one_then_raises() -> None:
    decoder = FrameDecoder()
    good = encode_data(DST, SRC, b"before", msg_id=1)
    bad = bytearray(encode_data(DST, SRC, b"bad", msg_id=2))
    bad[6] = 0x03  # REQUEST and RESPONSE at once
    decoder.feed(good + good + bytes(bad) + good)
    assert [f.payload for f in decoder.frames() if isinstance(f, DataFrame)] == [b"before"] * 2
    with pytest.raises(FrameError) as broken:
        decoder.frames()
    assert broken.value.code is ErrorCode.PROTOCOL_ERROR
    with pytest.raises(FrameError):
        decoder.next_frame()


def test_frames_keeps_a_partial_frame_for_the_next_read() -> None:
    decoder = FrameDecoder()
    last = encode_data(DST, SRC, b"the next one", msg_id=99)
    decoder.feed(STREAM + last[:70])
    assert decoder.frames() == STREAM_FRAMES
    assert decoder.buffered == 70
    assert decoder.frames() == []
    decoder.feed(last[70:])
    assert decoder.frames() == [DataFrame(dst=DST, src=SRC, payload=b"the next one", msg_id=99)]
    assert decoder.buffered == 0
