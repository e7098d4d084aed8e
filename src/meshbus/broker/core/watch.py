"""Connectors that asked (WATCH) are told which services left the mesh (LEFT):
unregistered anywhere, or their connector died without a goodbye.

On a broker with users a watcher hears only of the addresses its user may see: those it
may send or send requests to, every one with the ``stat-detail`` right (which shows the
whole routing table anyway). An address it could not reach is none of its business, and
the stream of LEFT frames would otherwise list every service of the mesh as it goes
(docs/security.md, "What a watcher sees")."""

from __future__ import annotations

import asyncio

from meshbus.broker.core.endpoint import LinkState
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox
from meshbus.broker.security.permissions import STAT_DETAIL, Permissions
from meshbus.protocol.control import Empty, Left
from meshbus.protocol.layout import ControlType


class ServiceWatch:
    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self._watchers: set[Link] = set()
        self._left: list[bytes] = []

    def on_watch(self, link: Link, correlation: int, body: Empty) -> None:
        self._watchers.add(link)
        self._outbox.reply(link, ControlType.OK, Empty(), correlation)

    def link_closed(self, link: Link) -> None:
        self._watchers.discard(link)

    def services_left(self, addresses: list[bytes]) -> None:
        """Tell the watchers, once per loop turn, which services left the mesh."""
        if not self._watchers or not addresses:
            return
        if not self._left:
            asyncio.get_running_loop().call_soon(self._tell_watchers)
        self._left.extend(addresses)

    def _tell_watchers(self) -> None:
        left, self._left = self._left, []
        everything = Left(addresses=left)
        for link in list(self._watchers):
            if link.state is not LinkState.OPEN:
                self._watchers.discard(link)
                continue
            permissions = link.permissions
            body = everything if _sees_all(permissions) else _visible(left, permissions)
            if body.addresses:
                self._outbox.reply(link, ControlType.LEFT, body)
        self._outbox.flush()


def _sees_all(permissions: Permissions | None) -> bool:
    return permissions is None or permissions.may_operate(STAT_DETAIL)


def _visible(left: list[bytes], permissions: Permissions | None) -> Left:
    """The addresses of ``left`` a user may send or send requests to (the answers are
    memoised per user, as a send's are)."""
    assert permissions is not None
    return Left(
        addresses=[a for a in left if permissions.may_send(a) or permissions.may_request(a)]
    )
