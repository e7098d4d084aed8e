"""Where a NATS client's published message goes: the delivery decisions.

As nats-server delivers (docs/nats.md):

1. One copy per matching plain subscription -- a client subscribed twice to subjects
   that both match gets it twice, once per sid.
2. One copy per matching queue group, to one member picked at random for each
   message. The pick is made here, at the origin; when other brokers' members join the
   table (docs/nats.md, "Not yet"), a remote member picked here is where the message is
   sent, so a group still gets exactly one copy mesh-wide.
3. A client whose CONNECT turned ``echo`` off gets none of its own messages (nor is it
   picked for a queue group while another member can take the message).
4. A request -- a message with a reply subject -- that reached nobody gets, when its
   client asked for ``no_responders``, a status message ``503`` on the reply subject, to
   the requester's own subscription of it (nats-server's rule), at once.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from meshbus.broker.core.subjects import SubjectTable
from meshbus.protocol.nats import Publish, no_responders_header

if TYPE_CHECKING:
    from meshbus.broker.nats.connection import NatsConnection, Subscription


class NatsRouter:
    """The delivery of published messages, by the subject table."""

    def __init__(self, table: SubjectTable[Subscription], rng: random.Random) -> None:
        self._table = table
        self._rng = rng
        self.msgs_in = 0
        self.msgs_out = 0
        self.no_responders = 0

    def publish(self, publisher: NatsConnection, event: Publish) -> None:
        interest = self._table.match(event.subject)
        options = publisher.options
        echo = options.echo
        delivered = 0
        for sub in interest.plain:
            if echo or sub.conn is not publisher:
                sub.conn.deliver(sub, event)
                delivered += 1
        for _, members in interest.queues:
            member = self._pick(members, publisher, echo)
            if member is not None:
                member.conn.deliver(member, event)
                delivered += 1
        self.msgs_in += 1
        self.msgs_out += delivered
        if not delivered and event.reply and options.no_responders:
            self._no_responders(publisher, event)

    def _pick(
        self, members: tuple[Subscription, ...], publisher: NatsConnection, echo: bool
    ) -> Subscription | None:
        """A member at random; without echo, the first after it that is not the
        publisher's own."""
        count = len(members)
        start = self._rng.randrange(count) if count > 1 else 0
        for i in range(count):
            member = members[(start + i) % count]
            if echo or member.conn is not publisher:
                return member
        return None

    def _no_responders(self, publisher: NatsConnection, event: Publish) -> None:
        for sub in self._table.match(event.reply).plain:
            if sub.conn is publisher:
                self.no_responders += 1
                header = no_responders_header(event.subject)
                publisher.deliver(sub, Publish(event.reply, b"", len(header), header))
                return
