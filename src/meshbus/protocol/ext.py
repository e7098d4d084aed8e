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

import struct
from typing import Annotated

import msgspec

from meshbus.errors import ProtocolError
from meshbus.protocol.codec import encode_data, payload_bytes
from meshbus.protocol.layout import DataFlags

_LENGTH = 2


class Ext(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """``origin``: the group address a copy was sent to, when the frame itself went to one
    member (a reliable resend, an anycast send pinned to a member, a message group).
    ``group``/``seq``/``floor``/``final``: message-group ordering (client/delivery.py).
    ``publish_id``: a stream stores a frame with a given id once per dedupe window.
    ``priority``: the sender's priority, carried to the receiver. ``batch``: the
    payload is many rows (meshbus.protocol.batch). ``headers``: the message's header
    block (meshbus.protocol.headers). ``subject``: the subject it was published on."""

    origin: bytes = b""
    group: bytes = b""
    seq: int = 0
    floor: int = 0
    final: bool = False
    priority: int = 0
    publish_id: bytes = b""
    # Postina's subscribe_other/unsubscribe_other: "subscribe" or "unsubscribe" the
    # receiving service to the subject pattern that is the payload; not delivered as a
    # message.
    command: str = ""
    sent_at: float = 0.0  # with the TRACE flag: when the sending connector sent it
    # Not 0: the payload is a batch of rows in this format (meshbus.protocol.batch), each
    # delivered and stored as a message of its own.
    batch: Annotated[int, msgspec.Meta(ge=0, le=255)] = 0
    headers: bytes = b""
    # The subject a service published on (to the broker's SUBJECTS address), or a message
    # a service's subject subscription matched was published on (docs/nats.md).
    subject: bytes = b""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Ext).decode


# An ACK frame's payload: the acknowledged message ids, u64 each. One frame acknowledges
# every reliable frame one receiver got from one sender in one read: an ack per message
# would cost the sender's broker as much routing as the messages themselves.
ACKS_PER_FRAME = 8192


def ack_frames(acker: bytes, sender: bytes, msg_ids: list[int]) -> list[bytes]:
    """The ACK frames from ``acker`` to ``sender`` for ``msg_ids``."""
    return [
        encode_data(
            sender,
            acker,
            struct.pack(f">{len(chunk)}Q", *chunk),
            flags=DataFlags.ACK,
        )
        for chunk in (
            msg_ids[i : i + ACKS_PER_FRAME] for i in range(0, len(msg_ids), ACKS_PER_FRAME)
        )
    ]


def unpack_acks(payload: bytes) -> tuple[int, ...]:
    if len(payload) % 8:
        raise ProtocolError(f"ACK payload of {len(payload)} bytes is not a list of u64 ids")
    return struct.unpack(f">{len(payload) // 8}Q", payload)


def wrap(ext: Ext, payload: bytes | bytearray | memoryview) -> bytes:
    """The frame payload: the block, then the application's payload."""
    return prefix(ext) + payload_bytes(payload)


def prefix(ext: Ext) -> bytes:
    """What goes before the application's payload: the block's length and the block (a
    sender of many payloads with one block makes it once)."""
    block = _encode(ext)
    return len(block).to_bytes(_LENGTH, "big") + block


def split(payload: bytes | memoryview) -> tuple[Ext, bytes]:
    """The block and the application's payload of an EXT frame's payload."""
    ext, end = _block(payload)
    return ext, bytes(payload[end:])


def block_of(payload: bytes | memoryview) -> Ext:
    """The block of an EXT frame's payload, the application's payload left where it is."""
    return _block(payload)[0]


def _block(payload: bytes | memoryview) -> tuple[Ext, int]:
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
    return ext, end
