"""Byte layout of meshbus frames (docs/protocol.md has the full table).

Every frame starts with a 6-byte prefix: ``length`` (u32 BE, bytes after the
length field), ``kind`` (u8) and ``version`` (u8). Data frames (MRMSG) then
carry a fixed 58-byte rest of header; control frames (MRCMP) a 6-byte one.

The data header is ordered so that everything a broker needs to route a frame
sits in bytes 0..39 -- length, kind, version, flags, hops, destination, source
-- and is contiguous. That prefix is the *routing key*: two frames with equal
keys get the same routing decision (for unicast and multicast), so a broker can
forward a burst of them after checking the key once. The link tag follows at a
fixed offset, so a broker can stamp it in place.
"""

from __future__ import annotations

import struct
from enum import IntEnum, IntFlag
from typing import Final

PROTOCOL_VERSION: Final = 1
DEFAULT_MAX_FRAME: Final = 1024 * 1024
MIN_MAX_FRAME: Final = 256

KIND_DATA: Final = 1  # MRMSG
KIND_CONTROL: Final = 2  # MRCMP

LENGTH_SIZE: Final = 4
PREFIX = struct.Struct(">IBB")  # length, kind, version

# Data frame header (64 bytes).
DATA_HEADER = struct.Struct(">IBBBB16s16sIQQI")
DATA_HEADER_SIZE: Final = 64
OFF_FLAGS: Final = 6
OFF_HOPS: Final = 7
OFF_DST: Final = 8
OFF_SRC: Final = 24
OFF_LINK_TAG: Final = 40
OFF_MSG_ID: Final = 44
OFF_RESPONSE_FOR: Final = 52
OFF_TIMEOUT_MS: Final = 60
ROUTING_KEY_SIZE: Final = 40
# A frame crosses at most one broker-to-broker hop: connectors send hops 0, and a
# broker forwarding to a peer writes 1, which is the only value a peer accepts.
PEER_HOPS: Final = 1

# Control frame header (12 bytes).
CONTROL_HEADER = struct.Struct(">IBBHI")
CONTROL_HEADER_SIZE: Final = 12

assert DATA_HEADER.size == DATA_HEADER_SIZE
assert CONTROL_HEADER.size == CONTROL_HEADER_SIZE


class DataFlags(IntFlag):
    """Bits of the data frame's flags byte."""

    NONE = 0
    REQUEST = 0x01  # the sender waits for a response; timeout_ms is set
    RESPONSE = 0x02  # response_for names the request this answers
    ECHO = 0x04  # a group send is also delivered to the sender if it is a member
    NOTIFY_DROP = 0x08  # tell the sender with NO_ROUTE when a plain send finds no route
    # The payload starts with an extension block (protocol/ext.py): group, sequence,
    # priority, the original group address of a resent copy. Connectors read it; a broker
    # only when it stores the frame in a stream.
    EXT = 0x10
    RELIABLE = 0x20  # the receiving connector acknowledges it and drops duplicates
    ACK = 0x40  # acknowledges the RELIABLE frame ``response_for`` sent by ``dst``
    # A sampled frame whose hops are recorded (broker/observe/telemetry.py); its EXT block holds
    # the time its connector sent it.
    TRACE = 0x80


# The flags as plain ints, for the hot paths: a bit test on an int is cheaper than on an
# IntFlag member, and one set of names serves the broker and the client.
FLAG_REQUEST = int(DataFlags.REQUEST)
FLAG_RESPONSE = int(DataFlags.RESPONSE)
FLAG_ECHO = int(DataFlags.ECHO)
FLAG_NOTIFY_DROP = int(DataFlags.NOTIFY_DROP)
FLAG_EXT = int(DataFlags.EXT)
FLAG_RELIABLE = int(DataFlags.RELIABLE)
FLAG_ACK = int(DataFlags.ACK)
FLAG_TRACE = int(DataFlags.TRACE)


class ControlType(IntEnum):
    """Control frame types (MRCMP). New types get new numbers; numbers are never reused."""

    HELLO = 1
    WELCOME = 2
    REGISTER = 3
    REGISTERED = 4
    UNREGISTER = 5
    JOIN = 6
    LEAVE = 7
    OK = 8
    ERROR = 9
    TIMEOUT = 10
    NO_ROUTE = 11
    STAT = 12
    STATS = 13
    PING = 14
    PONG = 15
    BYE = 16
    BROKERS = 17  # broker -> connector, and broker <-> broker (gossip)
    ROUTES = 18  # broker <-> broker
    CLAIM = 19  # broker <-> broker; answered with OK or ERROR ADDRESS_IN_USE
    RELEASE = 20  # broker <-> broker
    LOAD = 21  # broker <-> broker; also the heartbeat
    READY = 22  # broker <-> broker
    DRAINING = 23  # broker <-> broker
    MOVE = 24  # broker -> connector
    DRAIN = 25  # connector (an operator) -> broker; answered with OK
    ROUTED = 26  # broker <-> broker: the ROUTES up to this sequence number are applied
    SYNCED = 27  # broker -> connector: the change answered with this correlation is mesh-wide
    MEMBERS = 28  # connector -> broker: the members of a group; answered with MEMBER_LIST
    MEMBER_LIST = 29
    GROUP_BIND = 30  # connector -> broker -> the group's home broker; answered with GROUP_BOUND
    GROUP_BOUND = 31
    GROUP_END = 32  # connector -> broker -> home: a message group ended (final message acked)
    GROUPS = 33  # broker <-> broker: group bindings (replicated to every broker)
    STREAM = 34  # connector -> broker (-> the stream's host): a stream request
    STREAM_REPLY = 35
    RELAYED = 36  # broker -> broker: the answer to a request relayed from the other broker
    WATCH = 37  # connector -> broker: tell me when services leave (LEFT)
    LEFT = 38  # broker -> connector: these services left the mesh
    TRACE = 39  # connector -> broker: a traced frame arrived (no answer)
    REVOKED = 40  # broker -> connector: an address of yours is another's now (after a split)
    # broker -> connector or operator, answering HELLO when the broker has users: prove who
    # you are (docs/security.md, "Authentication")
    CHALLENGE = 41
    AUTH = 42  # connector or operator -> broker: the answer to CHALLENGE
    RAFT = 43  # broker <-> broker: Raft messages of one replicated stream (no answer)
    # broker <-> broker: NATS messages for the receiver's NATS clients, delivered there and
    # never forwarded again (docs/nats.md, "Across the mesh")
    NATS_MSGS = 44
    # connector -> broker: a service subscribes to, or unsubscribes from, a subject pattern
    # (docs/nats.md, "NATS and meshbus services"); answered with OK, then SYNCED
    SUBSCRIBE = 45
    UNSUBSCRIBE = 46


class ErrorCode(IntEnum):
    """Codes carried by ERROR frames. The message next to it is for people."""

    PROTOCOL_ERROR = 1  # malformed frame or body
    FRAME_TOO_LARGE = 2
    UNKNOWN_KIND = 3
    UNSUPPORTED_VERSION = 4
    NOT_HANDSHAKEN = 5  # anything but HELLO before the handshake
    ALREADY_HANDSHAKEN = 6
    ADDRESS_NOT_OWNED = 7  # a data frame from a source the link did not register
    ADDRESS_IN_USE = 8
    INVALID_ADDRESS = 9
    # unregister/join/leave of an address the link does not own; a group bind/end as one
    NOT_REGISTERED = 10
    UNSUPPORTED_CONTROL = 11  # a control type this broker does not know (link stays open)
    INSTANCES_EXHAUSTED = 12
    SLOW_CONSUMER = 13
    SHUTTING_DOWN = 14
    REDIRECT = 15  # this broker takes no connector now (full, joining, draining); see redirect
    DUPLICATE_LINK = 16  # a second link between the same two brokers; the other one stays
    NAME_IN_USE = 17  # a broker of that name is already in the mesh
    NO_STREAM = 18  # no such stream (or consumer) in the mesh
    STREAM_ERROR = 19  # a stream request was refused (bad config, storage error)
    # Nothing here can serve the request until something changes: a message group whose
    # anycast group has no member, a STATS page never asked for; and (closing the link) a
    # broker cut off from most of the mesh. Asking again at once gets the same answer.
    UNAVAILABLE = 20
    # A limit of the broker (its message names the limit and its flag) was reached: the
    # request is refused and the link stays open (docs/architecture.md, the limits).
    LIMIT_EXCEEDED = 21
    # The AUTH did not prove a user of this broker (or never came): the link is closed. The
    # message says what to check without telling whether the user exists.
    AUTH_FAILED = 22
    # The broker takes only clients with a certificate (--tls-verify-clients), and this
    # link's TLS handshake showed none (docs/security.md, "TLS").
    CERTIFICATE_REQUIRED = 23
    # The link's user may not do this (docs/security.md, "Permissions"): a request refused,
    # or (as the ``code`` of NO_ROUTE) a data frame dropped; the link stays open.
    PERMISSION_DENIED = 24
    # The broker that decides cannot answer now -- out of reach behind a cut link, lost a
    # moment ago, re-linking after a stall, or gone before it answered -- and will soon:
    # the same request asked again shortly is answered. The client asks again itself.
    TRY_AGAIN = 25
    # A SUBSCRIBE or UNSUBSCRIBE naming no valid subject pattern or queue group; the link
    # stays open.
    INVALID_SUBJECT = 26
    # A replicated stream of that name exists already in the mesh (the meta group's
    # record: docs/raft.md, "The meta group"); the link stays open.
    STREAM_EXISTS = 27


# Errors after which the sender of the offending frame is disconnected.
FATAL_ERRORS = frozenset(
    {
        ErrorCode.PROTOCOL_ERROR,
        ErrorCode.FRAME_TOO_LARGE,
        ErrorCode.UNKNOWN_KIND,
        ErrorCode.UNSUPPORTED_VERSION,
        ErrorCode.NOT_HANDSHAKEN,
        ErrorCode.ADDRESS_NOT_OWNED,
        ErrorCode.SLOW_CONSUMER,
        ErrorCode.SHUTTING_DOWN,
        ErrorCode.REDIRECT,
        ErrorCode.DUPLICATE_LINK,
        ErrorCode.CERTIFICATE_REQUIRED,
        ErrorCode.NAME_IN_USE,
        ErrorCode.AUTH_FAILED,
    }
)
