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
that role. Handlers run on the event loop and never await (docs/architecture.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from meshbus.broker.endpoint import LinkRole
from meshbus.broker.link import Link
from meshbus.broker.outbox import Outbox
from meshbus.protocol.codec import ControlFrame, describe
from meshbus.protocol.control import Body, Error
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
