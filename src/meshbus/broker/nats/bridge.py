"""The bridge between NATS subjects and meshbus addresses (docs/nats.md, "NATS and
meshbus services").

The mapping, one rule each way:

* **A NATS subject NAME is meshbus's ``multicast:NAME``**, where NAME can be a group
  name (at most 15 bytes of UTF-8, no NUL, no ``:``; see meshbus.address). A message a
  NATS client publishes on NAME reaches the members of ``multicast:NAME`` (sent from this
  bridge's address, ``nats:<id>``), its header block in the frame's extension block, byte
  for byte -- meshbus headers are NATS's format (meshbus.protocol.headers). A plain
  multicast a meshbus service sends reaches the NATS subscriptions matching NAME
  (wildcards and queue groups included), its headers as an HMSG's.
* **A NATS subject ``anycast.NAME`` is meshbus's ``anycast:NAME``**. A request -- a
  publish with a reply subject, ``nc.request(...)`` -- becomes a meshbus request to one
  member of the pool; its response is published on the reply subject. Without a reply
  subject it is a plain anycast send.

Both happen at the broker where the message entered the mesh, as everything does: the
NATS side of a meshbus multicast is matched here against the whole mesh's NATS interest
(the forwarder's ``multicast_tap``) and sent to each broker with interest once; a NATS
message goes into meshbus's routing here, one hop like a connector's frame. A peer never
bridges again.

What does not map: meshbus requests to a multicast (NATS subscribers see only plain
sends), reliable sends and message groups (NATS has no acks: a frame's RELIABLE and
group fields are not for NATS clients, who get the payload once), streams, unicast
addresses, NATS queue groups to meshbus (a queue group is NATS's pool; meshbus's is an
anycast group), and names that are no valid NATS subject (a group name with a blank) or
no group name (a subject longer than 15 bytes stays NATS's).

The bridge's endpoint is a member of nothing: the forwarder hands it a connector's
multicast only while some NATS client wants the group's name (``tap_for``), and the
responses to its requests (its pending entries name it). Whether a NATS client wants a
name is a routing decision's input, so each change of NATS interest in a pattern that
could match a group name touches the routing table (``interest_changed``).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass

from meshbus.address import CAST_ANYCAST, CAST_MULTICAST, GROUP_NAME_MAX
from meshbus.broker.core.endpoint import Endpoint, LinkRole
from meshbus.broker.core.outbox import Outbox
from meshbus.broker.core.pending import PendingTable
from meshbus.broker.core.reserved import BRIDGE_SERVER
from meshbus.broker.core.routing import RoutingTable
from meshbus.broker.core.subjects import is_valid_subject
from meshbus.errors import ProtocolError
from meshbus.protocol import ext
from meshbus.protocol.codec import decode_body, encode_data
from meshbus.protocol.control import OP_ADD, DeliveryFailure
from meshbus.protocol.headers import MAX_HEADER_BYTES
from meshbus.protocol.layout import (
    DATA_HEADER,
    FLAG_EXT,
    FLAG_REQUEST,
    FLAG_RESPONSE,
    KIND_DATA,
    LENGTH_SIZE,
    ControlType,
)
from meshbus.protocol.nats import Message, Publish

__all__ = ["ANYCAST_PREFIX", "BRIDGE_SERVER", "MeshbusBridge", "group_subject"]

log = logging.getLogger("meshbus.broker.nats")

# The server name of the bridge's address (11 bytes, NUL-padded, as a unicast's).
ANYCAST_PREFIX = b"anycast."
_unpack_header = DATA_HEADER.unpack_from
_HEADER_SIZE = DATA_HEADER.size
_CONTROL_TYPE = struct.Struct(">H")
FRAMES_BIGGER_THAN_ANY = 1 << 40
_GROUPS_CACHED = 1024


def group_subject(group: bytes) -> bytes:
    """The NATS subject of a group address: its name."""
    return group[1:].rstrip(b"\x00")


def _group_address(cast: int, name: bytes) -> bytes | None:
    """The address of group ``name`` (NATS subject bytes), or None when it is no group
    name: too long, NUL or ``:`` in it, not UTF-8."""
    if not name or len(name) > GROUP_NAME_MAX or b"\x00" in name or b":" in name:
        return None
    try:
        name.decode()
    except UnicodeDecodeError:
        return None
    return bytes((cast,)) + name + bytes(GROUP_NAME_MAX - len(name))


@dataclass
class BridgeStats:
    to_meshbus: int = 0  # NATS messages sent on to meshbus groups
    requests: int = 0  # of them, requests to an anycast pool
    responses: int = 0  # responses published to a NATS requester
    from_meshbus: int = 0  # meshbus multicasts handed to NATS clients
    dropped: int = 0  # frames for the bridge it could not take (a send to its address)
    headers_dropped: int = 0  # a header block past what a meshbus frame carries


class FrameSink(Endpoint):
    """Where the forwarder hands a part of this broker its frames -- the bridge, the
    services' subject publishes: no socket; the outbox gives it each read's frames as one
    block of bytes."""

    def __init__(self, name: str, receive: Callable[[bytes], None]) -> None:
        super().__init__(0, LinkRole.NATS, max_frame=FRAMES_BIGGER_THAN_ANY)
        self.name = name
        self._receive = receive

    def send(self, data: bytes | bytearray) -> None:
        self._receive(bytes(data))


class MeshbusBridge:
    """NATS messages to meshbus groups and back (module docstring)."""

    def __init__(
        self,
        *,
        routing: RoutingTable[Endpoint],
        pending: PendingTable[Endpoint],
        outbox: Outbox,
        match: Callable[[bytes], object],
        deliver: Callable[[Publish], int],
        flush: Callable[[], None],
        deadline: Callable[[int], float],
        announce: Callable[[int, bytes], None],
    ) -> None:
        """``match``: the subject table's (what a subject matches, truthy when anything
        does); ``deliver`` routes a message to
        the NATS clients of the mesh, ``flush`` writes what that queued for the clients
        here; ``deadline`` turns a timeout in ms (0: the broker's default) into a
        deadline for a request's pending entry; ``announce`` tells the peers of the
        bridge's address (a route operation)."""
        self._routing = routing
        self._pending = pending
        self._outbox = outbox
        self._match = match
        self._deliver = deliver
        self._flush = flush
        self._deadline = deadline
        self._announce = announce
        self.endpoint = FrameSink("nats", self._from_meshbus)
        self.address = b""
        self._replies: dict[int, bytes] = {}  # request msg_id -> the NATS reply subject
        self._next_id = 0
        # subject -> its group's address, None for no group: a publisher uses few subjects.
        self._groups: dict[bytes, bytes | None] = {}
        # Subjects whose messages reach no one in meshbus while the routing table stays
        # at _quiet_version -- no group, or no member of it -- so that the message of a
        # NATS-only subject takes no routing decision.
        self._quiet: set[bytes] = set()
        self._quiet_version = -1
        self.stats = BridgeStats()

    def source(self) -> bytes:
        """The bridge's address, the source of what it sends: taken the first time it
        sends (a dynamic id of this broker's, announced like a service), so a broker
        whose NATS clients never reach meshbus shows none; b"" before the broker has
        its slot."""
        if not self.address and self._routing.slot:
            self.address = self._routing.allocate_dynamic(BRIDGE_SERVER, self.endpoint)
            self._announce(OP_ADD, self.address)
        return self.address

    # -- what the routing decisions ask -------------------------------------------------

    def tap_for(self, group: bytes) -> Endpoint | None:
        """The forwarder's ``multicast_tap``: the bridge, when NATS clients anywhere want
        ``group``'s name."""
        subject = group_subject(group)
        if is_valid_subject(subject) and self._match(subject):
            return self.endpoint
        return None

    def interest_changed(self, pattern: bytes) -> None:
        """NATS interest in ``pattern`` came or went. A subject a pattern matches is at
        least as long as it, so a longer one than any group name changes no decision."""
        if len(pattern) <= GROUP_NAME_MAX:
            self._routing.touch()

    # -- NATS to meshbus -----------------------------------------------------------------

    def reaches(self, subject: bytes) -> bool:
        """Whether a NATS message on ``subject`` may go on to meshbus now. A False holds
        until the routing table changes: the subject maps to no group, to a multicast
        group without a member, or to an anycast pool that had none when last sent to.
        The router asks once for a run of messages on a subject (``from_nats`` then)."""
        if len(subject) > GROUP_NAME_MAX + len(ANYCAST_PREFIX):
            return False
        quiet = self._quiet
        if self._quiet_version != self._routing.version:
            quiet.clear()
            self._quiet_version = self._routing.version
        elif subject in quiet:
            return False
        group = self._group_of(subject)
        if group is None or (
            group[0] == CAST_MULTICAST
            and not self._routing.route_multicast(group, b"", self.endpoint, False)
        ):
            self._quiet_now(subject)
            return False
        return True

    def _group_of(self, subject: bytes) -> bytes | None:
        groups = self._groups
        group = groups.get(subject, b"")
        if group == b"":
            if len(groups) >= _GROUPS_CACHED:
                groups.clear()
            if subject.startswith(ANYCAST_PREFIX):
                group = _group_address(CAST_ANYCAST, subject[len(ANYCAST_PREFIX) :])
            else:
                group = _group_address(CAST_MULTICAST, subject)
            groups[subject] = group
        return group

    def from_nats(self, message: Message) -> int:
        """``message``, published by a NATS client here, to the meshbus group its subject
        maps to; how many links it went to (0: none, or no group)."""
        subject = message[0]
        if not self.reaches(subject):
            return 0
        group = self._group_of(subject)
        assert group is not None  # it reaches meshbus
        if group[0] == CAST_ANYCAST:
            return self._to_anycast(subject, group, message)
        targets = self._routing.route_multicast(group, b"", self.endpoint, False)
        if not self.source():
            return 0
        frame = self._frame(group, message, 0, 0)
        delivered = sum(self._outbox.deliver(target, frame) for target in targets)
        self.stats.to_meshbus += 1
        self._outbox.flush_soon()
        return delivered

    def _quiet_now(self, subject: bytes) -> None:
        if len(self._quiet) >= _GROUPS_CACHED:
            self._quiet.clear()
        self._quiet.add(subject)

    def _to_anycast(self, subject: bytes, group: bytes, message: Message) -> int:
        target = self._routing.route_anycast(group, b"", False)
        if target is None:
            self._quiet_now(subject)
            return 0
        if not self.source():
            return 0
        reply = message[1]
        if not reply:
            delivered = self._outbox.deliver(target, self._frame(group, message, 0, 0))
            self.stats.to_meshbus += delivered
            self._outbox.flush_soon()
            return int(delivered)
        self._next_id += 1
        msg_id = self._next_id
        via = target if target.is_peer else None
        expires = self._deadline(0)
        if not self._pending.add(
            self.address, msg_id, self.endpoint, expires, group, via, responders=(target,)
        ):
            return 0  # --max-requests waiting already: the requester hears no responders
        if not self._outbox.deliver(target, self._frame(group, message, msg_id, FLAG_REQUEST)):
            self._pending.resolve(self.address, msg_id)
            return 0
        self._replies[msg_id] = reply
        self.stats.to_meshbus += 1
        self.stats.requests += 1
        self._outbox.flush_soon()
        return 1

    def _frame(self, group: bytes, message: Message, msg_id: int, flags: int) -> bytes:
        _, _, header_size, data = message
        if header_size:
            if header_size <= MAX_HEADER_BYTES:
                block = ext.Ext(headers=data[:header_size])
                return encode_data(
                    group, self.address, ext.wrap(block, data[header_size:]),
                    msg_id=msg_id, flags=flags | FLAG_EXT, max_frame=FRAMES_BIGGER_THAN_ANY,
                )  # fmt: skip
            self.stats.headers_dropped += 1
            data = data[header_size:]
        return encode_data(
            group, self.address, data,
            msg_id=msg_id, flags=flags, max_frame=FRAMES_BIGGER_THAN_ANY,
        )  # fmt: skip

    # -- meshbus to NATS -----------------------------------------------------------------

    def _from_meshbus(self, data: bytes) -> None:
        """Frames routed to the bridge in one read: connectors' multicasts (the tap), the
        responses to its requests, and TIMEOUT or NO_ROUTE for them."""
        pos, end = 0, len(data)
        while pos < end:
            length = int.from_bytes(data[pos : pos + LENGTH_SIZE], "big")
            frame_end = pos + LENGTH_SIZE + length
            if data[pos + LENGTH_SIZE] == KIND_DATA:
                self._data_frame(data, pos, frame_end)
            else:
                self._control_frame(data[pos:frame_end])
            pos = frame_end
        self._flush()

    def _data_frame(self, data: bytes, pos: int, end: int) -> None:
        (_, _, _, flags, _, dst, _, _, _, response_for, _) = _unpack_header(data, pos)
        payload = data[pos + _HEADER_SIZE : end]
        header = b""
        if flags & FLAG_EXT:
            try:
                block, payload = ext.split(payload)
            except ProtocolError:
                self.stats.dropped += 1
                return
            header = block.headers
        if flags & FLAG_RESPONSE:
            subject = self._replies.pop(response_for, None)
            if subject is None:
                self.stats.dropped += 1
                return
            self.stats.responses += 1
        elif dst[0] == CAST_MULTICAST:
            subject = group_subject(dst)
            self.stats.from_meshbus += 1
        else:
            self.stats.dropped += 1  # a send to the bridge's own address
            return
        self._deliver(Publish(subject, b"", len(header), header + payload))

    def _control_frame(self, frame: bytes) -> None:
        """TIMEOUT or NO_ROUTE for a request: its NATS requester times out on its own."""
        (ctype,) = _CONTROL_TYPE.unpack_from(frame, 6)
        if ctype in (ControlType.TIMEOUT, ControlType.NO_ROUTE):
            body = decode_body(ctype, frame[12:])
            if isinstance(body, DeliveryFailure):
                self._replies.pop(body.msg_id, None)
