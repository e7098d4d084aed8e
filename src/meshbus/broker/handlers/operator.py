"""Commands about the broker and the link itself, from connectors and operators alike:
STAT, DRAIN, PING and BYE. They reach these handlers through
meshbus.broker.core.dispatch, STAT and DRAIN past the permission check of the link's
user (the operator rights).

None of them touches routing or the mesh: STAT reads what the broker shows
(meshbus.broker.observe.stat, a snapshot function each), DRAIN asks the broker to drain
(as SIGTERM does), PING is answered PONG, BYE closes the link. The one state kept is a
STATS answer too large for one frame: its pages not yet asked for wait on the link.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from meshbus.broker.core.dispatch import Refused
from meshbus.broker.core.endpoint import CloseReason
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox
from meshbus.errors import FrameTooLarge
from meshbus.protocol.codec import encode_control
from meshbus.protocol.control import Bye, Drain, Empty, StatRequest, Stats
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.util import BackgroundTasks

# Room left in each STATS page for the frame header and the body's other fields.
_STATS_PAGE_ROOM = 1024


class OperatorCommands:
    def __init__(
        self,
        *,
        outbox: Outbox,
        snapshot: Callable[[], dict[str, Any]],
        detailed_snapshot: Callable[[], Awaitable[dict[str, Any]]],
        request_drain: Callable[[float | None], None],
    ) -> None:
        """``snapshot`` and ``detailed_snapshot`` answer STAT; ``request_drain`` starts a
        drain (as SIGTERM does)."""
        self._outbox = outbox
        self._snapshot = snapshot
        self._detailed_snapshot = detailed_snapshot
        self._request_drain = request_drain
        self._tasks = BackgroundTasks()

    def on_stat(self, link: Link, correlation: int, body: StatRequest) -> None:
        """The brief answer at once; the detailed one once built (in slices). An answer
        larger than the link's frame limit goes in pages, the rest kept on the link until
        the operator has asked for each (``StatRequest.page``)."""
        if body.page:
            self._stat_page(link, correlation, body.page)
        elif body.detail:
            self._tasks.spawn(self._answer_detailed(link, correlation), "stat")
        else:
            self._answer_stat(link, correlation, self._snapshot())

    async def stop(self) -> None:
        """Stop the answers still being built."""
        await self._tasks.cancel()

    async def _answer_detailed(self, link: Link, correlation: int) -> None:
        data = await self._detailed_snapshot()
        if not link.closed:
            self._answer_stat(link, correlation, data)
            self._outbox.flush()

    def _answer_stat(self, link: Link, correlation: int, data: dict[str, Any]) -> None:
        try:
            frame = encode_control(
                ControlType.STATS, Stats(data=data), correlation, max_frame=link.max_frame
            )
        except FrameTooLarge:
            blob = msgspec.msgpack.encode(data)
            size = link.max_frame - _STATS_PAGE_ROOM
            link.stat_pages = [blob[start : start + size] for start in range(0, len(blob), size)]
            self._stat_page(link, correlation, 0)
            return
        link.send(frame)

    def _stat_page(self, link: Link, correlation: int, page: int) -> None:
        pages = link.stat_pages
        if page >= len(pages):
            raise Refused(
                ErrorCode.UNAVAILABLE,
                f"no page {page} of a STATS answer here: ask for the answer first (page 0)",
            )
        body = Stats(page=page, pages=len(pages), blob=pages[page])
        if page == len(pages) - 1:
            link.stat_pages = []
        self._outbox.reply(link, ControlType.STATS, body, correlation)

    def on_ping(self, link: Link, correlation: int, body: Empty) -> None:
        self._outbox.reply(link, ControlType.PONG, Empty(), correlation)

    def on_drain(self, link: Link, correlation: int, body: Drain) -> None:
        """An operator asks for a drain; the broker drains and exits (as on SIGTERM)."""
        self._request_drain(body.grace or None)
        self._outbox.reply(link, ControlType.OK, Empty(), correlation)

    def on_bye(self, link: Link, correlation: int, body: Bye) -> None:
        link.close(CloseReason.CLIENT_BYE)
