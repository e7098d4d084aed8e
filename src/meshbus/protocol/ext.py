"""The extension block of a data frame (flag EXT): what a guarantee needs beyond the header.

The 64-byte header has room for routing and request/response only. Message
groups, priorities, reliable copies resent to one member of a group and stream
publish ids need a few more fields, and only some frames carry them, so they go
in front of the payload: ``u16 length`` then a msgpack array (``Ext``, trailing
defaults left out). A broker routes an EXT frame like any other -- it never
reads the block on the hot path; only a stream host reads it when it stores the
frame, and connectors when they deliver it.
"""

from __future__ import annotations

import msgspec

from meshbus.errors import ProtocolError

_LENGTH = 2


class Ext(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """``origin``: the group address a copy was sent to, when the frame itself went to one
    member (a reliable resend, an anycast send pinned to a member, a message group).
    ``group``/``seq``/``floor``/``final``: message-group ordering (client/delivery.py).
    ``publish_id``: a stream stores a frame with a given id once per dedupe window.
    ``priority``: the sender's priority, carried to the receiver."""

    origin: bytes = b""
    group: bytes = b""
    seq: int = 0
    floor: int = 0
    final: bool = False
    priority: int = 0
    publish_id: bytes = b""
    # Postina's subscribe_other/unsubscribe_other: "subscribe" or "unsubscribe" the
    # receiving service to the topic named by the payload; not delivered as a message.
    command: str = ""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Ext).decode


def wrap(ext: Ext, payload: bytes | bytearray | memoryview) -> bytes:
    """The frame payload: the block, then the application's payload."""
    block = _encode(ext)
    return len(block).to_bytes(_LENGTH, "big") + block + bytes(payload)


def split(payload: bytes | memoryview) -> tuple[Ext, bytes]:
    """The block and the application's payload of an EXT frame's payload."""
    if len(payload) < _LENGTH:
        raise ProtocolError("EXT frame without an extension block")
    size = int.from_bytes(payload[:_LENGTH], "big")
    end = _LENGTH + size
    if len(payload) < end:
        raise ProtocolError(f"extension block of {size} bytes overruns the payload")
    try:
        ext = _decode(payload[_LENGTH:end])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed extension block: {exc}") from None
    return ext, bytes(payload[end:])
