"""The HELLO / WELCOME handshake as a sans-IO state machine: frames in, events out,
bytes to send out.

Like the codec beside it, this module does no I/O: no sockets, no asyncio, no
clock, no callbacks. The caller reads bytes, decodes them into frames
(``FrameDecoder``), hands the handshake's frames to ``receive`` and writes the
bytes that ``hello``, ``welcome`` and ``refuse`` return. Bytes that arrived after
the handshake frame stay in the caller's decoder: the handshake never sees them.

Rules it keeps:

1. The first frame on a link is a HELLO, from the side that dialled. The
   accepting side refuses anything else with ``NOT_HANDSHAKEN`` (fatal).
2. A HELLO is checked in full before anything is sent back: its protocol
   version (``UNSUPPORTED_VERSION``), its role (``PROTOCOL_ERROR`` for one this
   side does not know) and every integer the accepting side uses (``max_frame``
   >= 0, ``slot`` 0..65535, ``tag`` 0..2**32-1; ``PROTOCOL_ERROR``). A frame
   that breaks a rule raises ``FrameError`` carrying the code to report; the
   link is then CLOSED.
3. The accepting side decides (its capacity, duplicate links, names: none of
   that is the handshake's business) and answers with ``welcome`` or
   ``refuse``. WELCOME carries the HELLO's correlation; a refusal is an ERROR
   with correlation 0, as every ERROR before a close is (docs/protocol.md §6).
4. The dialling side takes exactly one answer: a WELCOME that answers its
   HELLO (same correlation, protocol 1, integers in range) opens the link; an
   ERROR, or a BYE from a broker that is stopping, refuses it; any other frame
   is a ``PROTOCOL_ERROR``.
5. A second HELLO on an open link is refused with ``ALREADY_HANDSHAKEN``, which
   is not fatal: the link stays OPEN.
6. Calling a method in a state that does not allow it raises
   ``HandshakeStateError``: a bug in the caller, never a peer's doing.

Transitions (``HandshakeState``)::

    accepting side (AcceptingHandshake)
      AWAIT_HELLO --receive(a valid HELLO)--------> DECIDING   HelloReceived
      AWAIT_HELLO --receive(anything else)--------> CLOSED     FrameError
      DECIDING    --welcome(body)-----------------> OPEN       the WELCOME frame
      DECIDING    --refuse(code, message)---------> CLOSED     the ERROR frame
      OPEN        --receive(HELLO)----------------> OPEN       FrameError(ALREADY_HANDSHAKEN)

    dialling side (DiallingHandshake)
      IDLE          --hello()---------------------> AWAIT_WELCOME  the HELLO frame
      AWAIT_WELCOME --receive(a valid WELCOME)----> OPEN           Welcomed
      AWAIT_WELCOME --receive(ERROR or BYE)-------> CLOSED         HelloRefused
      AWAIT_WELCOME --receive(anything else)------> CLOSED         FrameError

Every other (state, call) pair raises ``HandshakeStateError``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from meshbus.protocol.codec import ControlFrame, Frame, FrameError, describe, encode_control
from meshbus.protocol.control import (
    ROLE_BROKER,
    ROLE_CONNECTOR,
    ROLE_OPERATOR,
    Bye,
    Error,
    Hello,
    Welcome,
)
from meshbus.protocol.layout import MIN_MAX_FRAME, PROTOCOL_VERSION, ControlType, ErrorCode

ROLES = frozenset({ROLE_CONNECTOR, ROLE_OPERATOR, ROLE_BROKER})

_U16_MAX = 0xFFFF
_U32_MAX = 0xFFFFFFFF


class HandshakeState(enum.Enum):
    IDLE = "idle"  # dialling side, before its HELLO
    AWAIT_HELLO = "await-hello"  # accepting side, before the first frame
    AWAIT_WELCOME = "await-welcome"  # dialling side, HELLO sent
    DECIDING = "deciding"  # accepting side, HELLO taken, WELCOME or refusal not sent yet
    OPEN = "open"
    CLOSED = "closed"


class HandshakeStateError(RuntimeError):
    """A handshake method called in a state that does not allow it: a bug in the caller,
    not something a peer did (a peer's mistakes are ``FrameError``)."""


@dataclass(frozen=True)
class HelloReceived:
    """The accepting side got a valid HELLO; answer it with ``welcome`` or ``refuse``."""

    hello: Hello
    correlation: int
    role: str  # ROLE_CONNECTOR, ROLE_OPERATOR or ROLE_BROKER


@dataclass(frozen=True)
class Welcomed:
    """The dialling side's HELLO was accepted: the link is open."""

    welcome: Welcome


@dataclass(frozen=True)
class HelloRefused:
    """The dialling side's HELLO was refused; the peer closes the link. With code
    ``REDIRECT``, ``redirect`` names a broker that takes connectors ("" if none)."""

    code: int
    message: str
    redirect: str


def negotiated_max_frame(ours: int, theirs: int) -> int:
    """The frame size limit of a link: the smaller of the two sides' limits, and never
    below ``MIN_MAX_FRAME`` (docs/protocol.md §2)."""
    return max(MIN_MAX_FRAME, min(ours, theirs))


class AcceptingHandshake:
    """The handshake of a link this side accepted (the broker's side)."""

    def __init__(self) -> None:
        self.state = HandshakeState.AWAIT_HELLO
        self._correlation = 0

    def receive(self, frame: Frame) -> HelloReceived:
        """The first frame of the link, or a HELLO on an open link (refused, not fatal)."""
        state = self.state
        if state is HandshakeState.OPEN:
            if isinstance(frame, ControlFrame) and frame.type == ControlType.HELLO:
                raise FrameError(
                    ErrorCode.ALREADY_HANDSHAKEN, "HELLO was already received on this link"
                )
            raise HandshakeStateError(
                f"the handshake is over; {_name(frame)} is not the handshake's to handle"
            )
        _expect(state, HandshakeState.AWAIT_HELLO, "receive")
        self.state = HandshakeState.CLOSED  # until the HELLO passes every check
        if not isinstance(frame, ControlFrame):
            raise FrameError(ErrorCode.NOT_HANDSHAKEN, "data frame before the HELLO handshake")
        if frame.type != ControlType.HELLO:
            raise FrameError(ErrorCode.NOT_HANDSHAKEN, "the first frame on a link must be HELLO")
        hello = frame.body
        if not isinstance(hello, Hello):
            raise FrameError(ErrorCode.PROTOCOL_ERROR, "HELLO without a HELLO body")
        _check_protocol(hello.protocol, "HELLO")
        if hello.role not in ROLES:
            raise FrameError(ErrorCode.PROTOCOL_ERROR, f"unknown HELLO role {hello.role!r}")
        _check_range("HELLO", "max_frame", hello.max_frame, 0, None)
        _check_range("HELLO", "slot", hello.slot, 0, _U16_MAX)
        _check_range("HELLO", "tag", hello.tag, 0, _U32_MAX)
        self._correlation = frame.correlation
        self.state = HandshakeState.DECIDING
        return HelloReceived(hello, frame.correlation, hello.role)

    def welcome(self, body: Welcome) -> bytes:
        """Accept the HELLO: the WELCOME frame to send, with the HELLO's correlation."""
        _expect(self.state, HandshakeState.DECIDING, "welcome")
        self.state = HandshakeState.OPEN
        return encode_control(ControlType.WELCOME, body, self._correlation)

    def refuse(self, code: ErrorCode, message: str, redirect: str = "") -> bytes:
        """Refuse the HELLO: the ERROR frame to send before closing the link."""
        _expect(self.state, HandshakeState.DECIDING, "refuse")
        self.state = HandshakeState.CLOSED
        return encode_control(
            ControlType.ERROR, Error(code=int(code), message=message, redirect=redirect)
        )


class DiallingHandshake:
    """The handshake of a link this side dialled: a connector, an operator, or a broker
    dialling a peer."""

    def __init__(self, hello: Hello, correlation: int = 1) -> None:
        self.state = HandshakeState.IDLE
        self._hello = hello
        self._correlation = correlation

    def hello(self) -> bytes:
        """The HELLO frame to send first."""
        _expect(self.state, HandshakeState.IDLE, "hello")
        self.state = HandshakeState.AWAIT_WELCOME
        return encode_control(ControlType.HELLO, self._hello, self._correlation)

    def receive(self, frame: Frame) -> Welcomed | HelloRefused:
        """The answer to the HELLO."""
        _expect(self.state, HandshakeState.AWAIT_WELCOME, "receive")
        self.state = HandshakeState.CLOSED  # until the answer passes every check
        if isinstance(frame, ControlFrame):
            body = frame.body
            if frame.type == ControlType.ERROR and isinstance(body, Error):
                return HelloRefused(body.code, body.message, body.redirect)
            if frame.type == ControlType.BYE and isinstance(body, Bye):
                return HelloRefused(
                    ErrorCode.SHUTTING_DOWN, f"the broker said goodbye: {body.reason}", ""
                )
            if frame.type == ControlType.WELCOME and isinstance(body, Welcome):
                self._check_welcome(frame.correlation, body)
                self.state = HandshakeState.OPEN
                return Welcomed(body)
        raise FrameError(ErrorCode.PROTOCOL_ERROR, f"expected WELCOME, got {_name(frame)}")

    def _check_welcome(self, correlation: int, welcome: Welcome) -> None:
        if correlation != self._correlation:
            raise FrameError(
                ErrorCode.PROTOCOL_ERROR,
                f"WELCOME with correlation {correlation} does not answer the HELLO "
                f"(correlation {self._correlation})",
            )
        _check_protocol(welcome.protocol, "WELCOME")
        # The accepting side never answers with less than the smallest limit (rule 2 of
        # docs/protocol.md §2); a smaller one would leave this side unable to send.
        _check_range("WELCOME", "max_frame", welcome.max_frame, MIN_MAX_FRAME, None)
        _check_range("WELCOME", "slot", welcome.slot, 0, _U16_MAX)
        _check_range("WELCOME", "tag", welcome.tag, 0, _U32_MAX)
        _check_range("WELCOME", "trace_every", welcome.trace_every, 0, _U32_MAX)
        for info in welcome.brokers:
            _check_range("WELCOME", "brokers.slot", info.slot, 0, _U16_MAX)
            _check_range("WELCOME", "brokers.connectors", info.connectors, 0, _U32_MAX)
            _check_range("WELCOME", "brokers.capacity", info.capacity, 0, _U32_MAX)


def _expect(state: HandshakeState, wanted: HandshakeState, call: str) -> None:
    if state is not wanted:
        raise HandshakeStateError(
            f"{call}() needs the handshake in state {wanted.name}; it is {state.name}"
        )


def _check_protocol(protocol: int, what: str) -> None:
    if protocol != PROTOCOL_VERSION:
        raise FrameError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"the peer's {what} speaks protocol {protocol}; this side speaks {PROTOCOL_VERSION}",
        )


def _check_range(what: str, field: str, value: int, low: int, high: int | None) -> None:
    if value < low or (high is not None and value > high):
        bounds = f"{low}..{high}" if high is not None else f"at least {low}"
        raise FrameError(
            ErrorCode.PROTOCOL_ERROR, f"{what} {field} {value} is out of range ({bounds})"
        )


def _name(frame: Frame) -> str:
    if isinstance(frame, ControlFrame):
        return describe(frame.type)
    return "a data frame"
