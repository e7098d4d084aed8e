"""Sans-IO codec: bytes in, frames out; frames in, bytes out. No sockets here.

Use ``FrameDecoder``: ``feed(data)``, then ``frames()`` for every complete frame, or
``next_frame()`` until it returns ``None`` (it needs more bytes). Any violation
raises a ``ProtocolError`` whose ``code`` says which rule broke; after that the
decoder is poisoned, because a byte stream that lost its framing cannot be trusted
again.

``frame_extent`` is the one place that checks a frame's prefix; the decoder and
the broker's hot path both call it, so they accept exactly the same frames. (The
one-pass ``frames`` takes a well-formed data frame without that call, by the same
rules; whatever does not pass them goes through ``frame_extent``.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Final

import msgspec

from meshbus.errors import FrameTooLarge, InvalidArgument, ProtocolError
from meshbus.protocol.control import DECODERS, ENCODER, Body
from meshbus.protocol.layout import (
    CONTROL_HEADER,
    CONTROL_HEADER_SIZE,
    DATA_HEADER,
    DATA_HEADER_SIZE,
    DEFAULT_MAX_FRAME,
    KIND_CONTROL,
    KIND_DATA,
    LENGTH_SIZE,
    PREFIX,
    PROTOCOL_VERSION,
    ControlType,
    ErrorCode,
)

# Final: compiled (mypyc), a module's Final names are C statics, its other globals a
# dictionary look-up at every use.
Buffer = bytes | bytearray | memoryview
# length, kind, version, flags, hops, dst, src, link tag, msg id, response for, timeout
_DataHeader = tuple[int, int, int, int, int, bytes, bytes, int, int, int, int]

_MIN_SIZE: Final = {KIND_DATA: DATA_HEADER_SIZE, KIND_CONTROL: CONTROL_HEADER_SIZE}
_NEVER: Final = 1 << 40  # larger than any frame: an unknown kind never passes the fast check
_PREFIX_SIZE: Final = 6
# Typed as what the layouts hold: compiled, the fields unpack without a look at each.
_unpack_prefix: Final[Callable[[Buffer, int], tuple[int, int, int]]] = PREFIX.unpack_from
_unpack_data: Final[Callable[[Buffer, int], _DataHeader]] = DATA_HEADER.unpack_from
_REQUEST_AND_RESPONSE: Final = 0x03  # a data frame's flags may not have both (check_data_flags)
assert PREFIX.size == _PREFIX_SIZE


class FrameError(ProtocolError):
    """A frame broke the wire rules; ``code`` is the ErrorCode to report to the peer."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class OversizedFrame(FrameTooLarge):
    """FrameTooLarge raised while decoding; carries the wire code like FrameError."""

    # A class attribute, declared one: compiled (mypyc), an undeclared one is an
    # instance attribute that this class's inherited __init__ never sets.
    code: ClassVar[ErrorCode] = ErrorCode.FRAME_TOO_LARGE


@dataclass(slots=True, init=False)
class DataFrame:
    """An MRMSG frame. Addresses are raw 16-byte values; ``meshbus.Address`` decodes them."""

    dst: bytes
    src: bytes
    payload: bytes
    msg_id: int
    response_for: int
    flags: int
    hops: int
    link_tag: int
    timeout_ms: int

    # Written out, not generated: compiled (mypyc), the dataclass's generated __init__
    # would stay interpreted, and one frame is made for every message received.
    def __init__(
        self,
        dst: bytes,
        src: bytes,
        payload: bytes,
        msg_id: int = 0,
        response_for: int = 0,
        flags: int = 0,
        hops: int = 0,
        link_tag: int = 0,
        timeout_ms: int = 0,
    ) -> None:
        self.dst = dst
        self.src = src
        self.payload = payload
        self.msg_id = msg_id
        self.response_for = response_for
        self.flags = flags
        self.hops = hops
        self.link_tag = link_tag
        self.timeout_ms = timeout_ms


@dataclass(slots=True)
class ControlFrame:
    """An MRCMP frame. ``body`` is None for a type this codec does not know."""

    type: int
    body: Body | None
    correlation: int = 0


Frame = DataFrame | ControlFrame


def frame_extent(buf: bytes | bytearray | memoryview, pos: int, end: int, max_frame: int) -> int:
    """Size of the complete frame at ``buf[pos:end]``; 0 if more bytes are needed.

    Raises FrameError (unknown kind, unsupported version, impossible length) or
    OversizedFrame as soon as the prefix shows it, without waiting for the body.
    """
    avail = end - pos
    if avail >= _PREFIX_SIZE:
        # The common case in one C call; anything unusual is sorted out below.
        length, kind, version = _unpack_prefix(buf, pos)
        total = length + LENGTH_SIZE
        if (
            total <= max_frame
            and version == PROTOCOL_VERSION
            and total >= _MIN_SIZE.get(kind, _NEVER)
        ):
            return total if avail >= total else 0
    elif avail < LENGTH_SIZE:
        return 0
    return _check_prefix(buf, pos, avail, max_frame)


def _check_prefix(buf: bytes | bytearray | memoryview, pos: int, avail: int, max_frame: int) -> int:
    total = int.from_bytes(buf[pos : pos + LENGTH_SIZE], "big") + LENGTH_SIZE
    if total > max_frame:
        raise OversizedFrame(total, max_frame)
    if avail < _PREFIX_SIZE:
        return 0
    kind = buf[pos + 4]
    minimum = _MIN_SIZE.get(kind)
    if minimum is None:
        raise FrameError(
            ErrorCode.UNKNOWN_KIND, f"unknown frame kind {kind} (1 = data, 2 = control)"
        )
    version = buf[pos + 5]
    if version != PROTOCOL_VERSION:
        raise FrameError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"unsupported protocol version {version}; this side speaks {PROTOCOL_VERSION}",
        )
    raise FrameError(
        ErrorCode.PROTOCOL_ERROR,
        f"frame of kind {kind} is {total} bytes, shorter than its {minimum}-byte header",
    )


def check_data_flags(flags: int) -> None:
    """Reject reserved flag bits and contradictory combinations."""
    if flags & _REQUEST_AND_RESPONSE == _REQUEST_AND_RESPONSE:
        raise FrameError(ErrorCode.PROTOCOL_ERROR, "a frame cannot be both REQUEST and RESPONSE")


def encode_data(
    dst: bytes,
    src: bytes,
    payload: BytesLike,
    *,
    msg_id: int = 0,
    response_for: int = 0,
    flags: int = 0,
    hops: int = 0,
    link_tag: int = 0,
    timeout_ms: int = 0,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> bytes:
    """Encode one data frame. Raises FrameTooLarge instead of sending what the peer must
    refuse, and InvalidArgument for a payload that is not bytes-like."""
    if type(payload) is not bytes:
        payload = payload_bytes(payload)
    if len(dst) != 16 or len(src) != 16:
        raise ValueError(f"addresses are 16 bytes; got dst of {len(dst)}, src of {len(src)}")
    total = DATA_HEADER_SIZE + len(payload)
    if total > max_frame:
        raise FrameTooLarge(total, max_frame)
    header = DATA_HEADER.pack(
        total - LENGTH_SIZE,
        KIND_DATA,
        PROTOCOL_VERSION,
        flags,
        hops,
        dst,
        src,
        link_tag,
        msg_id,
        response_for,
        timeout_ms,
    )
    return header + payload


# What a payload may be (``payload_bytes``): what the buffer protocol gives as bytes.
BytesLike = bytes | bytearray | memoryview


def payload_bytes(payload: object) -> bytes:
    """``payload`` as the bytes a frame carries: any bytes-like object (a memoryview by its
    bytes, whatever its item size), never text or a number."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload)
    hint = ": encode the text first, e.g. text.encode()" if isinstance(payload, str) else ""
    raise InvalidArgument(
        f"a payload is bytes, a bytearray or a memoryview, not {type(payload).__name__}{hint}"
    )


def encode_control(
    type_: ControlType, body: Body, correlation: int = 0, *, max_frame: int = DEFAULT_MAX_FRAME
) -> bytes:
    return encode_control_raw(int(type_), ENCODER.encode(body), correlation, max_frame=max_frame)


def encode_control_raw(
    type_: int, raw: bytes, correlation: int = 0, *, max_frame: int | None = None
) -> bytes:
    """A control frame around an already encoded body (one relayed from a peer, or one a
    client checked); with ``max_frame``, FrameTooLarge past it."""
    total = CONTROL_HEADER_SIZE + len(raw)
    if max_frame is not None and total > max_frame:
        raise FrameTooLarge(total, max_frame)
    header = CONTROL_HEADER.pack(
        total - LENGTH_SIZE, KIND_CONTROL, PROTOCOL_VERSION, type_, correlation
    )
    return header + raw


def decode_frame(frame: bytes | bytearray | memoryview) -> Frame:
    """Decode exactly one complete frame (as delimited by ``frame_extent``)."""
    kind = frame[4]
    if kind == KIND_DATA:
        (_, _, _, flags, hops, dst, src, tag, msg_id, resp, timeout_ms) = DATA_HEADER.unpack_from(
            frame
        )
        check_data_flags(flags)
        return DataFrame(
            dst=dst,
            src=src,
            payload=bytes(frame[DATA_HEADER_SIZE:]),
            msg_id=msg_id,
            response_for=resp,
            flags=flags,
            hops=hops,
            link_tag=tag,
            timeout_ms=timeout_ms,
        )
    _, _, _, ctype, corr = CONTROL_HEADER.unpack_from(frame)
    return ControlFrame(ctype, decode_body(ctype, frame[CONTROL_HEADER_SIZE:]), corr)


_BODY_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)


def decode_body(ctype: int, raw: bytes | bytearray | memoryview) -> Body | None:
    decoder = DECODERS.get(ctype)
    if decoder is None:
        return None
    try:
        body: Body = decoder.decode(raw)
    # msgspec raises UnicodeDecodeError for a non-UTF-8 str and RecursionError for
    # absurd nesting (even inside fields it skips); both are the peer's malformed bytes.
    except (
        msgspec.DecodeError,
        msgspec.ValidationError,
        UnicodeDecodeError,
        RecursionError,
    ) as exc:
        name = ControlType(ctype).name
        raise FrameError(ErrorCode.PROTOCOL_ERROR, f"malformed {name} body: {exc}") from exc
    return body


class FrameDecoder:
    """Incremental decoder: ``feed`` bytes, then take the frames -- all the complete ones
    at once with ``frames`` (what a link does with each read), or one by one with
    ``next_frame``."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._pos = 0
        self._error: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        return len(self._buf) - self._pos

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._error is not None:
            raise self._error
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def frames(self) -> list[Frame]:
        """Every complete frame buffered, decoded in one pass ([] when more bytes are
        needed). A frame that breaks the rules ends the pass: the frames before it are
        returned, and the next call raises its ProtocolError."""
        if self._error is not None:
            raise self._error
        # One copy of what is buffered: the frames' payloads are slices of it, and the
        # buffer stays resizable for feed() (a memoryview on it would pin it).
        data = bytes(self._buf[self._pos :]) if self._pos else bytes(self._buf)
        end = len(data)
        max_frame = self.max_frame
        frames: list[Frame] = []
        pos = 0
        try:
            while True:
                # A data frame that needs no checking beyond its header's: decoded here, the
                # common case without a call; anything else goes the checked way below.
                if end - pos >= DATA_HEADER_SIZE:
                    (
                        length,
                        kind,
                        version,
                        flags,
                        hops,
                        dst,
                        src,
                        tag,
                        msg_id,
                        resp,
                        timeout_ms,
                    ) = _unpack_data(data, pos)
                    total = length + LENGTH_SIZE
                    if (
                        kind == KIND_DATA
                        and version == PROTOCOL_VERSION
                        and DATA_HEADER_SIZE <= total <= max_frame
                        and pos + total <= end
                        and flags & _REQUEST_AND_RESPONSE != _REQUEST_AND_RESPONSE
                    ):
                        frames.append(
                            DataFrame(
                                dst,
                                src,
                                data[pos + DATA_HEADER_SIZE : pos + total],
                                msg_id,
                                resp,
                                flags,
                                hops,
                                tag,
                                timeout_ms,
                            )
                        )
                        pos += total
                        continue
                total = frame_extent(data, pos, end, max_frame)
                if not total:
                    break
                frames.append(decode_frame(data[pos : pos + total]))
                pos += total
        except ProtocolError as exc:
            self._error = exc
            if not frames:
                raise
        del self._buf[: self._pos + pos]
        self._pos = 0
        return frames

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None when more bytes are needed."""
        if self._error is not None:
            raise self._error
        try:
            total = frame_extent(self._buf, self._pos, len(self._buf), self.max_frame)
            if not total:
                return None
            start = self._pos
            self._pos += total
            # A copy, not a memoryview: the buffer must stay resizable for feed().
            return decode_frame(bytes(self._buf[start : start + total]))
        except ProtocolError as exc:
            self._error = exc
            raise


def describe(type_: int) -> str:
    """A readable name for a control type, also for ones this side does not know."""
    try:
        return ControlType(type_).name
    except ValueError:
        return f"control type {type_}"
