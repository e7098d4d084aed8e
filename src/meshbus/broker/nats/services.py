"""Meshbus services on subjects: the subject layer's other kind of client (docs/nats.md,
"NATS and meshbus services").

A service subscribes to subject patterns (SUBSCRIBE, UNSUBSCRIBE: docs/protocol.md) and
publishes on subjects (a data frame to the ``SUBJECTS`` address, its subject in the
extension block). Both go through what the NATS clients use, so a Python service and a
NATS client share one topic space:

* A subscription is a row of the broker's subject table, beside the NATS clients' and the
  peers' (``ServiceSubscription``), counted and told to the peers as theirs are
  (``NatsInterest``); the SYNCED that follows its OK comes once every peer holds it, as
  the PONG after a NATS client's SUB does -- so ``await svc.subscribe()`` returns when a
  message published anywhere finds it.
* A message a service publishes is routed by the ``NatsRouter`` as a client's PUB: the
  subscriptions here, one row per peer with interest, a member per queue group, and
  meshbus's ``multicast:NAME`` members when the subject is a group name (the bridge).
  The forwarder hands this module the frames to ``SUBJECTS`` (the ``multicast_tap``), a
  run of them as one block, as the outbox hands the bridge its frames.
* A message for a service's subscription goes to its connector as a data frame to the
  service's address, from the bridge's address (``nats:<id>``: a subject has no meshbus
  sender), its subject and headers in the extension block. A service gets a message once,
  however many of its patterns match (the router keeps one subscription per service).

What a service may do is its connector's user's permissions read for subjects, as a NATS
client's are (``SubjectPermissions``): subscribing takes ``join``, publishing ``send``, to
``multicast:SUBJECT``. Every field from the wire is checked before it touches the table
(a valid pattern and queue group, a literal subject to publish on, the service the
link's own), and a connector's subscriptions are bounded (``--max-subjects``). A refused
SUBSCRIBE is an ERROR for that request alone; a refused publish is dropped and counted
(another connector's bytes cannot close a link).

A service's subscriptions end when it unsubscribes, unregisters (``service_left``), its
link closes (``link_closed``), or its address is found owned by another link (its
connector moved it to another broker: at the next message for it); its connector
subscribes again on the broker it fails over or moves to, as it joins its groups again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshbus.broker.core.dispatch import Refused
from meshbus.broker.core.endpoint import Endpoint
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox
from meshbus.broker.core.routing import RoutingTable
from meshbus.broker.core.subjects import InvalidSubject
from meshbus.broker.nats.auth import SubjectPermissions
from meshbus.broker.nats.bridge import FrameSink
from meshbus.broker.nats.connection import Subscriber, Subscription
from meshbus.broker.nats.interest import NatsInterest
from meshbus.errors import FrameTooLarge, ProtocolError
from meshbus.protocol import ext
from meshbus.protocol.codec import encode_data
from meshbus.protocol.control import Body, Empty, NatsRow, SubjectInterest
from meshbus.protocol.headers import MAX_HEADER_BYTES
from meshbus.protocol.layout import (
    DATA_HEADER,
    FLAG_ECHO,
    FLAG_EXT,
    LENGTH_SIZE,
    ControlType,
    ErrorCode,
)
from meshbus.protocol.nats import Message
from meshbus.protocol.subjects import MAX_SUBJECT, is_literal, is_valid_queue, is_valid_subject

__all__ = ["ServiceSubjects", "ServiceSubscriber", "ServiceSubscription", "SubjectStats"]

log = logging.getLogger("meshbus.broker.nats")

_unpack_header = DATA_HEADER.unpack_from
_HEADER_SIZE = DATA_HEADER.size
_BLOCKS_CACHED = 1024

# answer(link, type, body, correlation, changed): the OK now, SYNCED once the mesh knows
# (meshbus.broker.handlers.services.ServiceCommands.answer).
Answer = Callable[[Link, ControlType, Body, int, bool], None]
# publish(publisher, echo, messages): the router's publish_from_service.
Publish = Callable[[Subscriber | None, bool, Sequence[Message]], None]


@dataclass
class SubjectStats:
    published: int = 0  # messages services here published on subjects
    delivered: int = 0  # messages handed to services here
    dropped: int = 0  # publishes refused (a bad subject or block, permissions), too large


class ServiceSubscription(Subscription):
    """A service's subscription to a subject pattern; its ``conn`` is the service's
    ``ServiceSubscriber``, its ``sid`` empty."""

    __slots__ = ()


class ServiceSubscriber:
    """One service here with subject subscriptions: where their messages go."""

    __slots__ = ("_deliver", "address", "closed", "link", "subs")

    def __init__(
        self,
        address: bytes,
        link: Link,
        deliver: Callable[[ServiceSubscriber, bytes, int, bytes], None],
    ) -> None:
        self.address = address
        self.link = link
        self.closed = False
        self.subs: dict[tuple[bytes, bytes], ServiceSubscription] = {}
        self._deliver = deliver

    def deliver(
        self, sub: Subscription, subject: bytes, reply: bytes, header_size: int, data: bytes
    ) -> None:
        """A message for one of its subscriptions (the reply subject of a NATS request is
        not carried: a service answers no NATS request through a subscription)."""
        self._deliver(self, subject, header_size, data)

    def deliver_run(
        self, sub: Subscription, subject: bytes, messages: Sequence[Message | NatsRow]
    ) -> int:
        """Messages on one subject for one of its subscriptions, in order; how many."""
        for message in messages:
            self._deliver(self, subject, message[2], message[3])
        return len(messages)


class ServiceSubjects:
    """Services' subject subscriptions and publishes (module docstring)."""

    def __init__(
        self,
        *,
        max_subjects: int,
        routing: RoutingTable[Endpoint],
        interest: NatsInterest,
        outbox: Outbox,
        answer: Answer,
        publish: Publish,
        flush_nats: Callable[[], None],
        source: Callable[[], bytes],
    ) -> None:
        """``answer`` answers a SUBSCRIBE or UNSUBSCRIBE (and sends SYNCED);
        ``publish`` routes services' messages as a client's (the router's);
        ``flush_nats`` writes what that queued for NATS clients here; ``source`` is the
        bridge's address, the sender of what services receive (b"" before the broker has
        a slot)."""
        self._max_subjects = max_subjects
        self._routing = routing
        self._interest = interest
        self._outbox = outbox
        self._answer = answer
        self._publish = publish
        self._flush_nats = flush_nats
        self._source = source
        self.endpoint = FrameSink("subjects", self._from_services)
        self._services: dict[bytes, ServiceSubscriber] = {}
        self._by_link: dict[Link, dict[bytes, ServiceSubscriber]] = {}
        self._counts: dict[Link, int] = {}
        self._permissions: dict[Link, SubjectPermissions] = {}
        # subject -> the extension block of a message on it without headers (bounded).
        self._blocks: dict[bytes, bytes] = {}
        # The last subject a service published on that passed the checks, and for whom.
        self._checked: tuple[bytes, bytes] = (b"", b"")
        self.stats = SubjectStats()

    @property
    def subscriptions(self) -> int:
        """The subject subscriptions services here hold."""
        return sum(self._counts.values())

    # -- SUBSCRIBE and UNSUBSCRIBE ---------------------------------------------------

    def on_subscribe(self, link: Link, correlation: int, body: SubjectInterest) -> None:
        subject, queue = body.subject, body.queue
        self._check(link, body, "subscribe")
        permissions = self._subject_permissions(link)
        if permissions is not None and not permissions.may_subscribe(subject):
            raise Refused(
                ErrorCode.PERMISSION_DENIED,
                permissions.denial(f"subscribe to {_shown(subject)}", "join"),
            )
        subscriber = self._subscriber(link, body.member)
        if (subject, queue) not in subscriber.subs:
            if self._counts.get(link, 0) >= self._max_subjects:
                raise Refused(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"limit exceeded: this connector's services already hold "
                    f"{self._max_subjects} subject subscriptions (the broker's "
                    "--max-subjects); unsubscribe some first",
                )
            sub = ServiceSubscription(subscriber, subject, queue, b"")
            try:
                self._interest.insert(subject, queue, sub)
            except InvalidSubject as exc:
                raise Refused(ErrorCode.INVALID_SUBJECT, f"cannot subscribe: {exc}") from None
            subscriber.subs[subject, queue] = sub
            self._counts[link] = self._counts.get(link, 0) + 1
        self._answer(link, ControlType.OK, Empty(), correlation, True)

    def on_unsubscribe(self, link: Link, correlation: int, body: SubjectInterest) -> None:
        self._check(link, body, "unsubscribe")
        subscriber = self._services.get(body.member)
        if subscriber is not None and subscriber.link is link:
            sub = subscriber.subs.pop((body.subject, body.queue), None)
            if sub is not None:
                self._remove(subscriber, sub)
                if not subscriber.subs:
                    self._forget(subscriber)
        self._answer(link, ControlType.OK, Empty(), correlation, True)

    def _check(self, link: Link, body: SubjectInterest, verb: str) -> None:
        """The request names a service of this link, a valid pattern and queue group."""
        if self._routing.owner(body.member) is not link:
            raise Refused(
                ErrorCode.NOT_REGISTERED,
                f"cannot {verb}: this connector has not registered the service it names",
            )
        if not is_valid_subject(body.subject):
            raise Refused(
                ErrorCode.INVALID_SUBJECT,
                f"cannot {verb}: {_shown(body.subject)} is no valid subject (tokens "
                "separated by '.', none empty, no whitespace, '>' only last)",
            )
        if body.queue and not is_valid_queue(body.queue):
            raise Refused(
                ErrorCode.INVALID_SUBJECT,
                f"cannot {verb}: queue group {body.queue[:64]!r} has whitespace in it",
            )

    def _subscriber(self, link: Link, address: bytes) -> ServiceSubscriber:
        subscriber = self._services.get(address)
        if subscriber is not None and subscriber.link is not link:
            # The service came back on a new link of its connector (it failed over to
            # this broker again before the old link was found closed): it starts afresh.
            self._drop(subscriber)
            subscriber = None
        if subscriber is None:
            subscriber = ServiceSubscriber(address, link, self._deliver)
            self._services[address] = subscriber
            self._by_link.setdefault(link, {})[address] = subscriber
        return subscriber

    def _subject_permissions(self, link: Link) -> SubjectPermissions | None:
        """The link's user's permissions read for subjects (None: anything), made again
        when a reload gave the link new ones."""
        permissions = link.permissions
        if permissions is None:
            return None
        known = self._permissions.get(link)
        if known is None or not known.reads(permissions):
            known = self._permissions[link] = SubjectPermissions(permissions)
        return known

    # -- services and links that go ---------------------------------------------------

    def service_left(self, link: Link, address: bytes) -> None:
        """``address`` unregistered: its subscriptions end."""
        subscriber = self._services.get(address)
        if subscriber is not None and subscriber.link is link:
            self._drop(subscriber)

    def link_closed(self, link: Link) -> None:
        """Every subscription of ``link``'s services ends."""
        self._permissions.pop(link, None)
        for subscriber in list(self._by_link.get(link, {}).values()):
            self._drop(subscriber)

    def _drop(self, subscriber: ServiceSubscriber) -> None:
        for sub in subscriber.subs.values():
            self._remove(subscriber, sub)
        subscriber.subs.clear()
        self._forget(subscriber)

    def _remove(self, subscriber: ServiceSubscriber, sub: ServiceSubscription) -> None:
        self._interest.remove(sub.subject, sub.queue, sub)
        link = subscriber.link
        count = self._counts[link] - 1
        if count:
            self._counts[link] = count
        else:
            del self._counts[link]

    def _forget(self, subscriber: ServiceSubscriber) -> None:
        subscriber.closed = True
        del self._services[subscriber.address]
        of_link = self._by_link[subscriber.link]
        del of_link[subscriber.address]
        if not of_link:
            del self._by_link[subscriber.link]

    # -- messages to services -----------------------------------------------------------

    def _deliver(
        self, subscriber: ServiceSubscriber, subject: bytes, header_size: int, data: bytes
    ) -> None:
        link = subscriber.link
        if self._routing.owner(subscriber.address) is not link:
            # Its connector took it to another broker (a move, a failover this broker has
            # not noticed yet), where it subscribed again: its subscriptions here end, as
            # its group memberships did with the take-over.
            self._drop(subscriber)
            return
        source = self._source()
        if not source or len(subject) > MAX_SUBJECT or header_size > MAX_HEADER_BYTES:
            self.stats.dropped += 1  # no extension block can carry it
            return
        if header_size:
            block = ext.prefix(ext.Ext(subject=subject, headers=data[:header_size]))
        else:
            # A subject's messages mostly come in runs: its block is made once.
            cached = self._blocks.get(subject)
            if cached is None:
                if len(self._blocks) >= _BLOCKS_CACHED:
                    self._blocks.clear()
                cached = self._blocks[subject] = ext.prefix(ext.Ext(subject=subject))
            block = cached
        try:
            frame = encode_data(
                subscriber.address, source, block + data[header_size:],
                flags=FLAG_EXT, max_frame=link.max_frame,
            )  # fmt: skip
        except FrameTooLarge:
            self.stats.dropped += 1
            return
        self._outbox.deliver(link, frame)
        self.stats.delivered += 1
        self._outbox.flush_soon()  # a NATS client's read or a peer's frame has no flush

    # -- messages from services -------------------------------------------------------

    def _from_services(self, data: bytes) -> None:
        """The frames services here sent to ``SUBJECTS`` in one read: routed in runs of
        one sender's, each message as a NATS client's PUB."""
        self._checked = (b"", b"")
        run: list[Message] = []
        run_src = b""
        run_echo = False
        pos, end = 0, len(data)
        while pos < end:
            length = int.from_bytes(data[pos : pos + LENGTH_SIZE], "big")
            frame_end = pos + LENGTH_SIZE + length
            (_, _, _, flags, _, _, src, _, _, _, _) = _unpack_header(data, pos)
            message = self._message(src, flags, data[pos + _HEADER_SIZE : frame_end])
            pos = frame_end
            if message is None:
                continue
            echo = bool(flags & FLAG_ECHO)
            if run and (src != run_src or echo != run_echo):
                self._publish_run(run_src, run_echo, run)
                run = []
            run_src, run_echo = src, echo
            run.append(message)
        if run:
            self._publish_run(run_src, run_echo, run)
        self._flush_nats()
        # Now, inside the flush of the read that brought them, so that what they queued
        # for connectors leaves ahead of that read's later frames to the same links (a
        # publish, then a request to a subscriber: in that order).
        self._outbox.flush()

    def _message(self, src: bytes, flags: int, payload: bytes) -> Message | None:
        """The message of one frame; None, counted, for a frame no connector of this
        version sends (no block, no literal subject) or one its user may not send."""
        if not flags & FLAG_EXT:
            return self._refused(src, "a message to subjects without an extension block")
        try:
            block, payload = ext.split(payload)
        except ProtocolError as exc:
            return self._refused(src, str(exc))
        subject = block.subject
        if self._checked != (src, subject):
            # Checked once for a run of one service's messages on one subject (a read's
            # frames are routed before anything can change who owns the service).
            if not (is_valid_subject(subject) and is_literal(subject)):
                return self._refused(src, f"a message to {_shown(subject)}, no literal subject")
            owner = self._routing.owner(src)
            if not isinstance(owner, Link):
                return self._refused(src, "a message from a service that left")
            permissions = self._subject_permissions(owner)
            if permissions is not None and not permissions.may_publish(subject):
                return self._refused(
                    src, f"{permissions.user!r} may not publish to {_shown(subject)}"
                )
            self._checked = (src, subject)
        headers = block.headers
        return (subject, b"", len(headers), headers + payload if headers else payload)

    def _refused(self, src: bytes, why: str) -> Message | None:
        """None: the frame of ``src`` is dropped (counted, the first one logged)."""
        self.stats.dropped += 1
        if self.stats.dropped == 1:
            log.warning("a message to subjects dropped", extra={"src": src.hex(), "why": why})
        return None

    def _publish_run(self, src: bytes, echo: bool, run: list[Message]) -> None:
        self.stats.published += len(run)
        self._publish(self._services.get(src), echo, run)


def _shown(subject: bytes) -> str:
    """A subject in an error message: as text, cut to a readable length."""
    text = subject[:64].decode("utf-8", "backslashreplace")
    return f"subject {text!r}" + ("..." if len(subject) > 64 else "")
