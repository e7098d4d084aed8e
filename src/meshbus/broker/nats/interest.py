"""The interest of this broker's NATS clients: their subscriptions in the subject table,
and their peers told (docs/nats.md, "Across the mesh").

A SUB goes into the subject table at once, and -- when it changes what the peers hold
(``LocalInterest``: the first subscription to a subject, any change of a queue group's
count) -- becomes a route operation to every peer, sent at the end of the loop turn
with the others (meshbus.broker.mesh.sync). ``after_known`` is the promise a client's
``flush()`` after ``subscribe()`` relies on: it calls back once every peer linked now has
applied every operation announced so far, so a message published anywhere in the mesh
after that finds the subscription.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from meshbus.broker.core.interest import LocalInterest, PeerSubscription
from meshbus.broker.core.link import Link
from meshbus.broker.core.subjects import InvalidSubject, SubjectTable
from meshbus.protocol.control import OP_INTEREST, interest_extra

if TYPE_CHECKING:
    from meshbus.broker.nats.connection import Subscription

__all__ = ["MAX_SHARED_SUBJECT", "NatsInterest"]

# The longest subject (with its queue group) a client may subscribe to: its interest goes
# to the peers in one route operation, which must fit a frame whatever the control line
# allows (--nats-max-control-line goes to 1 MiB, as --max-frame's default).
MAX_SHARED_SUBJECT = 64 * 1024


class NatsInterest:
    """Local subscriptions in and out of the subject table, counted and announced."""

    def __init__(
        self,
        table: SubjectTable[Subscription | PeerSubscription[Link]],
        local: LocalInterest,
        announce: Callable[[int, bytes, bytes], None],
        after_confirmed: Callable[[Callable[[], None]], None],
        changed: Callable[[bytes], None],
    ) -> None:
        """``announce`` and ``after_confirmed`` are the route sync's (a route operation
        to every peer; a call back once the peers applied every one announced so far);
        ``changed(subject)`` hears of each subscription in or out (the bridge's routing
        decisions depend on them)."""
        self._table = table
        self._local = local
        self._announce = announce
        self._after_confirmed = after_confirmed
        self._changed = changed

    def insert(self, subject: bytes, queue: bytes, sub: Subscription) -> None:
        """Subscribe ``sub``; InvalidSubject (nothing changed) for a subject the table
        cannot take, or longer than MAX_SHARED_SUBJECT."""
        if len(subject) + len(queue) > MAX_SHARED_SUBJECT:
            raise InvalidSubject(
                f"a subject and queue group of {len(subject) + len(queue)} bytes; the peers "
                f"take at most {MAX_SHARED_SUBJECT}"
            )
        self._table.insert(subject, queue, sub)
        self._changed(subject)
        count = self._local.add(subject, queue)
        if count is not None:
            self._announce(OP_INTEREST, subject, interest_extra(count, queue))

    def remove(self, subject: bytes, queue: bytes, sub: Subscription) -> bool:
        """Unsubscribe ``sub``; whether it was subscribed."""
        if not self._table.remove(subject, queue, sub):
            return False
        self._changed(subject)
        count = self._local.remove(subject, queue)
        if count is not None:
            self._announce(OP_INTEREST, subject, interest_extra(count, queue))
        return True

    def after_known(self, then: Callable[[], None]) -> None:
        """Call ``then`` once every peer has applied every change announced so far (at
        once with no peer; a peer lost meanwhile stops counting)."""
        self._after_confirmed(then)
