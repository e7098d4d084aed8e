"""Where a NATS message goes: the delivery decisions, on this broker and across the mesh.

As nats-server delivers (docs/nats.md), with the mesh's brokers in the role of its
routes:

1. One copy per matching plain subscription of a client here -- a client subscribed
   twice to subjects that both match gets it twice, once per sid -- and one copy per
   peer broker with a matching interest, however many of its clients have one: the
   peer matches again and delivers to its own clients (``from_peer``). A message from a
   peer is never sent to another broker: one hop, as every frame of the mesh.
2. One copy per matching queue group, to one member picked at random for each message
   **here, at the origin**: a member of this broker's, or a peer picked weighted by its
   count of members, which then picks one of its own. So a group gets exactly one copy
   mesh-wide; a member that left the peer before the message reached it costs that copy
   (at most once, as nats-server).
3. A client whose CONNECT turned ``echo`` off gets none of its own messages (nor is it
   picked for a queue group while another member can take the message).
4. A request -- a message with a reply subject -- that reached nobody, here, at a peer
   or in meshbus (the bridge), gets, when its client asked for ``no_responders``, a
   status message ``503`` on the reply subject, to the requester's own subscription of
   it (nats-server's rule), at once.
5. Meshbus's own services meet NATS clients through the bridge (meshbus.broker.nats.bridge):
   a message published here also goes where the bridge maps its subject.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from meshbus.broker.core.interest import PeerSubscription
from meshbus.broker.core.link import Link
from meshbus.broker.core.subjects import SubjectTable, is_valid_queue
from meshbus.broker.nats.connection import Flushes
from meshbus.broker.nats.peers import PeerMessages
from meshbus.protocol.control import NatsMessages
from meshbus.protocol.nats import Publish, no_responders_header

if TYPE_CHECKING:
    from meshbus.broker.nats.connection import NatsConnection, Subscription

__all__ = ["NatsRouter"]

log = logging.getLogger("meshbus.broker.nats")

_BLANK = re.compile(rb"[ \t\r\n\f]").search


class NatsRouter:
    """The delivery of published messages, by the subject table."""

    def __init__(
        self,
        table: SubjectTable[Subscription | PeerSubscription[Link]],
        peers: PeerMessages,
        rng: random.Random,
        to_meshbus: Callable[[Publish], int] = lambda event: 0,
    ) -> None:
        """``to_meshbus`` hands a client's message to meshbus's services too, and says
        how many links it went to (meshbus.broker.nats.bridge)."""
        self._table = table
        self._peers = peers
        self._rng = rng
        self._to_meshbus = to_meshbus
        # Written once per read of a peer's frames or of the bridge's (a client's own
        # read writes what it queued: meshbus.broker.nats.connection).
        self.flushes = Flushes()
        self.msgs_in = 0
        self.msgs_out = 0
        self.no_responders = 0
        self.from_peers = 0
        self.dropped_from_peers = 0  # invalid rows, or a queue group with no member left

    def publish(self, publisher: NatsConnection, event: Publish) -> None:
        """A message from a client of this broker."""
        options = publisher.options
        delivered = self.route(event, publisher, options.echo)
        delivered += self._to_meshbus(event)
        self.msgs_in += 1
        publisher.msgs_in += 1
        publisher.bytes_in += len(event.data)
        if not delivered and event.reply and options.no_responders:
            self._no_responders(publisher, event)

    def route(
        self, event: Publish, publisher: NatsConnection | None = None, echo: bool = True
    ) -> int:
        """Deliver ``event`` to the subscriptions here and send it to the peers with an
        interest; how many subscriptions and peers it went to."""
        interest = self._table.match(event.subject)
        if not interest:
            return 0
        delivered = 0
        plain_peers: dict[Link, None] = {}
        for sub in interest.plain:
            if isinstance(sub, PeerSubscription):
                plain_peers[sub.peer] = None
            elif echo or sub.conn is not publisher:
                sub.conn.deliver(sub, event)
                delivered += 1
        queues: dict[Link, list[bytes]] = {}
        if interest.queues:
            for name, members in interest.queues:
                member = self._pick(members, publisher, echo)
                if member is None:
                    continue
                if isinstance(member, PeerSubscription):
                    queues.setdefault(member.peer, []).append(name)
                else:
                    member.conn.deliver(member, event)
                    delivered += 1
        self.msgs_out += delivered
        if plain_peers or queues:
            send = self._peers.send
            subject, reply, header_size, data = (
                event.subject, event.reply, event.header_size, event.data,
            )  # fmt: skip
            for peer in plain_peers:
                send(peer, (subject, reply, header_size, data, True, queues.pop(peer, [])))
            for peer, names in queues.items():
                send(peer, (subject, reply, header_size, data, False, names))
            delivered += len(plain_peers) + len(queues)
        return delivered

    def _pick(
        self,
        members: tuple[Subscription | PeerSubscription[Link], ...],
        publisher: NatsConnection | None,
        echo: bool,
    ) -> Subscription | PeerSubscription[Link] | None:
        """A member at random, a peer's weighted by its count of members; without echo,
        never the publisher's own subscription."""
        eligible = [
            m for m in members if echo or isinstance(m, PeerSubscription) or m.conn is not publisher
        ]
        if len(eligible) <= 1:
            return eligible[0] if eligible else None
        weights = [m.weight if isinstance(m, PeerSubscription) else 1 for m in eligible]
        total = sum(weights)
        if total == len(eligible):
            return eligible[self._rng.randrange(total)]
        point = self._rng.randrange(total)
        for member, weight in zip(eligible, weights, strict=True):
            if point < weight:
                return member
            point -= weight
        raise AssertionError("a weighted pick past the total")

    def _no_responders(self, publisher: NatsConnection, event: Publish) -> None:
        for sub in self._table.match(event.reply).plain:
            if not isinstance(sub, PeerSubscription) and sub.conn is publisher:
                self.no_responders += 1
                header = no_responders_header(event.subject)
                publisher.deliver(sub, Publish(event.reply, b"", len(header), header))
                return

    # -- from peer brokers ---------------------------------------------------------------

    def from_peer(self, link: Link, correlation: int, body: NatsMessages) -> None:
        """NATS_MSGS: messages a peer's clients published, for the clients here only."""
        for subject, reply, header_size, data, plain, queues in body.msgs:
            # What would break a client's MSG line: a blank, an empty subject. A subject
            # with an empty token only matches nothing.
            if (
                not subject
                or _BLANK(subject)
                or (reply and _BLANK(reply))
                or header_size > len(data)
                or (queues and not all(is_valid_queue(q) for q in queues))
            ):
                self.dropped_from_peers += 1
                if self.dropped_from_peers == 1:
                    log.warning("an invalid NATS message from a peer", extra={"peer": link.name})
                continue
            self.from_peers += 1
            self._deliver_here(Publish(subject, reply, header_size, data), plain, queues)
        self.flushes.flush()

    def _deliver_here(self, event: Publish, plain: bool, queues: list[bytes]) -> None:
        interest = self._table.match(event.subject)
        delivered = 0
        if plain:
            for sub in interest.plain:
                if not isinstance(sub, PeerSubscription):
                    sub.conn.deliver(sub, event)
                    delivered += 1
        for name in queues:
            local = [
                m
                for group, members in interest.queues
                if group == name
                for m in members
                if not isinstance(m, PeerSubscription)
            ]
            if not local:
                self.dropped_from_peers += 1  # its members here left while it was on its way
                continue
            member = local[self._rng.randrange(len(local))] if len(local) > 1 else local[0]
            member.conn.deliver(member, event)
            delivered += 1
        self.msgs_out += delivered
