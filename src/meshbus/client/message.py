"""A message as a service receives it: a value, with the one way back to its sender.

``Message`` is what ``Service.recv`` returns and listeners get; the inbound dispatcher
(meshbus.client.inbound) makes them. It knows of the mailbox that received it only as
a ``Replier``: what ``reply`` answers a request through.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Protocol, TypeVar

from meshbus.address import Address
from meshbus.client import payloads
from meshbus.errors import MeshbusError
from meshbus.protocol.codec import BytesLike
from meshbus.protocol.ext import Ext
from meshbus.protocol.headers import decode_headers, encode_headers
from meshbus.protocol.layout import FLAG_REQUEST


class Replier(Protocol):
    """Where a request's answer goes out from: the mailbox of the service that received it
    (meshbus.client.mailboxes.Mailbox)."""

    async def respond(
        self, requester: bytes, msg_id: int, payload: BytesLike, headers: bytes
    ) -> None: ...

    def respond_nowait(
        self, requester: bytes, msg_id: int, payload: BytesLike, headers: bytes
    ) -> None: ...


_NO_EXT: Final = Ext()
T = TypeVar("T")


class Message:
    """A message as a service receives it: ``payload`` (bytes), its sender's ``msg_id``
    (what the sender's ``send`` returned), the frame's ``flags`` (docs/protocol.md).

    ``priority`` is the sender's; ``group`` and ``final`` are set on the messages of a
    message group, and ``group_reassigned`` on the first one a member receives of a group
    that was held by another member before (that member died or left): the receiver
    should recover the group's state before it handles the message."""

    __slots__ = (
        "_dst",
        "_ext",
        "_mailbox",
        "_src",
        "flags",
        "group_reassigned",
        "msg_id",
        "payload",
    )

    def __init__(
        self,
        src: bytes,
        dst: bytes,
        payload: bytes,
        msg_id: int,
        flags: int,
        mailbox: Replier | None,
        ext: Ext = _NO_EXT,
        group_reassigned: bool = False,
    ) -> None:
        self._src = src
        self._dst = ext.origin or dst
        self.payload = payload
        self.msg_id = msg_id
        self.flags = flags
        self._mailbox = mailbox
        self._ext = ext
        self.group_reassigned = group_reassigned

    @property
    def priority(self) -> int:
        return self._ext.priority

    @property
    def group(self) -> str | None:
        """The message group's id, or None for a message outside any group."""
        return self._ext.group.decode() if self._ext.group else None

    @property
    def subject(self) -> str | None:
        """The subject it was published on, for a message a subject subscription of the
        service got (``Service.subscribe``); None for any other."""
        subject = self._ext.subject
        return subject.decode("utf-8", "surrogateescape") if subject else None

    @property
    def final(self) -> bool:
        """The last message of its group."""
        return self._ext.final

    def json(self) -> Any:
        """The payload as JSON (dicts, lists, str, numbers, bools, None);
        ``meshbus.InvalidPayload`` if it is not JSON."""
        return payloads.decode(self.payload)

    def decode(self, type_: type[T]) -> T:
        """The payload as JSON, validated into ``type_``: a msgspec Struct, a dataclass,
        a TypedDict, ``list[int]``...; ``meshbus.InvalidPayload`` says what did not fit."""
        return payloads.decode(self.payload, type_)

    @property
    def headers(self) -> dict[str, str]:
        """The headers the sender gave (``send(..., headers=...)``); empty when none.
        ``meshbus.ProtocolError`` if the sender's header block is malformed."""
        return decode_headers(self._ext.headers)

    @property
    def src(self) -> Address:
        """The sending service's unicast address."""
        return Address.from_bytes(self._src)

    @property
    def dst(self) -> Address:
        """The address the message was sent to (a group address for group sends)."""
        return Address.from_bytes(self._dst)

    @property
    def is_request(self) -> bool:
        """True when the sender waits for ``reply``."""
        return bool(self.flags & FLAG_REQUEST)

    async def reply(
        self,
        payload: BytesLike | None = None,
        *,
        json: object = payloads.NO_JSON,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Answer a request with ``payload`` (or ``json=value``, and ``headers``, as
        ``Service.send`` takes them). The response comes from the service that received
        the request. It suspends only while the link's write buffer is full or the
        connector fails over."""
        replier = self._replier("reply")
        if payload is None or json is not payloads.NO_JSON:
            payload = payloads.body(payload, json)
        await replier.respond(self._src, self.msg_id, payload, encode_headers(headers))

    def reply_nowait(
        self,
        payload: BytesLike | None = None,
        *,
        json: object = payloads.NO_JSON,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """``reply`` without suspending, from a listener or for a batch: the responses
        written in one loop turn leave in one socket write. Raises ``meshbus.WouldBlock``
        (nothing sent) where ``reply`` would wait; ``await svc.flush()`` waits that out."""
        replier = self._replier("reply_nowait")
        if payload is None or json is not payloads.NO_JSON:
            payload = payloads.body(payload, json)
        replier.respond_nowait(self._src, self.msg_id, payload, encode_headers(headers))

    def _replier(self, call: str) -> Replier:
        if not self.is_request:
            raise MeshbusError(f"{call}() needs a request; this message was a plain send")
        if self._mailbox is None:
            raise MeshbusError("this message was not received by a service and cannot be answered")
        return self._mailbox

    def __repr__(self) -> str:
        kind = "request" if self.is_request else "message"
        return f"<{kind} {self.src} -> {self.dst} {len(self.payload)} bytes>"
