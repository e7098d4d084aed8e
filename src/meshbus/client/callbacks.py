"""Handlers that can be added and removed again: the shape of every ``on_...`` of the client.

``add(handler)`` returns a function of no arguments that removes that handler. The
caller keeps the remover, not the handler: a handler is often a lambda or a bound
method made on the spot, which the caller could not hand again to a
``remove_...(handler)``. Each remover takes out one handler, once: removing twice
does nothing. The same shape serves ``on_service_left``, which must ask the broker
first and so is awaited: ``remove = await conn.on_service_left(handler)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

H = TypeVar("H", bound=Callable[..., object])


class Callbacks(Generic[H]):
    """``handlers``: the handlers in the order they were added. It is a tuple, replaced on
    every change: a loop over it sees the handlers of the moment it began, so a handler
    may remove itself (or add another) while it is called -- and checking it for
    handlers costs no call, where a message passes."""

    def __init__(self) -> None:
        self.handlers: tuple[H, ...] = ()

    def add(self, handler: H) -> Callable[[], None]:
        """Add ``handler``; returns the function that removes it."""
        self.handlers = (*self.handlers, handler)
        removed = False

        def remove() -> None:
            nonlocal removed
            if removed:
                return
            removed = True
            handlers = list(self.handlers)
            handlers.remove(handler)
            self.handlers = tuple(handlers)

        return remove
