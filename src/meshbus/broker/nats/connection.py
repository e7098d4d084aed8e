"""One NATS client's connection: its parser, its subscriptions, its output, its pings.

Rules it keeps (nats-server's, docs/nats.md):

1. Everything a read brings is handled at once, in order, without awaiting; what it
   makes each connection send is queued and written once per connection at the end of
   the read (``Flushes``), as the broker's links do. A read that takes more than a slice
   (``slices.SLICE``) stops reading and goes on at the next loop turn, so one client's
   flood never holds the loop.
2. Output is bounded: past ``max_pending`` unsent bytes the client is a slow consumer
   and its connection is aborted -- nats-server says nothing to it either (the bytes
   it would read first are the ones it does not read).
3. The errors that close: a broken protocol (meshbus.protocol.nats says which get an
   ``-ERR`` first), ``Stale Connection`` (pings unanswered), a slow consumer. Those that
   do not: ``Invalid Subject`` for a SUB, ``maximum subscriptions exceeded``, ``Invalid
   Publish Subject`` for a pedantic client.
4. A subscription ends when its UNSUB comes, when it got the ``max_msgs`` an UNSUB
   gave it, or with its connection; it leaves the subject table then.
5. With TLS (the broker's --tls-cert) the INFO goes out in the clear and the client then
   starts TLS, as with nats-server; nothing else is written or read before the TLS
   handshake is done. A client that writes before it has the INFO (plain text, or a
   TLS-first ClientHello) is closed with ``-ERR 'Secure Connection - TLS Required'``.
6. On a broker with users the first operation must be a CONNECT that signs in
   (meshbus.broker.nats.auth): anything else, or wrong credentials, is ``-ERR
   'Authorization Violation'`` and close; nothing is read after the CONNECT until its
   password is checked (in a worker thread). TLS and the sign-in must be done within
   ``--handshake-timeout`` of the accept: ``-ERR 'Authentication Timeout'`` and close.
7. A signed-in client's PUB to a subject its user may not send to, or SUB to one it may
   not join, is ``-ERR 'Permissions Violation for Publish to "S"'`` (``... for
   Subscription to "S"``) and goes no further; the connection stays.
8. A PING after a SUB or UNSUB is answered once the whole mesh knows the change
   (``NatsInterest.after_known``), and every PING after it waits its turn: a client's
   ``flush()`` after ``subscribe()`` returns when a message published through any broker
   finds the subscription (docs/nats.md, "Across the mesh").
"""

from __future__ import annotations

import asyncio
import enum
import logging
import ssl
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol, cast

from meshbus.broker.core.slices import SLICE
from meshbus.broker.core.subjects import InvalidSubject, is_literal, is_valid_subject
from meshbus.protocol.nats import (
    OK,
    PING,
    PONG,
    Connect,
    ConnectOptions,
    Message,
    NatsEvent,
    NatsParser,
    NatsProtocolViolation,
    Ping,
    Pong,
    Publish,
    Subscribe,
    Unsubscribe,
    encode_err,
    encode_msgs,
)
from meshbus.tls import failure_reason

if TYPE_CHECKING:
    from meshbus.broker.nats.auth import NatsSignIn, SubjectPermissions
    from meshbus.broker.nats.interest import NatsInterest
    from meshbus.broker.nats.router import NatsRouter
    from meshbus.broker.security.users import User
    from meshbus.protocol.control import NatsRow

log = logging.getLogger("meshbus.broker.nats")

# Events handled between two looks at the clock.
_CLOCK_EVERY = 64
# PUBs taken from the parser at once by a client on the fast way: a run the router works
# through with one plan per subject (meshbus.broker.nats.router), and a look at the clock.
_RUN = 256


class NatsCloseReason(enum.Enum):
    """Why a NATS client's connection closed; logged."""

    CLIENT_CLOSED = "client-closed"
    PROTOCOL_VIOLATION = "protocol-violation"
    SLOW_CONSUMER = "slow-consumer"
    STALE_CONNECTION = "stale-connection"
    MAX_CONNECTIONS = "max-connections"
    SERVER_SHUTDOWN = "server-shutdown"
    AUTHORIZATION_VIOLATION = "authorization-violation"
    AUTHENTICATION_TIMEOUT = "authentication-timeout"
    TLS_HANDSHAKE_FAILED = "tls-handshake-failed"
    REVOKED = "revoked"


class NatsError(enum.Enum):
    """An ``-ERR`` that leaves the connection open (rule 3); counted by kind."""

    INVALID_SUBJECT = "invalid-subject"
    INVALID_PUBLISH_SUBJECT = "invalid-publish-subject"
    MAX_SUBSCRIPTIONS = "max-subscriptions"
    PERMISSIONS_VIOLATION = "permissions-violation"


AUTHORIZATION_VIOLATION = "Authorization Violation"


class Subscriber(Protocol):
    """Whom a subscription's messages are handed to: a NATS client's connection, or a
    meshbus service (meshbus.broker.nats.services)."""

    closed: bool

    def deliver(
        self, sub: Subscription, subject: bytes, reply: bytes, header_size: int, data: bytes
    ) -> None: ...

    def deliver_run(
        self, sub: Subscription, subject: bytes, messages: Sequence[Message | NatsRow]
    ) -> int: ...


class Subscription:
    """One SUB of one connection (or one subject subscription of a meshbus service): what
    the subject table holds. Compared by identity."""

    __slots__ = ("conn", "delivered", "max_msgs", "queue", "sid", "subject")

    def __init__(self, conn: Subscriber, subject: bytes, queue: bytes, sid: bytes) -> None:
        self.conn = conn
        self.subject = subject
        self.queue = queue
        self.sid = sid
        # Messages delivered, and the number after which it ends (0: none).
        self.delivered = 0
        self.max_msgs = 0


class Flushes:
    """The connections with output queued since the last flush: each is written once, at
    the end of the read that queued it (or of the timer's turn)."""

    def __init__(self) -> None:
        self._queued: list[NatsConnection] = []

    def add(self, conn: NatsConnection) -> None:
        self._queued.append(conn)

    def flush(self) -> None:
        queued, self._queued = self._queued, []
        for conn in queued:
            conn.flush()


class NatsConnection(asyncio.Protocol):
    """A NATS client's TCP connection, on the broker's loop."""

    def __init__(
        self,
        client_id: int,
        *,
        parser: NatsParser,
        table: NatsInterest,
        router: NatsRouter,
        flushes: Flushes,
        info: Callable[[NatsConnection], bytes],
        max_pending: int,
        max_subscriptions: int,
        on_open: Callable[[NatsConnection], None],
        on_close: Callable[[NatsConnection, NatsCloseReason], None],
        sign_in: NatsSignIn | None = None,
        spawn: Callable[[Coroutine[Any, Any, None], str], object] | None = None,
    ) -> None:
        """``info`` makes the INFO line this client is greeted with; ``on_open`` hears
        of the connection once it is greeted (and may close it: too many).
        ``sign_in`` says whether the client must sign in and upgrade to TLS, and checks
        its credentials (None: neither); ``spawn`` runs the connection's TLS handshake
        and password check as tasks of the listener's."""
        self.client_id = client_id
        self.host = ""
        self.remote = ""
        self.subs: dict[bytes, Subscription] = {}
        self.closed = False
        self.transport: asyncio.Transport | None = None
        # The user it signed in as, and what that user may do (None: anything).
        self.user: User | None = None
        self.permissions: SubjectPermissions | None = None
        # What an nkey signs: sent in the INFO of a broker with users.
        self.nonce = ""
        self._parser = parser
        self._table = table
        self._router = router
        self._flushes = flushes
        self._info = info
        self._sign_in = sign_in
        self._spawn = spawn
        self._max_pending = max_pending
        self._max_subscriptions = max_subscriptions
        self._on_open = on_open
        self._on_close = on_close
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._paused = False
        # Before its TLS handshake is done nothing is written; before it signed in the
        # first operation must be its CONNECT; while its password is checked nothing is
        # read.
        self._upgrading = False
        self._spoke_before_info = False
        self._awaiting_connect = False
        self._signing_in = False
        self._timer: asyncio.TimerHandle | None = None
        # A PUB can go straight to the router: no +OK, no pedantic check, no permissions.
        self._fast = False
        # Its CONNECT came (and signed in): it takes async INFOs from then on.
        self.connected = False
        # Pings sent without their PONG; whether the client sent anything since the
        # last ping tick.
        self._pings_out = 0
        self._heard = False
        # A SUB or UNSUB since the last PING; PONGs that wait for the mesh (rule 5).
        self._interest_changed = False
        self._pongs_owed = 0
        # What meshbus stat and /metrics show: its messages in (counted by the router)
        # and out, their sizes (headers and payload), the -ERRs that left it open.
        self.msgs_in = 0
        self.bytes_in = 0
        self.msgs_out = 0
        self.bytes_out = 0
        self.errors: Counter[NatsError] = Counter()

    @property
    def options(self) -> ConnectOptions:
        """The options of the client's CONNECT (nats-server's defaults before one)."""
        return self._parser.options

    # -- asyncio callbacks -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        # Unsent output past this is a slow consumer (pause_writing).
        self.transport.set_write_buffer_limits(high=self._max_pending, low=self._max_pending // 2)
        remote = transport.get_extra_info("peername")
        if remote:
            self.host, self.remote = remote[0], f"{remote[0]}:{remote[1]}"
        sign_in = self._sign_in
        if sign_in is not None and sign_in.required:
            self._awaiting_connect = True
            self.nonce = sign_in.new_nonce()
        tls = sign_in.tls if sign_in is not None else None
        info = self._info(self)
        if tls is None:
            self.transport.write(info)
        else:
            # The INFO goes out with TLS, in one step with start_tls's pause of the
            # reading (_start_tls): a client's ClientHello that came in between would be
            # read by this protocol and lost to the handshake, which then waited for its
            # timeout (uvloop reads as soon as connection_made returns).
            self._upgrading = True
        self._on_open(self)
        if self.closed or sign_in is None:
            return
        if sign_in.required or tls is not None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(sign_in.timeout, self._timed_out)
        if tls is not None:
            self._run(self._start_tls(tls, info), "nats-tls")

    def _run(self, work: Coroutine[Any, Any, None], name: str) -> None:
        assert self._spawn is not None, "a connection with a sign-in is given spawn"
        self._spawn(work, name)

    async def _start_tls(self, context: ssl.SSLContext, info: bytes) -> None:
        """The INFO, then the TLS handshake the client starts once it has read it; then
        the connection goes on over TLS. A failed one closes it, logged as one line. A
        client that spoke before the INFO does not do TLS: ``-ERR 'Secure Connection -
        TLS Required'`` and close, as from nats-server."""
        if self.closed:
            return
        if self._spoke_before_info:
            self._upgrading = False
            self.close(
                NatsCloseReason.TLS_HANDSHAKE_FAILED,
                "plain text before the INFO",
                "Secure Connection - TLS Required",
            )
            return
        transport = self.transport
        assert transport is not None
        loop = asyncio.get_running_loop()
        assert self._sign_in is not None
        transport.write(info)
        try:
            upgraded = await loop.start_tls(
                transport,
                self,
                context,
                server_side=True,
                ssl_handshake_timeout=self._sign_in.timeout,
            )
        except OSError as exc:  # ssl.SSLError, a reset, the handshake timeout
            if not self.closed:
                transport.abort()
                self._closed(NatsCloseReason.TLS_HANDSHAKE_FAILED, failure_reason(exc))
            return
        if upgraded is None or self.closed:
            return
        self.transport = upgraded
        upgraded.set_write_buffer_limits(high=self._max_pending, low=self._max_pending // 2)
        self._upgrading = False
        if self._sign_in.tls_verify and not upgraded.get_extra_info("peercert"):
            # nats-server fails such a handshake; the context here only asks for one.
            self.close(
                NatsCloseReason.TLS_HANDSHAKE_FAILED,
                "no client certificate (--tls-verify-clients)",
                "TLS Required",
            )
            return
        self.flush()

    def _certificate_name(self) -> str:
        """The common name of the client certificate its TLS handshake verified ('')."""
        cert = self.transport.get_extra_info("peercert") if self.transport else None
        for rdn in (cert or {}).get("subject", ()):
            for key, value in rdn:
                if key == "commonName":
                    return str(value)
        return ""

    def _timed_out(self) -> None:
        self._timer = None
        assert self._sign_in is not None
        if self._upgrading:
            self.close(NatsCloseReason.TLS_HANDSHAKE_FAILED, "no TLS handshake in time")
        elif self._awaiting_connect:
            self.close(
                NatsCloseReason.AUTHENTICATION_TIMEOUT,
                f"not signed in within {self._sign_in.timeout:g} s (--handshake-timeout)",
                "Authentication Timeout",
            )

    def data_received(self, data: bytes) -> None:
        if self._upgrading:
            # Read before start_tls took over: sent before the INFO (_start_tls).
            self._spoke_before_info = True
            return
        if self.closed:
            return  # bytes already in flight when it closed; none come before TLS
        self._heard = True
        self._parser.feed(data)
        self._process()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed(NatsCloseReason.CLIENT_CLOSED, str(exc) if exc else "closed by the client")

    def pause_writing(self) -> None:
        """Unsent output passed ``max_pending``: closed on the next loop turn, not inside
        ``write``."""
        asyncio.get_running_loop().call_soon(self._slow_consumer)

    def resume_writing(self) -> None:
        pass  # a connection that paused is already being closed

    # -- reading ------------------------------------------------------------------

    def _process(self) -> None:
        """Handle what has been read, up to a slice of the loop's time. A client on the
        fast way has its PUBs taken in runs, the common case; any other operation one at
        a time, in order."""
        parser = self._parser
        router = self._router
        deadline = perf_counter() + SLICE
        handled = 0
        try:
            while not (self.closed or self._signing_in):
                if self._fast:
                    run = parser.next_publishes(_RUN)
                    if run:
                        router.publish_many(self, run)
                        if perf_counter() > deadline:
                            self._later()
                            break
                        continue
                event = parser.next_event()
                if event is None:
                    if self._paused:
                        self._paused = False
                        assert self.transport is not None
                        self.transport.resume_reading()
                    break
                if type(event) is Publish and self._fast:
                    router.publish(self, event)
                else:
                    self._handle(event)
                handled += 1
                if handled % _CLOCK_EVERY == 0 and perf_counter() > deadline:
                    self._later()
                    break
        except NatsProtocolViolation as exc:
            self.close(NatsCloseReason.PROTOCOL_VIOLATION, str(exc), exc.error_text)
        self._flushes.flush()

    def _later(self) -> None:
        """The slice is used up: stop reading, go on at the next loop turn."""
        self._pause()
        asyncio.get_running_loop().call_soon(self._process)

    def _pause(self) -> None:
        if not self._paused:
            self._paused = True
            assert self.transport is not None
            self.transport.pause_reading()

    def _handle(self, event: NatsEvent) -> None:
        if self._awaiting_connect:
            if isinstance(event, Connect):
                self._sign_in_with(event)
            else:
                self._refuse("an operation before the CONNECT that signs in")
            return
        if type(event) is Publish:
            self._publish(event)
        elif isinstance(event, Subscribe):
            self._subscribe(event)
        elif isinstance(event, Unsubscribe):
            self._unsubscribe(event)
        elif isinstance(event, Ping):
            self._pong()
        elif isinstance(event, Pong):
            self._pings_out = 0
        elif isinstance(event, Connect):
            self._connected(event)

    def _connected(self, event: Connect) -> None:
        log.debug(
            "NATS client connected",
            extra={"client": self.client_id, "name": event.options.name,
                   "lang": event.options.lang, "remote": self.remote,
                   "user": self.user.name if self.user else None},
        )  # fmt: skip
        self.connected = True
        self.refresh()
        if event.options.verbose:
            self.queue(OK)

    def refresh(self) -> None:
        """Whether a PUB may take the fast way, after the options or permissions changed."""
        options = self._parser.options
        self._fast = not (
            options.verbose or options.pedantic or self.permissions or self._awaiting_connect
        )

    # -- signing in ----------------------------------------------------------------

    def _sign_in_with(self, event: Connect) -> None:
        """The first CONNECT of a client that must sign in: an nkey or a certificate is
        checked here, a password in the worker thread (reading waits for it)."""
        sign_in = self._sign_in
        assert sign_in is not None  # only a connection with a sign-in awaits its CONNECT
        user = sign_in.user_of(event.credentials, self.nonce, self._certificate_name())
        if user is not None:
            self._signed_in(user, event)
            return
        password = sign_in.password(event.credentials)
        if password is None:
            self._refuse("no credentials that sign in (user and pass, auth_token, or nkey)")
            return
        self._signing_in = True
        self._pause()
        self._run(self._check_password(sign_in, *password, event), "nats-sign-in")

    async def _check_password(
        self, sign_in: NatsSignIn, name: str, token: str, event: Connect
    ) -> None:
        user = await sign_in.check_password(name, token)
        if self.closed:
            return
        self._signing_in = False
        if user is None:
            self._refuse("a wrong user or password")
            return
        self._signed_in(user, event)
        self._process()

    def _signed_in(self, user: User, event: Connect) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._awaiting_connect = False
        self.user = user
        assert self._sign_in is not None
        self.permissions = self._sign_in.permissions_of(user)
        self._connected(event)

    def _refuse(self, why: str) -> None:
        self.close(NatsCloseReason.AUTHORIZATION_VIOLATION, why, AUTHORIZATION_VIOLATION)

    def reauthorize(self, permissions: SubjectPermissions | None) -> None:
        """The user's permissions after a SIGHUP; None: the user is gone, or its
        credential changed, and the connection is closed."""
        if permissions is None:
            self._refuse("its user was removed from the broker's config, or changed")
            self._flushes.flush()
            return
        self.permissions = permissions
        self.refresh()

    # -- operations ----------------------------------------------------------------

    def _publish(self, event: Publish) -> None:
        options = self._parser.options
        subject = event.subject
        if options.pedantic and not (is_valid_subject(subject) and is_literal(subject)):
            # nats-server says so, and delivers it all the same.
            self.errors[NatsError.INVALID_PUBLISH_SUBJECT] += 1
            self.queue(encode_err("Invalid Publish Subject"))
        permissions = self.permissions
        if permissions is not None and not permissions.may_publish(subject):
            self._violation(f"Publish to {_quoted(subject)}")
            return
        if options.verbose:
            self.queue(OK)  # before the message, as nats-server
        self._router.publish(self, event)

    def _violation(self, what: str) -> None:
        log.info(
            "NATS client refused",
            extra={"client": self.client_id, "remote": self.remote,
                   "user": self.user.name if self.user else None, "refused": what},
        )  # fmt: skip
        self.errors[NatsError.PERMISSIONS_VIOLATION] += 1
        self.queue(encode_err(f"Permissions Violation for {what}"))

    def _subscribe(self, event: Subscribe) -> None:
        permissions = self.permissions
        if permissions is not None and not permissions.may_subscribe(event.subject):
            queue = f" using queue {_quoted(event.queue)}" if event.queue else ""
            self._violation(f"Subscription to {_quoted(event.subject)}{queue}")
            return
        if event.sid not in self.subs:
            if len(self.subs) >= self._max_subscriptions:
                self.errors[NatsError.MAX_SUBSCRIPTIONS] += 1
                self.queue(encode_err("maximum subscriptions exceeded"))
                return
            sub = Subscription(self, event.subject, event.queue, event.sid)
            try:
                self._table.insert(event.subject, event.queue, sub)
            except InvalidSubject:
                self.errors[NatsError.INVALID_SUBJECT] += 1
                self.queue(encode_err("Invalid Subject"))
                return
            self.subs[event.sid] = sub
            self._interest_changed = True
        # A second SUB of a sid in use changes nothing (nats-server).
        if self._parser.options.verbose:
            self.queue(OK)

    def _unsubscribe(self, event: Unsubscribe) -> None:
        sub = self.subs.get(event.sid)
        if sub is not None:
            if event.max_msgs > sub.delivered:
                sub.max_msgs = event.max_msgs
            else:
                self.drop(sub)
        if self._parser.options.verbose:
            self.queue(OK)

    def drop(self, sub: Subscription) -> None:
        """End a subscription: out of the table and of this connection's."""
        if self.subs.pop(sub.sid, None) is sub:
            self._table.remove(sub.subject, sub.queue, sub)
            self._interest_changed = True

    def _pong(self) -> None:
        """Answer a PING: at once, unless a change of this client's interest, or a PONG
        before this one, waits for the mesh (rule 5)."""
        if not (self._interest_changed or self._pongs_owed):
            self.queue(PONG)
            return
        self._interest_changed = False
        self._pongs_owed += 1
        self._table.after_known(self._pong_owed)

    def _pong_owed(self) -> None:
        self._pongs_owed -= 1
        self.queue(PONG)
        self.flush()

    # -- writing ------------------------------------------------------------------

    def deliver(
        self, sub: Subscription, subject: bytes, reply: bytes, header_size: int, data: bytes
    ) -> None:
        """A published message for one of this connection's subscriptions (``data`` its
        header block, the first ``header_size`` bytes, and payload): as HMSG with the
        header block byte for byte when this client took headers, else as MSG with the
        payload alone (nats-server strips the headers for such a client). A message
        whose subject the user's ``join`` denies is dropped: a wildcard let it match."""
        self.deliver_run(sub, subject, ((subject, reply, header_size, data),))

    def deliver_run(
        self, sub: Subscription, subject: bytes, messages: Sequence[Message | NatsRow]
    ) -> int:
        """Messages on ``subject`` for one subscription, in order, each as ``deliver``
        hands one out, queued as one write: a run of a client's PUBs or of a peer's rows
        costs one encoding loop and one look at the output's bound, not one a message.
        Past the subscription's ``max_msgs`` none is delivered. How many were."""
        permissions = self.permissions
        if permissions is not None and not permissions.may_deliver(subject):
            return 0
        if sub.max_msgs:
            messages = messages[: max(sub.max_msgs - sub.delivered, 0)]
        count = len(messages)
        if not count:
            return 0
        sub.delivered += count
        self.msgs_out += count
        data, size = encode_msgs(subject, sub.sid, messages, self._parser.options.headers)
        self.bytes_out += size
        self.queue(data)
        if sub.max_msgs and sub.delivered >= sub.max_msgs:
            self.drop(sub)
        return count

    def queue(self, data: bytes) -> None:
        """Queue ``data``; it is written at the next flush."""
        if self.closed:
            return
        if not self._out:
            self._flushes.add(self)
        self._out.append(data)
        self._out_bytes += len(data)
        if self._out_bytes > self._max_pending:
            self._slow_consumer()

    def flush(self) -> None:
        if self._upgrading:
            return  # written once the TLS handshake is done
        if self._out and not self.closed:
            assert self.transport is not None
            self.transport.write(b"".join(self._out))
        self._out.clear()
        self._out_bytes = 0

    def ping(self, max_pings_out: int) -> None:
        """The ping timer's tick: a client heard from since the last tick needs no ping
        (nats-server); one that left ``max_pings_out`` pings unanswered is stale."""
        if self._heard:
            self._heard = False
            return
        if self._pings_out + 1 > max_pings_out:
            self.close(NatsCloseReason.STALE_CONNECTION, "pings unanswered", "Stale Connection")
            return
        self._pings_out += 1
        self.queue(PING)

    # -- closing -------------------------------------------------------------------

    def _slow_consumer(self) -> None:
        if self.closed:
            return
        why = f"more than {self._max_pending} bytes waiting to be written"
        transport = self.transport
        self._closed(NatsCloseReason.SLOW_CONSUMER, why)
        if transport is not None:
            transport.abort()

    def close(self, reason: NatsCloseReason, why: str, error_text: str | None = None) -> None:
        """Write what is queued, then ``-ERR '<error_text>'`` if given, then close."""
        if self.closed:
            return
        if error_text is not None:
            self.queue(encode_err(error_text))
        self.flush()
        transport = self.transport
        self._closed(reason, why)
        if transport is not None:
            transport.close()

    def _closed(self, reason: NatsCloseReason, why: str) -> None:
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._out.clear()
        for sub in self.subs.values():
            self._table.remove(sub.subject, sub.queue, sub)
        self.subs.clear()
        log.info(
            "NATS client connection closed",
            extra={"client": self.client_id, "remote": self.remote, "reason": reason.value,
                   "error": why, "user": self.user.name if self.user else None},
        )  # fmt: skip
        self._on_close(self, reason)


def _quoted(subject: bytes) -> str:
    """A subject in double quotes, as nats-server's errors write it (Go's %q)."""
    text = subject.decode("utf-8", "backslashreplace")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
