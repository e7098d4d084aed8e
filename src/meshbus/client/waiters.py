"""What waits for the broker: control answers, SYNCED, and the responses to requests.

A control request waits for its answer by correlation, a change also for the SYNCED
that follows it, and a data request for its response by (requester, message id) --
each tied to the link it can only come over, so losing that link fails exactly those.
The requester (meshbus.client.requester) and the failover's copy of the services
(meshbus.client.failover) wait here; the inbound dispatcher (meshbus.client.inbound)
settles what its links read.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from meshbus.client.link import BrokerLink
from meshbus.client.message import Message
from meshbus.errors import MeshbusError
from meshbus.protocol.codec import ControlFrame

T = TypeVar("T")

ResponseKey = tuple[bytes, int]  # (requester, message id)


class Waiters:
    def __init__(self) -> None:
        self._answers: dict[int, _Answer] = {}
        # SYNCED after the answer to a change: the change is known mesh-wide.
        self._synced: dict[int, tuple[asyncio.Future[ControlFrame], BrokerLink]] = {}
        self._responses: dict[ResponseKey, tuple[asyncio.Future[Message], BrokerLink]] = {}

    # -- waiting -------------------------------------------------------------------------

    @contextlib.contextmanager
    def answer(
        self, correlation: int, link: BrokerLink, settle: Callable[[ControlFrame], T]
    ) -> Iterator[asyncio.Future[T]]:
        """The future of the answer with ``correlation`` over ``link``, while in the block:
        what ``settle`` makes of the answer, or what it raised.

        ``settle`` runs as the answer is read, before the frames read with it: a service
        an answer makes is there for the message right behind it."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._answers[correlation] = _Answer(future, link, settle)
        try:
            yield future
        finally:
            self._answers.pop(correlation, None)

    def expect_synced(
        self, correlation: int, link: BrokerLink, future: asyncio.Future[ControlFrame]
    ) -> None:
        """``future`` gets the SYNCED with ``correlation`` over ``link``; it stops waiting
        for it once it is done (or cancelled)."""
        self._synced[correlation] = (future, link)
        future.add_done_callback(lambda _: self._synced.pop(correlation, None))

    def expect_response(
        self, key: ResponseKey, link: BrokerLink, loop: asyncio.AbstractEventLoop
    ) -> asyncio.Future[Message]:
        """The future of the response to request ``key`` (requester, message id) over
        ``link``, until ``forget_response``. (Not a context manager, as ``answer`` is: a
        request is on the per-message path.)"""
        future: asyncio.Future[Message] = loop.create_future()
        self._responses[key] = (future, link)
        return future

    def forget_response(self, key: ResponseKey) -> None:
        self._responses.pop(key, None)

    def fail(self, error: MeshbusError, link: BrokerLink | None = None) -> None:
        """Fail what waits for an answer (a control answer, a SYNCED, a response) that can
        only come over ``link``; over any link when it is None."""
        waiting: list[tuple[asyncio.Future[Any], BrokerLink]] = [
            *((answer.future, answer.link) for answer in self._answers.values()),
            *self._synced.values(),
            *self._responses.values(),
        ]
        for future, via in waiting:
            if (link is None or via is link) and not future.done():
                future.set_exception(error)

    # -- settling what arrived ---------------------------------------------------------------

    def answered(self, frame: ControlFrame) -> bool:
        """``frame`` answers a waiting control request: settled (True), or nobody waits."""
        waiting = self._answers.get(frame.correlation) if frame.correlation else None
        if waiting is None:
            return False
        future = waiting.future
        if not future.done():
            try:
                future.set_result(waiting.settle(frame))
            except Exception as exc:  # the asker's to raise, not the link's
                future.set_exception(exc)
        return True

    def synced(self, frame: ControlFrame) -> None:
        """A SYNCED: the change with its correlation is known mesh-wide."""
        synced = self._synced.get(frame.correlation)
        if synced is not None and not synced[0].done():
            synced[0].set_result(frame)

    def response_to(self, key: ResponseKey) -> asyncio.Future[Message] | None:
        """The future that waits for the response to request ``key``, if one does."""
        waiting = self._responses.get(key)
        return None if waiting is None else waiting[0]


@dataclass(frozen=True, slots=True)
class _Answer:
    """A control request waiting for its answer."""

    future: asyncio.Future[Any]
    link: BrokerLink
    settle: Callable[[ControlFrame], Any]
