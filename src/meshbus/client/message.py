"""A message as a service receives it: a value, with the one way back to its sender.

``Message`` is what ``Service.recv`` returns and listeners get; the inbound dispatcher
(meshbus.client.inbound) makes them. It knows of the mailbox that received it only as
a ``Replier``: what ``reply`` answers a request through.
"""

from __future__ import annotations

from typing import Final, Protocol

from meshbus.address import Address
from meshbus.errors import MeshbusError
from meshbus.protocol.codec import BytesLike, DataFrame
from meshbus.protocol.ext import Ext
from meshbus.protocol.layout import FLAG_REQUEST


class Replier(Protocol):
    """Where a request's answer goes out from: the mailbox of the service that received it
    (meshbus.client.mailboxes.Mailbox)."""

    async def respond(self, requester: bytes, msg_id: int, payload: BytesLike) -> None: ...

    def respond_nowait(self, requester: bytes, msg_id: int, payload: BytesLike) -> None: ...


_NO_EXT: Final = Ext()


class Message:
    """A message as a service receives it.

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

    @classmethod
    def of(cls, frame: DataFrame, mailbox: Replier, ext: Ext, reassigned: bool) -> Message:
        return cls(
            frame.src,
            frame.dst,
            frame.payload,
            frame.msg_id,
            frame.flags,
            mailbox,
            ext,
            reassigned,
        )

    @property
    def priority(self) -> int:
        return self._ext.priority

    @property
    def group(self) -> str | None:
        """The message group's id, or None for a message outside any group."""
        return self._ext.group.decode() if self._ext.group else None

    @property
    def final(self) -> bool:
        """The last message of its group."""
        return self._ext.final

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

    async def reply(self, payload: BytesLike) -> None:
        """Answer a request. The response comes from the service that received the request.
        It suspends only while the link's write buffer is full or the connector fails over."""
        await self._replier("reply").respond(self._src, self.msg_id, payload)

    def reply_nowait(self, payload: BytesLike) -> None:
        """``reply`` without suspending, from a listener or for a batch: the responses
        written in one loop turn leave in one socket write. Raises ``meshbus.WouldBlock``
        (nothing sent) where ``reply`` would wait; ``await svc.flush()`` waits that out."""
        self._replier("reply_nowait").respond_nowait(self._src, self.msg_id, payload)

    def _replier(self, call: str) -> Replier:
        if not self.is_request:
            raise MeshbusError(f"{call}() needs a request; this message was a plain send")
        if self._mailbox is None:
            raise MeshbusError("this message was not received by a service and cannot be answered")
        return self._mailbox

    def __repr__(self) -> str:
        kind = "request" if self.is_request else "message"
        return f"<{kind} {self.src} -> {self.dst} {len(self.payload)} bytes>"
