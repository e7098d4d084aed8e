"""The one place where a control frame meets its handler: a table from (link role,
control type) to a handler that takes ``(link, correlation, body)``.

Every control frame a broker reads goes through ``ControlDispatch.handle``. On a
link still handshaking, every frame goes to the handshake (meshbus.protocol.handshake,
sans-IO), which takes HELLO (or, on a link this broker dialled, WELCOME) and closes
the link on anything else. On an open link, the table decides: a frame its
link's role may not send -- a REGISTER from an operator, a ROUTES from a
connector -- finds no row and takes the one refusal path, an ERROR with code
UNSUPPORTED_CONTROL and the request's correlation; the link stays open.

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
from collections.abc import Callable, Mapping

from meshbus.address import describe_address
from meshbus.broker.core.endpoint import LinkRole
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox
from meshbus.broker.security import permissions as keys
from meshbus.broker.security.permissions import Permissions
from meshbus.protocol.codec import ControlFrame, describe
from meshbus.protocol.control import (
    Body,
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

Handler = Callable[[Link, int, Body], None]
ControlTable = Mapping[tuple[LinkRole, int], Handler]
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


class ControlDispatch:
    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self._table: ControlTable = {}
        self._handshake: HandshakeHandler | None = None
        self.refused_frames = 0  # frames whose role may not send them

    def install(self, handshake: HandshakeHandler, table: ControlTable) -> None:
        """Take the handlers (made once the parts they name exist: meshbus.broker.server)."""
        self._handshake = handshake
        self._table = table

    def handle(self, link: Link, ctype: int, correlation: int, body: Body | None) -> None:
        if link.role is LinkRole.HANDSHAKING:
            assert self._handshake is not None
            self._handshake(link, ControlFrame(ctype, body, correlation))
            return
        handler = self._table.get((link.role, ctype))
        if handler is None or body is None:
            self._not_allowed(link, ctype, correlation)
            return
        try:
            permissions = link.permissions
            if permissions is not None and ctype in _CHECKS:
                denied = _CHECKS[ctype](permissions, body)
                if denied:
                    raise Refused(ErrorCode.PERMISSION_DENIED, denied)
            handler(link, correlation, body)
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


def _may_register(permissions: Permissions, body: Body) -> str:
    assert isinstance(body, Register)
    if permissions.may_register(body.server):
        return ""
    what = f"{body.server}:{body.instance}" if body.instance else f"under {body.server!r}"
    return permissions.denial(f"register {what}", keys.REGISTER)


def _may_join(permissions: Permissions, body: Body) -> str:
    assert isinstance(body, Membership)
    if permissions.may_join(body.group):
        return ""
    return permissions.denial(f"join {describe_address(body.group)}", keys.JOIN)


def _may_send_to_group(permissions: Permissions, body: Body) -> str:
    """MEMBERS and GROUP_BIND serve reliable and message-group sends to the group."""
    assert isinstance(body, (MembersRequest, GroupBind))
    if permissions.may_send(body.group):
        return ""
    return permissions.denial(f"send to {describe_address(body.group)}", keys.SEND)


def _may_stream(permissions: Permissions, body: Body) -> str:
    """Every op but ``list``, whose answer holds only the streams the user may read (an
    unknown op is the handler's to refuse)."""
    assert isinstance(body, StreamRequest)
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


def _may_stat(permissions: Permissions, body: Body) -> str:
    """A further page is of an answer already given."""
    assert isinstance(body, StatRequest)
    right = keys.STAT_DETAIL if body.detail else keys.STAT
    if body.page or permissions.may_operate(right):
        return ""
    return permissions.denial(f"use the operator right {right!r}", keys.OPERATOR)


def _may_drain(permissions: Permissions, body: Body) -> str:
    if permissions.may_operate(keys.DRAIN):
        return ""
    return permissions.denial(f"use the operator right {keys.DRAIN!r}", keys.OPERATOR)


_CHECKS: dict[int, Callable[[Permissions, Body], str]] = {
    ControlType.REGISTER: _may_register,
    ControlType.JOIN: _may_join,
    ControlType.MEMBERS: _may_send_to_group,
    ControlType.GROUP_BIND: _may_send_to_group,
    ControlType.STREAM: _may_stream,
    ControlType.STAT: _may_stat,
    ControlType.DRAIN: _may_drain,
}
