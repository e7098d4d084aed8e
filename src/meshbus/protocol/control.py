"""Bodies of control frames (MRCMP): one msgpack map per type.

Bodies are maps, not arrays, and decoders ignore fields they do not know, so a
newer peer can add fields without breaking an older one; a field an older peer
does not send takes its default. Addresses travel as their 16 raw bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from meshbus.protocol.layout import DEFAULT_MAX_FRAME, PROTOCOL_VERSION, ControlType


class Body(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Base of control bodies."""


class Hello(Body):
    """Connector -> broker, first frame on a link."""

    protocol: int = PROTOCOL_VERSION
    role: str = "connector"
    name: str = ""
    max_frame: int = DEFAULT_MAX_FRAME


class Welcome(Body):
    """Broker -> connector, the answer to HELLO."""

    protocol: int = PROTOCOL_VERSION
    broker: str = ""
    slot: int = 1
    max_frame: int = DEFAULT_MAX_FRAME


class Register(Body):
    """Register a service: ``instance`` 0 asks the broker for a dynamic id."""

    server: str
    instance: int = 0


class AddressBody(Body):
    """A body that names one address (REGISTERED, UNREGISTER)."""

    address: bytes


class Membership(Body):
    """JOIN / LEAVE: ``member`` (a unicast the link owns) joins or leaves ``group``."""

    member: bytes
    group: bytes


class Empty(Body):
    """OK, STAT, PING, PONG."""


class Error(Body):
    code: int
    message: str = ""


class DeliveryFailure(Body):
    """TIMEOUT / NO_ROUTE: the request (or notified send) ``msg_id`` from ``src`` failed."""

    msg_id: int
    src: bytes
    dst: bytes
    reason: str = ""  # why, when it is not the obvious one (e.g. a frame too large)


class Stats(Body):
    data: dict[str, Any] = msgspec.field(default_factory=dict)


class Bye(Body):
    reason: str = ""


BODY_TYPES: dict[ControlType, type[Body]] = {
    ControlType.HELLO: Hello,
    ControlType.WELCOME: Welcome,
    ControlType.REGISTER: Register,
    ControlType.REGISTERED: AddressBody,
    ControlType.UNREGISTER: AddressBody,
    ControlType.JOIN: Membership,
    ControlType.LEAVE: Membership,
    ControlType.OK: Empty,
    ControlType.ERROR: Error,
    ControlType.TIMEOUT: DeliveryFailure,
    ControlType.NO_ROUTE: DeliveryFailure,
    ControlType.STAT: Empty,
    ControlType.STATS: Stats,
    ControlType.PING: Empty,
    ControlType.PONG: Empty,
    ControlType.BYE: Bye,
}

DECODERS: dict[int, msgspec.msgpack.Decoder[Any]] = {
    int(t): msgspec.msgpack.Decoder(cls) for t, cls in BODY_TYPES.items()
}
ENCODER = msgspec.msgpack.Encoder()
