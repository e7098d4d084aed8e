"""Which of the connector's services is in which group, and keeping it so.

Each mailbox's ``groups`` and the members of each group change only here: by joining
and leaving -- changes made on the broker through ``Changes``
(meshbus.client.changes), applied as the answer is read, so the membership is in
place for the first message the broker routes to it -- and by forgetting a service
that is gone. After a failover or a move the copy of the services to the new broker
(meshbus.client.failover) asks every group again (``rejoins``). A service the
inbound dispatcher is told to subscribe to a topic (``subscribe_other``) joins here
too, so nothing below the public ``Service`` calls up into it.

Each service's subject subscriptions (``subscribe``: patterns the broker's subject layer
matches, docs/nats.md) are kept here the same way, and subscribed again after a
failover (``resubscribes``).

It also keeps one service of the connector in the broadcast group, so the mesh sends
the connector one copy of each broadcast, which it hands to every service.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from meshbus.address import BROADCAST_GROUP, Address
from meshbus.client.changes import Changes
from meshbus.client.link import Links
from meshbus.client.mailboxes import Mailbox, Services
from meshbus.errors import MeshbusError
from meshbus.protocol.control import Empty, Membership, SubjectInterest
from meshbus.protocol.layout import ControlType
from meshbus.util import BackgroundTasks

log = logging.getLogger("meshbus.client")


class Memberships:
    def __init__(
        self, services: Services, changes: Changes, links: Links, tasks: BackgroundTasks
    ) -> None:
        self._members: dict[bytes, list[Mailbox]] = {}
        self._services = services
        self._changes = changes
        self._links = links
        self._tasks = tasks
        self._broadcast_member: Mailbox | None = None
        # Each service's subject subscriptions (service address -> (pattern, queue)).
        self._subjects: dict[bytes, dict[tuple[bytes, bytes], None]] = {}

    def members(self, group: bytes) -> Sequence[Mailbox]:
        return self._members.get(group, ())

    def subjects(self, mailbox: Mailbox) -> list[tuple[bytes, bytes]]:
        """``mailbox``'s subject subscriptions: (pattern, queue group), in the order made."""
        return list(self._subjects.get(mailbox.raw, ()))

    # -- joining and leaving ----------------------------------------------------------

    async def join(self, mailbox: Mailbox, group: Address) -> None:
        """Make ``mailbox`` a member of ``group``; returns once the mesh knows it."""
        await self._changes.change(
            ControlType.JOIN,
            Membership(member=mailbox.raw, group=group.to_bytes()),
            Empty,
            lambda _: self._joined(mailbox, group),
        )

    async def leave(self, mailbox: Mailbox, group: Address) -> None:
        await self._changes.change(
            ControlType.LEAVE,
            Membership(member=mailbox.raw, group=group.to_bytes()),
            Empty,
            lambda _: self._left(mailbox, group),
        )

    async def subscribe(self, mailbox: Mailbox, subject: bytes, queue: bytes) -> None:
        """Subscribe ``mailbox`` to the subject pattern ``subject`` (in queue group
        ``queue``, b"" for none); returns once the mesh knows it."""
        await self._changes.change(
            ControlType.SUBSCRIBE,
            SubjectInterest(member=mailbox.raw, subject=subject, queue=queue),
            Empty,
            lambda _: self._subscribed(mailbox, subject, queue),
        )

    async def unsubscribe(self, mailbox: Mailbox, subject: bytes, queue: bytes) -> None:
        await self._changes.change(
            ControlType.UNSUBSCRIBE,
            SubjectInterest(member=mailbox.raw, subject=subject, queue=queue),
            Empty,
            lambda _: self._unsubscribed(mailbox, subject, queue),
        )

    def rejoins(self, mailbox: Mailbox) -> list[Membership]:
        """The JOINs that bring ``mailbox``'s groups back on a new broker."""
        return [Membership(member=mailbox.raw, group=group.to_bytes()) for group in mailbox.groups]

    def resubscribes(self, mailbox: Mailbox) -> list[SubjectInterest]:
        """The SUBSCRIBEs that bring ``mailbox``'s subject subscriptions back on a new
        broker."""
        return [
            SubjectInterest(member=mailbox.raw, subject=subject, queue=queue)
            for subject, queue in self._subjects.get(mailbox.raw, ())
        ]

    def _subscribed(self, mailbox: Mailbox, subject: bytes, queue: bytes) -> None:
        if not mailbox.closed:
            self._subjects.setdefault(mailbox.raw, {})[subject, queue] = None

    def _unsubscribed(self, mailbox: Mailbox, subject: bytes, queue: bytes) -> None:
        subjects = self._subjects.get(mailbox.raw)
        if subjects is not None:
            subjects.pop((subject, queue), None)
            if not subjects:
                del self._subjects[mailbox.raw]

    def _joined(self, mailbox: Mailbox, group: Address) -> None:
        # A mailbox is in a group's members exactly when the group is in its groups (both
        # change only here): a set lookup, where a scan of the members made a connector's
        # N joins to one group cost O(N^2).
        if group in mailbox.groups:
            return
        mailbox.groups.add(group)
        self._members.setdefault(group.to_bytes(), []).append(mailbox)

    def _left(self, mailbox: Mailbox, group: Address) -> None:
        mailbox.groups.discard(group)
        raw = group.to_bytes()
        members = self._members.get(raw)
        if members and mailbox in members:
            members.remove(mailbox)
            if not members:
                del self._members[raw]

    # -- services that go ---------------------------------------------------------------

    def forget(self, mailbox: Mailbox, error: MeshbusError | None = None) -> None:
        """The service is gone (``error``: why, when it did not unregister): out of its
        groups and the registry, and if it was the broadcast member, another one takes
        its place."""
        for group in list(mailbox.groups):
            self._left(mailbox, group)
        self._subjects.pop(mailbox.raw, None)
        self._services.remove(mailbox, error)
        if mailbox is self._broadcast_member and not self._links.closed:
            self._broadcast_member = None
            self._tasks.spawn(self._rejoin_broadcasts(), "broadcast-member")

    # -- the broadcast member -------------------------------------------------------------

    async def reach_broadcasts(self) -> None:
        """Make a service the broadcast member, if none is and there is a service."""
        if self._broadcast_member is not None or not self._services:
            return
        member = self._broadcast_member = self._services.all()[0]
        try:
            await self.join(member, BROADCAST_GROUP)
        except MeshbusError:
            self._broadcast_member = None
            raise

    async def _rejoin_broadcasts(self) -> None:
        try:
            await self.reach_broadcasts()
        except MeshbusError as exc:  # that service went too; the next register tries again
            log.debug("no broadcast member", extra={"error": str(exc)})
