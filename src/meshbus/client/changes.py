"""Service changes: register, unregister, join and leave, never interleaved with a copy.

When the connector links to a new broker (failover, a move) it copies every service
there (meshbus.client.failover). ``Changes`` makes each change on the current broker
through the ``Gate``, so none slips in while the services are copied and goes missing
at the new broker; and each returns only once the whole mesh knows it (SYNCED,
docs/mesh.md §3).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from meshbus.client.link import Links
from meshbus.client.requester import Requester
from meshbus.errors import ConnectionLost
from meshbus.protocol.codec import ControlFrame
from meshbus.protocol.control import Body
from meshbus.protocol.layout import ControlType

T = TypeVar("T")
B = TypeVar("B", bound=Body)


class Gate:
    """Many service changes (register, join, ...) at once, or one copy of all services to
    a new broker (failover, move) alone -- so no change can slip in while the services
    are copied and be missing at the new broker. A waiting copy goes before new changes."""

    def __init__(self) -> None:
        self._changes = 0
        self._copying = False
        self._copy_waiting = 0
        self._cond = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def change(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._copying and not self._copy_waiting)
            self._changes += 1
        try:
            yield
        finally:
            async with self._cond:
                self._changes -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def copy(self) -> AsyncIterator[None]:
        async with self._cond:
            self._copy_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._copying and not self._changes)
            finally:
                self._copy_waiting -= 1
            self._copying = True
        try:
            yield
        finally:
            async with self._cond:
                self._copying = False
                self._cond.notify_all()


class Changes:
    """Register, unregister, join and leave: each made on the current broker, never
    interleaved with copying the services to a new one, and done once the whole mesh
    knows it."""

    def __init__(self, links: Links, gate: Gate, requester: Requester) -> None:
        self._links = links
        self._gate = gate
        self._requester = requester

    async def change(
        self,
        type_: ControlType,
        body: Body,
        answer: type[B],
        apply: Callable[[B], T],
        subject: str = "",
    ) -> T:
        """Make the change and ``apply`` its answer.

        It returns once the broker says every broker of the mesh knows the change
        (SYNCED), so a message sent through any broker afterwards sees it. One whose
        broker dies before it answers is made again on the new broker: each of them is
        safe to repeat there (a service the old broker registered but never confirmed
        is not in ``services``, so the copy did not bring it along)."""
        links = self._links
        while True:
            link = await links.usable()
            synced: asyncio.Future[ControlFrame] = asyncio.get_running_loop().create_future()
            try:
                async with self._gate.change():
                    # A failover may have begun while we waited: wait it out.
                    if links.current is link and links.connected.is_set():
                        result = await self._requester.ask_and_apply(
                            type_, body, answer, apply, subject, link=link, synced=synced
                        )
                        try:
                            await synced
                        except ConnectionLost:
                            pass  # done here; the failover copies it to the next broker
                        return result
            except ConnectionLost:
                if links.closed:
                    raise
            finally:
                synced.cancel()
