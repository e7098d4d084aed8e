"""Connectors that asked (WATCH) are told which services left the mesh (LEFT):
unregistered anywhere, or their connector died without a goodbye."""

from __future__ import annotations

import asyncio

from meshbus.broker.endpoint import LinkState
from meshbus.broker.link import Link
from meshbus.broker.outbox import Outbox
from meshbus.protocol.control import Body, Empty, Left
from meshbus.protocol.layout import ControlType


class ServiceWatch:
    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self._watchers: set[Link] = set()
        self._left: list[bytes] = []

    def on_watch(self, link: Link, correlation: int, body: Body) -> None:
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
        body = Left(addresses=left)
        for link in list(self._watchers):
            if link.state is LinkState.OPEN:
                self._outbox.reply(link, ControlType.LEFT, body)
            else:
                self._watchers.discard(link)
        self._outbox.flush()
