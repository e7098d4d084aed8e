"""A raw protocol client driven by hand, and the frames it reads and writes."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from typing import Any

from meshbus.address import Anycast, Unicast
from meshbus.protocol.codec import (
    ControlFrame,
    DataFrame,
    Frame,
    FrameDecoder,
    encode_control,
    encode_control_raw,
    encode_data,
)
from meshbus.protocol.control import (
    BODY_TYPES,
    NONCE_SIZE,
    ROLE_CONNECTOR,
    TOKEN_PROOF_SIZE,
    AddressBody,
    Auth,
    Body,
    Challenge,
    Claim,
    DeliveryFailure,
    Error,
    GroupBind,
    GroupBound,
    GroupEnd,
    Hello,
    Membership,
    MembersRequest,
    Move,
    RaftFrame,
    Register,
    Relayed,
    Revoked,
    Routed,
    StreamRequest,
    SubjectInterest,
    Welcome,
)
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.testing.network import FakeNetwork, FakeTransport, Wire


class FakeClient(asyncio.Protocol):
    """A hand-driven protocol connection to one broker: frames out, decoded frames in.

    Frames the broker sends pile up in ``inbox`` until taken (``answer``, ``take``)."""

    def __init__(self, network: FakeNetwork, name: str = "raw") -> None:
        self.network = network
        self.name = name
        self.decoder = FrameDecoder()
        self.inbox: deque[Frame] = deque()
        self.transport: FakeTransport | None = None
        self.eof = False
        self.lost = False
        self.lost_with: Exception | None = None
        self.wire: Wire | None = None
        self._correlations = itertools.count(1)

    @classmethod
    def connect(cls, network: FakeNetwork, address: str, name: str = "raw") -> FakeClient:
        client = cls(network, name)
        client.wire = network.connect(name, address, client)
        return client

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, FakeTransport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.decoder.feed(data)
        while (frame := self.decoder.next_frame()) is not None:
            self.inbox.append(frame)

    def eof_received(self) -> bool:
        self.eof = True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.lost_with = exc

    # -- sending ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """The broker closed the link (or it broke)."""
        return self.eof or self.lost

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def send_control(self, type_: ControlType | int, body: Body, correlation: int = -1) -> int:
        """Send a control frame; returns its correlation (a fresh one unless given)."""
        if correlation < 0:
            correlation = next(self._correlations) + 1000
        self.send(encode_control(ControlType(type_), body, correlation))
        return correlation

    def send_raw_control(self, type_: int, body: bytes, correlation: int) -> None:
        """A control frame of any type number, with a body as given."""
        self.send(encode_control_raw(type_, body, correlation))

    def send_data(self, dst: bytes, src: bytes, payload: bytes = b"", **fields: int) -> None:
        self.send(encode_data(dst, src, payload, **fields))

    def close(self) -> None:
        assert self.transport is not None
        self.transport.close()

    def abort(self) -> None:
        """Go away as a crashed process does: a reset."""
        assert self.transport is not None
        self.transport.abort()

    # -- receiving -----------------------------------------------------------------------------

    def take(self, type_: ControlType | None = None) -> list[Frame]:
        """Every frame received so far (of control type ``type_`` only, if given), taken
        out of the inbox."""
        if type_ is None:
            frames = list(self.inbox)
            self.inbox.clear()
            return frames
        taken: list[Frame] = []
        kept: deque[Frame] = deque()
        for frame in self.inbox:
            wanted = isinstance(frame, ControlFrame) and frame.type == type_
            (taken if wanted else kept).append(frame)
        self.inbox = kept
        return taken

    def take_data(self) -> list[DataFrame]:
        frames = [f for f in self.inbox if isinstance(f, DataFrame)]
        self.inbox = deque(f for f in self.inbox if not isinstance(f, DataFrame))
        return frames

    def controls(self) -> list[ControlFrame]:
        """The control frames received and not taken, left in the inbox."""
        return [f for f in self.inbox if isinstance(f, ControlFrame)]

    def answer(self, correlation: int) -> ControlFrame:
        """Take the one frame that answers ``correlation``."""
        found = [f for f in self.controls() if f.correlation == correlation]
        assert len(found) == 1, (
            f"{self.name}: {len(found)} answers to correlation {correlation}; inbox: "
            f"{[describe_frame(f) for f in self.inbox]}"
        )
        self.inbox.remove(found[0])
        return found[0]

    async def ask(self, type_: ControlType, body: Body) -> ControlFrame:
        """Send a request, settle, and take its answer."""
        correlation = self.send_control(type_, body)
        await self.network.settle()
        return self.answer(correlation)

    # -- the usual conversations -------------------------------------------------------------

    async def hello(
        self, role: str = ROLE_CONNECTOR, *, name: str | None = None, **fields: Any
    ) -> Welcome:
        frame = await self.ask(
            ControlType.HELLO, Hello(role=role, name=self.name if name is None else name, **fields)
        )
        assert frame.type == ControlType.WELCOME, describe_frame(frame)
        assert isinstance(frame.body, Welcome)
        return frame.body

    async def register(self, server: str = "svc", instance: int = 0) -> bytes:
        frame = await self.ask(ControlType.REGISTER, Register(server=server, instance=instance))
        assert frame.type == ControlType.REGISTERED, describe_frame(frame)
        assert isinstance(frame.body, AddressBody)
        return frame.body.address

    async def join(self, member: bytes, group: bytes) -> None:
        frame = await self.ask(ControlType.JOIN, Membership(member=member, group=group))
        assert frame.type == ControlType.OK, describe_frame(frame)

    async def unregister(self, address: bytes) -> None:
        frame = await self.ask(ControlType.UNREGISTER, AddressBody(address=address))
        assert frame.type == ControlType.OK, describe_frame(frame)


_SAMPLE_ADDRESS = Unicast("sample", 1).to_bytes()
_SAMPLE_GROUP = Anycast("sample").to_bytes()
# Bodies for the types whose bodies have required fields; the others are their defaults.
_SAMPLES: dict[ControlType, Body] = {
    ControlType.REGISTER: Register(server="sample", instance=1),
    ControlType.REGISTERED: AddressBody(address=_SAMPLE_ADDRESS),
    ControlType.UNREGISTER: AddressBody(address=_SAMPLE_ADDRESS),
    ControlType.JOIN: Membership(member=_SAMPLE_ADDRESS, group=_SAMPLE_GROUP),
    ControlType.LEAVE: Membership(member=_SAMPLE_ADDRESS, group=_SAMPLE_GROUP),
    ControlType.ERROR: Error(code=int(ErrorCode.UNAVAILABLE)),
    ControlType.TIMEOUT: DeliveryFailure(msg_id=1, src=_SAMPLE_ADDRESS, dst=_SAMPLE_ADDRESS),
    ControlType.NO_ROUTE: DeliveryFailure(msg_id=1, src=_SAMPLE_ADDRESS, dst=_SAMPLE_ADDRESS),
    ControlType.CLAIM: Claim(key=_SAMPLE_ADDRESS),
    ControlType.RELEASE: Claim(key=_SAMPLE_ADDRESS),
    ControlType.MOVE: Move(address="sample:1"),
    ControlType.ROUTED: Routed(seq=1),
    ControlType.MEMBERS: MembersRequest(group=_SAMPLE_GROUP),
    ControlType.GROUP_BIND: GroupBind(group=_SAMPLE_GROUP, key=b"k"),
    ControlType.GROUP_BOUND: GroupBound(member=_SAMPLE_ADDRESS),
    ControlType.GROUP_END: GroupEnd(group=_SAMPLE_GROUP, key=b"k"),
    ControlType.RELAYED: Relayed(type=int(ControlType.OK)),
    ControlType.STREAM: StreamRequest(op="list"),
    ControlType.REVOKED: Revoked(address=_SAMPLE_ADDRESS),
    ControlType.CHALLENGE: Challenge(nonce=bytes(NONCE_SIZE)),
    ControlType.AUTH: Auth(user="sample", token_proof=bytes(TOKEN_PROOF_SIZE)),
    ControlType.RAFT: RaftFrame(group="sample"),
    ControlType.SUBSCRIBE: SubjectInterest(member=_SAMPLE_ADDRESS, subject=b"sample"),
    ControlType.UNSUBSCRIBE: SubjectInterest(member=_SAMPLE_ADDRESS, subject=b"sample"),
}


def sample_body(type_: ControlType) -> Body:
    """A valid body for a control frame of ``type_`` (one a receiver decodes)."""
    return _SAMPLES.get(type_) or BODY_TYPES[type_]()


def describe_frame(frame: Frame) -> str:
    if isinstance(frame, DataFrame):
        return f"DATA(flags={frame.flags:#x}, msg_id={frame.msg_id}, payload={frame.payload!r})"
    try:
        name = ControlType(frame.type).name
    except ValueError:
        name = f"type {frame.type}"
    return f"{name}#{frame.correlation} {frame.body!r}"


def decode_all(data: bytes | bytearray) -> list[Frame]:
    """Every frame in ``data``, which must end on a frame boundary."""
    decoder = FrameDecoder()
    decoder.feed(data)
    frames: list[Frame] = []
    while (frame := decoder.next_frame()) is not None:
        frames.append(frame)
    assert decoder.buffered == 0, f"{decoder.buffered} bytes of a partial frame"
    return frames
