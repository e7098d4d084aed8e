"""The one place where a control frame meets its handler: a table from (link role,
control type) to a handler that takes ``(link, correlation, body)``.

Every control frame a broker reads goes through ``ControlDispatch.handle``. On a
link still handshaking, every frame goes to the handshake (meshbus.protocol.handshake,
sans-IO), which takes HELLO (or, on a link this broker dialled, WELCOME) and closes
the link on anything else. On an open link, the table decides: a frame its
link's role may not send -- a REGISTER from an operator, a ROUTES from a
connector -- finds no row and takes the one refusal path, an ERROR with code
UNSUPPORTED_CONTROL and the request's correlation; the link stays open.

Each row is registered with the body class of its type (``on``), the class the codec
decodes that type into (``BODY_TYPES``; ``on`` refuses any other), and its handler is
typed with that class, so mypy holds every handler to what the wire gives it. The one
check of a body's class at run time is here, in front of the permission check: a body of
another class is a PROTOCOL_ERROR that closes its link.

A handler that declines a request raises ``Refused``: it becomes an ERROR frame with
the request's correlation, and the link stays open.

This table is where permission checks belong: a (role, type) row decides who may
send what, and a check placed in front of a handler here covers every link of
that role. The checks of a link's user's permissions (meshbus.broker.security.permissions)
are here too, one per control type that needs one (``_CHECKS``): a frame its user
may not send is answered ERROR PERMISSION_DENIED, naming the permission, and the
link stays open. The types with no check -- PING, BYE, UNREGISTER, LEAVE, WATCH,
GROUP_END, TRACE -- act only on what the link already holds or hears of. Handlers
run on the event loop and never await (docs/architecture.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from meshbus.address import describe_address
from meshbus.broker.core.endpoint import LinkRole
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox
from meshbus.broker.security import permissions as keys
from meshbus.broker.security.permissions import Permissions
from meshbus.protocol.codec import ControlFrame, FrameError, describe
from meshbus.protocol.control import (
    BODY_TYPES,
    Body,
    Drain,
    Error,
    GroupBind,
    Membership,
    MembersRequest,
    Register,
    StatRequest,
    StreamRequest,
)
from meshbus.protocol.layout import ControlType, ErrorCode

log = logging.getLogger("meshbus.broker")

B = TypeVar("B", bound=Body)
# A handler of one control type: it gets that type's body class, and nothing wider.
Handler = Callable[[Link, int, B], None]
# Takes every frame of a link that is still handshaking.
HandshakeHandler = Callable[[Link, ControlFrame], None]


class Refused(Exception):
    """A request the broker declines; answered with a non-fatal ERROR frame."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


_ARTICLE = {
    LinkRole.CONNECTOR: "a connector",
    LinkRole.OPERATOR: "an operator's link",
    LinkRole.PEER: "a peer broker",
}


@dataclass(frozen=True, slots=True)
class _Check(Generic[B]):
    """The permission check of one control type, and the body class it reads."""

    body_class: type[B]
    denial: Callable[[Permissions, B], str]  # why the link's user may not ("" when it may)


@dataclass(frozen=True, slots=True)
class _Row(Generic[B]):
    """One (role, type) of the table: the body class of its type, the type's permission
    check (if it has one) and the handler, all three of the same class."""

    body_class: type[B]
    check: Callable[[Permissions, B], str] | None
    handler: Handler[B]

    def run(self, link: Link, ctype: int, correlation: int, body: Body) -> None:
        # The codec decodes each type into its class and ``on`` takes no other, so this
        # holds for every frame off the wire; a body handed in by other code that breaks
        # it is that link's error, not a crash.
        if not isinstance(body, self.body_class):
            raise FrameError(
                ErrorCode.PROTOCOL_ERROR,
                f"a {describe(ctype)} frame must carry a {self.body_class.__name__} body, "
                f"not a {type(body).__name__}",
            )
        permissions = link.permissions
        if permissions is not None and self.check is not None:
            denied = self.check(permissions, body)
            if denied:
                raise Refused(ErrorCode.PERMISSION_DENIED, denied)
        self.handler(link, correlation, body)


class ControlDispatch:
    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        # Each row's class is its own (``_Row[B]``); only ``on`` puts rows in.
        self._table: dict[tuple[LinkRole, int], _Row[Any]] = {}
        self._handshake: HandshakeHandler | None = None
        self.refused_frames = 0  # frames whose role may not send them

    def handshake_to(self, handshake: HandshakeHandler) -> None:
        """Where the frames of a link still handshaking go (made once the parts it names
        exist: meshbus.broker.server)."""
        self._handshake = handshake

    def on(
        self, role: LinkRole, ctype: ControlType, body_class: type[B], handler: Handler[B]
    ) -> None:
        """Let links of ``role`` send ``ctype``, handled by ``handler``. ``body_class`` is
        what the handler takes: TypeError unless it is the class the codec decodes
        ``ctype`` into (``BODY_TYPES``), so mypy's check of the handler against the class
        is a check against the wire. ValueError for a row already there."""
        expected = BODY_TYPES[ctype]
        if body_class is not expected:
            raise TypeError(
                f"{ctype.name} bodies are {expected.__name__}, not {body_class.__name__}"
            )
        if (role, ctype) in self._table:
            raise ValueError(f"{role.value} already has a handler for {ctype.name}")
        check = _CHECKS.get(ctype)
        if check is not None and check.body_class is not body_class:
            raise TypeError(
                f"the permission check of {ctype.name} reads {check.body_class.__name__} bodies"
            )
        self._table[role, int(ctype)] = _Row(
            body_class, None if check is None else check.denial, handler
        )

    def allows(self, role: LinkRole, ctype: int) -> bool:
        """Whether the table has a row for ``ctype`` from links of ``role``."""
        return (role, ctype) in self._table

    def handle(self, link: Link, ctype: int, correlation: int, body: Body | None) -> None:
        if link.role is LinkRole.HANDSHAKING:
            assert self._handshake is not None
            self._handshake(link, ControlFrame(ctype, body, correlation))
            return
        row = self._table.get((link.role, ctype))
        if row is None or body is None:
            self._not_allowed(link, ctype, correlation)
            return
        try:
            row.run(link, ctype, correlation, body)
        except Refused as exc:
            self._outbox.reply(
                link, ControlType.ERROR, Error(code=exc.code, message=str(exc)), correlation
            )

    def _not_allowed(self, link: Link, ctype: int, correlation: int) -> None:
        self.refused_frames += 1
        log.info(
            "refused a control frame its link may not send",
            extra={"link": link.link_id, "role": link.role.value, "type": describe(ctype)},
        )
        self._outbox.reply(
            link,
            ControlType.ERROR,
            Error(
                code=ErrorCode.UNSUPPORTED_CONTROL,
                message=f"{describe(ctype)} is not a frame {_ARTICLE[link.role]} may send "
                "to a broker",
            ),
            correlation,
        )


# -- permissions: what each control type asks of them ("" when allowed) ------------------


def _may_register(permissions: Permissions, body: Register) -> str:
    if permissions.may_register(body.server):
        return ""
    what = f"{body.server}:{body.instance}" if body.instance else f"under {body.server!r}"
    return permissions.denial(f"register {what}", keys.REGISTER)


def _may_join(permissions: Permissions, body: Membership) -> str:
    if permissions.may_join(body.group):
        return ""
    return permissions.denial(f"join {describe_address(body.group)}", keys.JOIN)


def _may_send_to_group(permissions: Permissions, body: MembersRequest | GroupBind) -> str:
    """MEMBERS and GROUP_BIND serve reliable and message-group sends to the group."""
    if permissions.may_send(body.group):
        return ""
    return permissions.denial(f"send to {describe_address(body.group)}", keys.SEND)


def _may_stream(permissions: Permissions, body: StreamRequest) -> str:
    """Every op but ``list``, whose answer holds only the streams the user may read (an
    unknown op is the handler's to refuse)."""
    operation = keys.stream_operation(body.op)
    if body.op == "list" or operation is None or permissions.may_stream(body.op, body.stream):
        return _may_capture(permissions, body) if body.op == "add" else ""
    if body.stream.startswith(keys.TELEMETRY_PREFIXES):
        return permissions.denial(
            f"read the telemetry stream {body.stream!r} (the right {keys.TELEMETRY!r})",
            keys.OPERATOR,
        )
    return permissions.denial(f"{body.op} stream {body.stream!r}", f"{keys.STREAMS}.{operation}")


def _may_capture(permissions: Permissions, body: StreamRequest) -> str:
    """A stream reads all that is sent to what it captures: as much as a member."""
    for group in body.captures:
        if not permissions.may_capture(group):
            return permissions.denial(
                f"add stream {body.stream!r} capturing {describe_address(group)} (capturing "
                "a group takes the right to join it)",
                keys.JOIN,
            )
    return ""


def _may_stat(permissions: Permissions, body: StatRequest) -> str:
    """A further page is of an answer already given."""
    right = keys.STAT_DETAIL if body.detail else keys.STAT
    if body.page or permissions.may_operate(right):
        return ""
    return permissions.denial(f"use the operator right {right!r}", keys.OPERATOR)


def _may_drain(permissions: Permissions, body: Drain) -> str:
    if permissions.may_operate(keys.DRAIN):
        return ""
    return permissions.denial(f"use the operator right {keys.DRAIN!r}", keys.OPERATOR)


# Each check's class is its own (``_Check[B]``); ``ControlDispatch.on`` matches it to the row's.
_CHECKS: dict[ControlType, _Check[Any]] = {
    ControlType.REGISTER: _Check(Register, _may_register),
    ControlType.JOIN: _Check(Membership, _may_join),
    ControlType.MEMBERS: _Check(MembersRequest, _may_send_to_group),
    ControlType.GROUP_BIND: _Check(GroupBind, _may_send_to_group),
    ControlType.STREAM: _Check(StreamRequest, _may_stream),
    ControlType.STAT: _Check(StatRequest, _may_stat),
    ControlType.DRAIN: _Check(Drain, _may_drain),
}
