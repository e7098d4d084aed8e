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
6. Services subscribe to subjects too (meshbus.broker.nats.services): their
   subscriptions are rows of the same table, and a service gets one copy of a message
   however many of its patterns match (``_one_per_service``); what services publish is
   routed here as a client's PUBs are (``publish_from_service``).

What keeps it cheap: messages come in runs -- the PUBs of one read of a client, the rows
of one frame from a peer -- and the messages of a run mostly share a subject. Where a
subject's messages go (a ``_Plan``: the subscriptions here, the peers, each queue
group's members that may be picked) is worked out once for the messages that follow on
it, and again when the subject changes or the table does (a subscription that got its
max, a connection closed as a slow consumer). A new subject whose match is the one the
plan was made from -- the same answer of the table's cache, as the replies to one
requester's inbox get (meshbus.broker.core.subjects, "Subjects seen once") -- takes the
plan over. A plan lives for one run only: a peer's count of queue-group members changes
in place, between runs.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from meshbus.broker.core.interest import PeerSubscription
from meshbus.broker.core.link import Link
from meshbus.broker.core.subjects import Interest, SubjectTable, is_valid_queue
from meshbus.broker.nats.connection import Flushes
from meshbus.broker.nats.peers import PeerMessages
from meshbus.broker.nats.services import ServiceSubscription
from meshbus.protocol.control import NatsMessages, NatsRow
from meshbus.protocol.nats import Message, Publish, no_responders_header

if TYPE_CHECKING:
    from meshbus.broker.nats.connection import NatsConnection, Subscriber, Subscription

__all__ = ["NatsRouter"]

log = logging.getLogger("meshbus.broker.nats")

_BLANK = re.compile(rb"[ \t\r\n\f]").search
# The queue groups of a row for a peer's plain subscriptions only: one list for all of
# them, as rows are only ever encoded.
_NO_QUEUES: list[bytes] = []


def _one_per_service(local: list[Subscription]) -> list[Subscription]:
    """``local`` with one subscription of each meshbus service: a service gets a message
    once, however many of its subject patterns match it (a NATS client gets one copy per
    subscription, each being its own sid)."""
    seen: set[object] = set()
    kept: list[Subscription] = []
    for sub in local:
        if type(sub) is ServiceSubscription:
            if sub.conn in seen:
                continue
            seen.add(sub.conn)
        kept.append(sub)
    return kept


class _Group:
    """The members of one queue group that a message may be handed to, and how to pick
    one: uniformly when ``weights`` is None, else weighted (a peer's weight is its count
    of members)."""

    __slots__ = ("members", "total", "weights")

    def __init__(self, members: list[Subscription | PeerSubscription[Link]]) -> None:
        weights = [m.weight if isinstance(m, PeerSubscription) else 1 for m in members]
        total = sum(weights)
        self.members = members
        self.weights: list[int] | None = weights
        self.total = total
        if len(members) == 1 or total == len(members):
            self.weights, self.total = None, len(members)


class _Plan:
    """Where the messages on ``subject`` go while the subject table is at ``version``:
    ``local``, the plain subscriptions here; ``peers``, the brokers with a plain
    interest; ``groups``, each queue group with a member that may be picked; whether
    they may go on to meshbus's services (``meshbus``: the bridge's ``reaches``, which
    only a message from another link can change). ``in_runs``: the messages of a run
    that follow on the subject may go together -- no queue group to pick a member of for
    each, and the publisher is not among ``local``: its closing (a slow consumer of its
    own messages) must stop the run at once."""

    __slots__ = (
        "groups", "in_runs", "interest", "local", "meshbus", "peers", "subject", "version",
    )  # fmt: skip

    def __init__(
        self,
        subject: bytes,
        interest: Interest[Subscription | PeerSubscription[Link]],
        version: int,
        local: list[Subscription],
        peers: list[Link],
        groups: dict[bytes, _Group],
        in_runs: bool,
    ) -> None:
        self.subject = subject
        self.interest = interest
        self.version = version
        self.local = local
        self.peers = peers
        self.groups = groups
        self.in_runs = in_runs
        self.meshbus = False


def _taken_over(
    plan: _Plan | None,
    subject: bytes,
    interest: Interest[Subscription | PeerSubscription[Link]],
    version: int,
) -> _Plan | None:
    """``plan``, now for ``subject``, when the subject matched what the plan was made
    from (the table's one cached answer, unchanged since); else None."""
    if plan is not None and plan.interest is interest and plan.version == version:
        plan.subject = subject
        return plan
    return None


class NatsRouter:
    """The delivery of published messages, by the subject table."""

    def __init__(
        self,
        table: SubjectTable[Subscription | PeerSubscription[Link]],
        peers: PeerMessages,
        rng: random.Random,
        to_meshbus: Callable[[Message], int] = lambda message: 0,
        reaches_meshbus: Callable[[bytes], bool] = lambda subject: False,
    ) -> None:
        """``to_meshbus`` hands a client's message to meshbus's services too, and says
        how many links it went to; ``reaches_meshbus`` whether a subject's messages may
        go there at all (meshbus.broker.nats.bridge)."""
        self._table = table
        self._peers = peers
        self._rng = rng
        self._to_meshbus = to_meshbus
        self._reaches_meshbus = reaches_meshbus
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
        self.publish_many(publisher, ((event.subject, event.reply, event.header_size, event.data),))

    def publish_many(self, publisher: NatsConnection, messages: Sequence[Message]) -> None:
        """Messages from a client of this broker, in the order it sent them: a run of its
        PUBs. None goes on once the client's connection closed (a slow consumer of its
        own messages)."""
        options = publisher.options
        requester = publisher if options.no_responders else None
        routed, size = self._publish_run(publisher, options.echo, requester, messages)
        self.msgs_in += routed
        publisher.msgs_in += routed
        publisher.bytes_in += size

    def publish_from_service(
        self, publisher: Subscriber | None, echo: bool, messages: Sequence[Message]
    ) -> None:
        """Messages a meshbus service here published on subjects, in order
        (meshbus.broker.nats.services): delivered as a client's are; ``publisher`` (the
        service's subscriptions, None without any) gets none of them back unless
        ``echo``."""
        self._publish_run(publisher, echo, None, messages)

    def _publish_run(
        self,
        publisher: Subscriber | None,
        echo: bool,
        requester: NatsConnection | None,
        messages: Sequence[Message],
    ) -> tuple[int, int]:
        """Route ``messages``, a plan per subject; a request that reached nobody is
        answered no responders when ``requester`` (the publisher) asked for it. How many
        were routed (all but those after the publisher closed), and their size."""
        table, to_meshbus = self._table, self._to_meshbus
        plan: _Plan | None = None
        routed = size = 0
        at, count = 0, len(messages)
        while at < count:
            if publisher is not None and publisher.closed:
                break
            message = messages[at]
            subject = message[0]
            if plan is None or plan.version != table.version or plan.subject != subject:
                interest = table.match(subject)
                plan = _taken_over(plan, subject, interest, table.version) or self._plan(
                    subject, interest, publisher, echo
                )
                plan.meshbus = self._reaches_meshbus(subject)
            if plan.in_runs and not plan.meshbus:
                # The messages that follow on the same subject go together.
                end = at + 1
                while end < count and messages[end][0] == subject:
                    end += 1
                run = messages[at:end]
                self._send_run(plan, run, requester)
                routed += end - at
                size += sum([len(message[3]) for message in run])
                at = end
                continue
            at += 1
            routed += 1
            size += len(message[3])
            delivered = self._send(plan, message)
            if plan.meshbus:
                delivered += to_meshbus(message)
            if not delivered and message[1] and requester is not None:
                self._no_responders(requester, message)
        return routed, size

    def _send_run(
        self, plan: _Plan, run: Sequence[Message], requester: NatsConnection | None
    ) -> None:
        """Messages on ``plan``'s subject where it says, together (``_Plan.in_runs``): a
        run for each subscription here, the rows for each peer; no responders for each
        request of ``requester``'s when there is neither."""
        local, peers = plan.local, plan.peers
        self._deliver_run(plan, run)
        if peers:
            rows: list[NatsRow] = [(s, r, h, d, True, _NO_QUEUES) for s, r, h, d in run]
            for peer in peers:
                self._peers.send(peer, rows)
        elif not local and requester is not None:
            for message in run:
                if message[1]:
                    self._no_responders(requester, message)

    def _deliver_run(self, plan: _Plan, run: Sequence[Message | NatsRow]) -> None:
        """The messages of ``run`` to each of ``plan``'s subscriptions here, in order."""
        subject = plan.subject
        for sub in plan.local:
            self.msgs_out += sub.conn.deliver_run(sub, subject, run)

    def route(
        self, event: Publish, publisher: NatsConnection | None = None, echo: bool = True
    ) -> int:
        """Deliver ``event`` to the subscriptions here and send it to the peers with an
        interest; how many subscriptions and peers it went to."""
        subject = event.subject
        message = (subject, event.reply, event.header_size, event.data)
        return self._send(self._plan(subject, self._table.match(subject), publisher, echo), message)

    def _plan(
        self,
        subject: bytes,
        interest: Interest[Subscription | PeerSubscription[Link]],
        publisher: Subscriber | None,
        echo: bool,
    ) -> _Plan:
        """Where a message on ``subject``, which matched ``interest``, goes, from
        ``publisher``: without echo, never to one of its own subscriptions (nor is one
        picked in a queue group)."""
        local: list[Subscription] = []
        peers: dict[Link, None] = {}
        services = False
        in_runs = True
        for sub in interest.plain:
            if isinstance(sub, PeerSubscription):
                peers[sub.peer] = None
            elif echo or sub.conn is not publisher:
                local.append(sub)
                services = services or type(sub) is ServiceSubscription
                in_runs = in_runs and sub.conn is not publisher
        if services:
            local = _one_per_service(local)
        groups: dict[bytes, _Group] = {}
        for name, members in interest.queues:
            eligible = [
                m
                for m in members
                if echo or isinstance(m, PeerSubscription) or m.conn is not publisher
            ]
            if eligible:
                groups[name] = _Group(eligible)
        in_runs = in_runs and not groups
        return _Plan(subject, interest, self._table.version, local, list(peers), groups, in_runs)

    def _send(self, plan: _Plan, message: Message) -> int:
        """``message`` where ``plan`` says; how many subscriptions and peers it went to."""
        subject, reply, header_size, data = message
        for sub in plan.local:
            sub.conn.deliver(sub, subject, reply, header_size, data)
        delivered = len(plan.local)
        picked: dict[Link, list[bytes]] | None = None
        if plan.groups:
            picked = {}
            delivered += self._pick_members(plan.groups, message, picked)
        self.msgs_out += delivered
        peers = plan.peers
        if picked:
            send = self._peers.send
            for peer in peers:
                send(peer, [(subject, reply, header_size, data, True, picked.pop(peer, []))])
            for peer, names in picked.items():
                send(peer, [(subject, reply, header_size, data, False, names)])
            return delivered + len(peers) + len(picked)
        if peers:
            # One row for every peer: rows are only ever encoded.
            rows: list[NatsRow] = [(subject, reply, header_size, data, True, _NO_QUEUES)]
            send = self._peers.send
            for peer in peers:
                send(peer, rows)
        return delivered + len(peers)

    def _pick_members(
        self, groups: dict[bytes, _Group], message: Message, picked: dict[Link, list[bytes]]
    ) -> int:
        """A member of each queue group: one here gets ``message`` now (how many did is
        returned), a peer's has the group's name added to its row in ``picked``."""
        subject, reply, header_size, data = message
        delivered = 0
        for name, group in groups.items():
            member = self._pick(group)
            if isinstance(member, PeerSubscription):
                picked.setdefault(member.peer, []).append(name)
            else:
                member.conn.deliver(member, subject, reply, header_size, data)
                delivered += 1
        return delivered

    def _pick(self, group: _Group) -> Subscription | PeerSubscription[Link]:
        """A member at random, a peer's weighted by its count of members."""
        members, weights = group.members, group.weights
        if weights is None:
            return members[self._rng.randrange(group.total)] if group.total > 1 else members[0]
        point = self._rng.randrange(group.total)
        for member, weight in zip(members, weights, strict=True):
            if point < weight:
                return member
            point -= weight
        raise AssertionError("a weighted pick past the total")

    def _no_responders(self, publisher: NatsConnection, message: Message) -> None:
        subject, reply = message[0], message[1]
        for sub in self._table.match(reply).plain:
            if not isinstance(sub, PeerSubscription) and sub.conn is publisher:
                self.no_responders += 1
                header = no_responders_header(subject)
                publisher.deliver(sub, reply, b"", len(header), header)
                return

    # -- from peer brokers ---------------------------------------------------------------

    def from_peer(self, link: Link, correlation: int, body: NatsMessages) -> None:
        """NATS_MSGS: messages a peer's clients published, for the clients here only."""
        table = self._table
        plan: _Plan | None = None
        # The rows for the plan's plain subscriptions, handed out before the plan changes
        # or a queue group's member gets a message.
        run: list[NatsRow] = []
        for row in body.msgs:
            subject, reply, header_size, data, plain, queues = row
            if plan is None or plan.version != table.version or plan.subject != subject:
                if run:
                    assert plan is not None
                    self._deliver_run(plan, run)
                    run = []
                # What would break a client's MSG line: a blank, an empty subject. A
                # subject with an empty token only matches nothing.
                if not subject or _BLANK(subject):
                    self._invalid(link)
                    plan = None
                    continue
                interest = table.match(subject)
                plan = _taken_over(plan, subject, interest, table.version) or self._plan_here(
                    subject, interest
                )
            if (
                (reply and _BLANK(reply))
                or header_size > len(data)
                or (queues and not all(is_valid_queue(q) for q in queues))
            ):
                self._invalid(link)
                continue
            self.from_peers += 1
            if plain and plan.local:
                run.append(row)
            if queues:
                if run:
                    self._deliver_run(plan, run)
                    run = []
                self._deliver_to_groups(plan, subject, reply, header_size, data, queues)
        if run:
            assert plan is not None
            self._deliver_run(plan, run)
        self.flushes.flush()

    def _invalid(self, link: Link) -> None:
        self.dropped_from_peers += 1
        if self.dropped_from_peers == 1:
            log.warning("an invalid NATS message from a peer", extra={"peer": link.name})

    def _plan_here(
        self, subject: bytes, interest: Interest[Subscription | PeerSubscription[Link]]
    ) -> _Plan:
        """Where a peer's message on ``subject``, which matched ``interest``, goes: the
        subscriptions here only."""
        local = _one_per_service(
            [sub for sub in interest.plain if not isinstance(sub, PeerSubscription)]
        )
        groups: dict[bytes, _Group] = {}
        for name, members in interest.queues:
            here: list[Subscription | PeerSubscription[Link]] = [
                m for m in members if not isinstance(m, PeerSubscription)
            ]
            if here:
                groups[name] = _Group(here)
        return _Plan(subject, interest, self._table.version, local, [], groups, True)

    def _deliver_to_groups(
        self,
        plan: _Plan,
        subject: bytes,
        reply: bytes,
        header_size: int,
        data: bytes,
        queues: list[bytes],
    ) -> None:
        """A peer's message to one member here of each of ``queues``."""
        for name in queues:
            group = plan.groups.get(name)
            if group is None:
                self.dropped_from_peers += 1  # its members here left while it was on its way
                continue
            member = self._pick(group)
            assert not isinstance(member, PeerSubscription)  # a plan here holds none
            member.conn.deliver(member, subject, reply, header_size, data)
            self.msgs_out += 1
