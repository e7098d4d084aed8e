"""Control frames from connectors and operators: HELLO, register/unregister, join/leave,
stat, ping, drain, bye. They reach these handlers through meshbus.broker.core.dispatch.

Every handler answers with exactly one frame carrying the request's correlation
id (OK, REGISTERED, STATS, PONG or ERROR), so the connector can match answers
to questions. Refusals that leave the link usable (address in use) raise
``Refused`` and become ERROR frames with a non-fatal code; frames that make the
link untrustworthy raise FrameError and the link is closed by the hot path.

Every change to the routing table made here is announced to the peer brokers.
A REGISTER of a chosen address (a fixed id, or an address a connector brings
along after failover) must be granted by every peer first (a claim). Until the
mesh has answered, the link is blocked: nothing after the REGISTER is handled,
so a JOIN or a send from the new address pipelined behind it still finds it
registered.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from meshbus.address import Address, Unicast, describe_address, server_name_bytes
from meshbus.broker.config import BrokerConfig
from meshbus.broker.core.dispatch import Refused
from meshbus.broker.core.endpoint import CloseReason, Endpoint, LinkState
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox
from meshbus.broker.core.registry import LinkRegistry
from meshbus.broker.core.routing import RoutingError, RoutingTable
from meshbus.broker.core.usage import UsageTable
from meshbus.broker.core.watch import ServiceWatch
from meshbus.broker.mesh.membership import Mesh
from meshbus.broker.mesh.sync import RouteSync
from meshbus.broker.security.quotas import CONNECTIONS, MEMBERSHIPS, SERVICES
from meshbus.broker.security.signin import SignIn, bound_session
from meshbus.broker.security.trust import MeshTrust
from meshbus.errors import FrameTooLarge
from meshbus.protocol.codec import ControlFrame, encode_control
from meshbus.protocol.control import (
    OP_ADD,
    OP_JOIN,
    OP_LEAVE,
    OP_REMOVE,
    ROLE_BROKER,
    ROLE_OPERATOR,
    AddressBody,
    Body,
    Bye,
    Drain,
    Empty,
    Error,
    Hello,
    Membership,
    Register,
    StatRequest,
    Stats,
    Welcome,
    owner_of,
)
from meshbus.protocol.handshake import AuthReceived, Challenged, negotiated_max_frame
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.util import BackgroundTasks

log = logging.getLogger("meshbus.broker")

# A claim that lost while nobody took the address is tried again, up to this many times,
# after a random pause of up to CLAIM_BACKOFF seconds times the attempt number.
CLAIM_ATTEMPTS = 6
CLAIM_BACKOFF = 0.01


# Room left in each STATS page for the frame header and the body's other fields.
_STATS_PAGE_ROOM = 1024


class ControlHandler:
    def __init__(
        self,
        *,
        config: BrokerConfig,
        routing: RoutingTable[Endpoint],
        sync: RouteSync,
        mesh: Mesh,
        links: LinkRegistry,
        watch: ServiceWatch,
        outbox: Outbox,
        sign_in: SignIn,
        usage: UsageTable,
        trust: MeshTrust,
        trace_every: int,
        snapshot: Callable[[], dict[str, Any]],
        detailed_snapshot: Callable[[], Awaitable[dict[str, Any]]],
        request_drain: Callable[[float | None], None],
        rng: random.Random,
    ) -> None:
        """``sign_in`` checks who connectors and operators are, when the broker has users;
        ``usage`` what each user holds, against its quotas; ``trust`` who peer brokers
        are, when the mesh trusts only its brokers;
        ``trace_every`` is what WELCOME tells connectors (telemetry); ``snapshot`` and
        ``detailed_snapshot`` answer STAT; ``request_drain`` starts a drain (as SIGTERM
        does)."""
        self._config = config
        self._routing = routing
        self._sync = sync
        self._mesh = mesh
        self._links = links
        self._watch = watch
        self._outbox = outbox
        self._sign_in = sign_in
        self._usage = usage
        self._trust = trust
        self._trace_every = trace_every
        self._snapshot = snapshot
        self._detailed_snapshot = detailed_snapshot
        self._request_drain = request_drain
        self._rng = rng
        self._tasks = BackgroundTasks()

    def _answer(
        self, link: Link, type_: ControlType, body: Body, correlation: int, changed: bool
    ) -> None:
        """Answer now -- before any frame routed by the change, so the connector knows the
        address or membership first -- and, for a connector that asked, send SYNCED with
        the same correlation once every peer has applied the change (meshbus.broker.mesh.sync)."""
        outbox = self._outbox
        outbox.reply(link, type_, body, correlation)
        if not changed or not link.wants_synced:
            return
        if not self._mesh.peers:
            # Known mesh-wide already; queued, not flushed, so a burst stays one write.
            outbox.reply(link, ControlType.SYNCED, Empty(), correlation)
            return

        def synced() -> None:
            if link.state is LinkState.OPEN:
                outbox.reply(link, ControlType.SYNCED, Empty(), correlation)
                outbox.flush()

        self._sync.after_confirmed(synced)

    # -- the handshake --------------------------------------------------------------

    def on_handshake(self, link: Link, frame: ControlFrame) -> None:
        """Every frame of a link that is still handshaking (meshbus.protocol.handshake
        rules on it; a FrameError it raises closes the link)."""
        if link.dialling is not None:
            answer = link.dialling.receive(frame)
            if isinstance(answer, Challenged):
                # The other broker proved itself (mesh trust): this one answers in kind.
                link.send(answer.reply)
                return
            self._mesh.on_answer(link, answer)
            return
        assert link.accepting is not None
        event = link.accepting.receive(frame)
        if isinstance(event, AuthReceived):
            if event.hello.role == ROLE_BROKER:
                self._check_peer(link, event)
            else:
                self._check_auth(link, event)
            return
        hello = event.hello
        if hello.role == ROLE_BROKER:
            if self._config.tls_ca and self._config.tls_cert and not link.shows_certificate():
                # A broker of this mesh shows its certificate when it dials (tls.dial_context);
                # one signed by another CA failed the TLS handshake already.
                self._refuse(
                    link,
                    ErrorCode.CERTIFICATE_REQUIRED,
                    "a peer broker must show a certificate signed by this broker's --tls-ca; "
                    "the TLS handshake showed none",
                )
                return
            if self._trust.on:
                self._challenge_peer(link, hello)
            else:
                self._accept_peer(link, hello)
            return
        if self._sign_in.required:
            # A client certificate that names a user (mutual TLS) has proved it already.
            user = self._sign_in.certificate_user(link.certificate_name())
            if user is not None:
                self._admit(link, hello, user)
                return
            # Nothing about the broker or the mesh goes out before the link signed in; the
            # handshake timeout still runs.
            link.send(link.accepting.challenge(self._sign_in.new_nonce()))
            return
        self._admit(link, hello, None)

    def _challenge_peer(self, link: Link, hello: Hello) -> None:
        """Mesh trust: this broker proves itself in its CHALLENGE, and nothing of the mesh
        goes out before the dialler proved itself too (the handshake timeout runs)."""
        refusal = self._trust.refusal(hello)
        if refusal:
            log.warning("peer refused", extra={"peer": hello.name, "remote": link.remote})
            self._refuse(link, ErrorCode.AUTH_FAILED, refusal)
            return
        assert link.accepting is not None
        proof = self._trust.proof(hello)
        nonce = self._sign_in.new_nonce()
        link.send(link.accepting.challenge(nonce, broker=self._config.name, proof=proof))

    def _check_peer(self, link: Link, event: AuthReceived) -> None:
        refusal = self._trust.auth_refusal(event)
        if refusal:
            log.warning("peer refused", extra={"peer": event.auth.user, "remote": link.remote})
            self._refuse(link, ErrorCode.AUTH_FAILED, refusal)
            return
        self._accept_peer(link, event.hello)

    def _accept_peer(self, link: Link, hello: Hello) -> None:
        """The duplicate-link rule and the WELCOME (broker/mesh/membership.py), or a refusal."""
        self._links.handshake_done(link)
        refused = self._mesh.accept_peer(link, hello)
        if refused is not None:
            self._refuse(link, ErrorCode(refused.code), refused.message)

    def _check_auth(self, link: Link, event: AuthReceived) -> None:
        self._signed_in(link, event, self._sign_in.check(event.auth, event.signed))

    def _signed_in(self, link: Link, event: AuthReceived, passed: bool) -> None:
        user = event.auth.user
        if passed:
            log.info("signed in", extra={"link": link.link_id, "user": user})
            self._admit(link, event.hello, user)
            return
        log.warning(
            "sign-in refused", extra={"link": link.link_id, "user": user, "remote": link.remote}
        )
        credential = "key" if event.auth.signature else "token"
        # The same words whether the user exists or not.
        self._refuse(
            link,
            ErrorCode.AUTH_FAILED,
            f"authentication failed: this broker does not accept the {credential} given for "
            f"user {user!r}; check the credentials file (credentials=, --creds, "
            "MESHBUS_CREDS) against the user's entry in the broker's config",
        )

    def _admit(self, link: Link, hello: Hello, user: str | None) -> None:
        """The HELLO of a connector or operator that signed in (``user``), or of any when the
        broker has no users: refused (limits, redirect) or WELCOMEd."""
        links = self._links
        links.handshake_done(link)
        operator = hello.role == ROLE_OPERATOR
        mesh = self._mesh
        permissions = self._sign_in.permissions_of(user)
        if operator and permissions is not None and not permissions.may_open_operator_link:
            self._refuse(
                link,
                ErrorCode.PERMISSION_DENIED,
                f"permission denied: user {user!r} may not open an operator link: it has no "
                "operator right (permissions.operator) and no stream permission "
                "(permissions.streams) in the broker's config",
            )
            return
        if operator and len(links.operators) >= self._config.max_operators:
            self._refuse(
                link,
                ErrorCode.LIMIT_EXCEEDED,
                f"limit exceeded: this broker already has {self._config.max_operators} "
                "operator links open (the broker's --max-operators); try again later",
            )
            return
        quota = "" if user is None else self._usage.refusal(user, CONNECTIONS)
        if quota:
            self._refuse(link, ErrorCode.LIMIT_EXCEEDED, quota)
            return
        # An operator asks about *this* broker, full, joining or draining as it may be.
        refusal = "" if operator else mesh.refusal(len(links.connectors))
        if refusal:
            self._refuse(link, ErrorCode.REDIRECT, refusal, mesh.redirect())
            return
        # Each side enforces the smaller of the two limits, so neither sends what the other
        # must refuse.
        max_frame = negotiated_max_frame(hello.max_frame, self._config.max_frame)
        # A signed-in connector's session is its user's: another user replaying it owns
        # none of its addresses.
        session = hello.session if user is None else bound_session(user, hello.session)
        if operator:
            link.open_as_operator(hello.name, max_frame, user, permissions)
            links.operator_opened(link)
        else:
            link.open_as_connector(
                hello.name,
                session,
                max_frame,
                hello.synced,
                hello.epoch,
                user,
                permissions,
                hello.batched_no_route,
            )
            links.connector_opened(link)
            mesh.gossip.changed()
        self._usage.link_opened(link)
        assert link.accepting is not None
        welcome = Welcome(
            broker=self._config.name,
            slot=self._routing.slot,
            max_frame=max_frame,
            brokers=mesh.gossip.connector_list(),
            trace_every=self._trace_every,
        )
        link.send(link.accepting.welcome(welcome))

    def _refuse(self, link: Link, code: ErrorCode, message: str, redirect: str = "") -> None:
        assert link.accepting is not None
        link.close_with(
            link.accepting.refuse(code, message, redirect), CloseReason.REFUSED, message
        )

    def on_second_hello(self, link: Link, correlation: int, body: Hello) -> None:
        raise Refused(ErrorCode.ALREADY_HANDSHAKEN, "HELLO was already received on this link")

    # -- services and groups ----------------------------------------------------------

    def on_register(self, link: Link, correlation: int, body: Register) -> None:
        routing = self._routing
        limit = self._config.max_services
        if routing.owned_count(link) >= limit:
            raise Refused(
                ErrorCode.LIMIT_EXCEEDED,
                f"limit exceeded: this connector already has {limit} services registered "
                "(the broker's --max-services); unregister some first",
            )
        self._usage.check(link, SERVICES)
        try:
            if body.instance == 0:
                address = routing.allocate_dynamic(
                    server_name_bytes(body.server), link, link.session, link.epoch
                )
                self._sync.announce(OP_ADD, address, owner_of(link.session, link.epoch))
                self._answer(
                    link, ControlType.REGISTERED, AddressBody(address=address), correlation, True
                )
                return
            wanted = Unicast(body.server, body.instance)
        except (ValueError, TypeError) as exc:
            raise Refused(ErrorCode.INVALID_ADDRESS, f"cannot register: {exc}") from None
        except RoutingError as exc:
            raise Refused(ErrorCode.INSTANCES_EXHAUSTED, str(exc)) from None
        raw = wanted.to_bytes()
        owned = routing.owner(raw) is not None
        if owned and not self._may_take(link, raw):
            raise _in_use(wanted)
        if not owned and self._mesh.peers:
            # A free address: every peer must agree. The link waits (module docstring).
            link.block()
            self._claim(link, wanted, correlation, 1)
            return
        # Free in a mesh of one, or the connector's own address coming back (it moved, or
        # failed over before this broker dropped it): no claim. A rival claim needs this
        # broker's grant too, and here the address is the session's, so it is refused.
        self._take(link, raw)
        self._answer(link, ControlType.REGISTERED, AddressBody(address=raw), correlation, True)

    def _claim(self, link: Link, wanted: Unicast, correlation: int, attempt: int) -> None:
        if link.state is not LinkState.OPEN:
            return  # left while waiting to try again
        raw = wanted.to_bytes()
        routing = self._routing
        owner = routing.owner(raw)
        claim = self._sync.claim(
            raw, link.session, None if owner is None else routing.session_of(raw)
        )
        claim.add_done_callback(
            lambda f: self._claimed(link, wanted, correlation, attempt, f.result())
        )

    def _claimed(
        self, link: Link, wanted: Unicast, correlation: int, attempt: int, granted: bool
    ) -> None:
        raw = wanted.to_bytes()
        loop = asyncio.get_running_loop()
        if link.state is not LinkState.OPEN:
            if granted:
                # Nobody will use it: without this the peers hold the address reserved,
                # and refuse it to everyone, until a broker link breaks.
                self._sync.give_back(raw)
            return
        owner = self._routing.owner(raw)
        if not granted and owner is None and attempt < CLAIM_ATTEMPTS:
            # Simultaneous claims can all lose (each arbiter granted another first); nobody
            # owns the address, so try again after a random pause: one of them gets there.
            loop.call_later(
                self._rng.uniform(0, CLAIM_BACKOFF * attempt),
                self._claim,
                link,
                wanted,
                correlation,
                attempt + 1,
            )
            return
        if granted and (owner is None or self._may_take(link, raw)):
            self._take(link, raw)
            self._answer(link, ControlType.REGISTERED, AddressBody(address=raw), correlation, True)
        else:
            exc = _in_use(wanted)
            self._outbox.reply(
                link, ControlType.ERROR, Error(code=exc.code, message=str(exc)), correlation
            )
        self._outbox.flush()
        loop.call_soon(link.unblock)

    def _may_take(self, link: Link, address: bytes) -> bool:
        """A connector may take over an address its own session registered (failover)."""
        routing = self._routing
        return (
            routing.owner(address) is not link
            and bool(link.session)
            and routing.session_of(address) == link.session
        )

    def _take(self, link: Link, address: bytes) -> None:
        self._routing.take_over(address, link, link.session, link.epoch)
        self._sync.announce(OP_ADD, address, owner_of(link.session, link.epoch))

    def on_unregister(self, link: Link, correlation: int, body: AddressBody) -> None:
        self._check_owned(link, body.address, "unregister")
        self._routing.remove_service(body.address, link)
        self._sync.announce(OP_REMOVE, body.address)
        self._watch.services_left([body.address])
        self._answer(link, ControlType.OK, Empty(), correlation, True)

    def on_join(self, link: Link, correlation: int, body: Membership) -> None:
        self._check_membership(link, body, "join")
        self._check_group_limits(link, body)
        self._routing.join(body.member, body.group)
        self._sync.announce(OP_JOIN, body.member, body.group)
        self._answer(link, ControlType.OK, Empty(), correlation, True)

    def on_leave(self, link: Link, correlation: int, body: Membership) -> None:
        self._check_membership(link, body, "leave")
        self._routing.leave(body.member, body.group)
        self._sync.announce(OP_LEAVE, body.member, body.group)
        self._answer(link, ControlType.OK, Empty(), correlation, True)

    # -- operations -------------------------------------------------------------------------

    def on_stat(self, link: Link, correlation: int, body: StatRequest) -> None:
        """The brief answer at once; the detailed one once built (in slices). An answer
        larger than the link's frame limit goes in pages, the rest kept on the link until
        the operator has asked for each (``StatRequest.page``)."""
        if body.page:
            self._stat_page(link, correlation, body.page)
        elif body.detail:
            self._tasks.spawn(self._answer_detailed(link, correlation), "stat")
        else:
            self._answer_stat(link, correlation, self._snapshot())

    async def stop(self) -> None:
        """Stop the answers still being built."""
        await self._tasks.cancel()

    async def _answer_detailed(self, link: Link, correlation: int) -> None:
        data = await self._detailed_snapshot()
        if not link.closed:
            self._answer_stat(link, correlation, data)
            self._outbox.flush()

    def _answer_stat(self, link: Link, correlation: int, data: dict[str, Any]) -> None:
        try:
            frame = encode_control(
                ControlType.STATS, Stats(data=data), correlation, max_frame=link.max_frame
            )
        except FrameTooLarge:
            blob = msgspec.msgpack.encode(data)
            size = link.max_frame - _STATS_PAGE_ROOM
            link.stat_pages = [blob[start : start + size] for start in range(0, len(blob), size)]
            self._stat_page(link, correlation, 0)
            return
        link.send(frame)

    def _stat_page(self, link: Link, correlation: int, page: int) -> None:
        pages = link.stat_pages
        if page >= len(pages):
            raise Refused(
                ErrorCode.UNAVAILABLE,
                f"no page {page} of a STATS answer here: ask for the answer first (page 0)",
            )
        body = Stats(page=page, pages=len(pages), blob=pages[page])
        if page == len(pages) - 1:
            link.stat_pages = []
        self._outbox.reply(link, ControlType.STATS, body, correlation)

    def on_ping(self, link: Link, correlation: int, body: Empty) -> None:
        self._outbox.reply(link, ControlType.PONG, Empty(), correlation)

    def on_drain(self, link: Link, correlation: int, body: Drain) -> None:
        """An operator asks for a drain; the broker drains and exits (as on SIGTERM)."""
        self._request_drain(body.grace or None)
        self._outbox.reply(link, ControlType.OK, Empty(), correlation)

    def on_bye(self, link: Link, correlation: int, body: Bye) -> None:
        link.close(CloseReason.CLIENT_BYE)

    def _check_owned(self, link: Link, address: bytes, verb: str) -> None:
        if self._routing.owner(address) is not link:
            raise Refused(
                ErrorCode.NOT_REGISTERED,
                f"cannot {verb} {describe_address(address)}: this connector has not registered it",
            )

    def _check_group_limits(self, link: Link, body: Membership) -> None:
        routing = self._routing
        if routing.is_member(body.member, body.group):
            return  # already a member: joining again changes nothing
        config = self._config
        if routing.group_count_of(body.member) >= config.max_groups_per_service:
            raise Refused(
                ErrorCode.LIMIT_EXCEEDED,
                f"limit exceeded: {describe_address(body.member)} is already in "
                f"{config.max_groups_per_service} groups "
                "(the broker's --max-groups-per-service); leave some first",
            )
        if routing.memberships_of(link) >= config.max_groups:
            raise Refused(
                ErrorCode.LIMIT_EXCEEDED,
                f"limit exceeded: this connector's services are already in {config.max_groups} "
                "groups in all (the broker's --max-groups); leave some first",
            )
        self._usage.check(link, MEMBERSHIPS)

    def _check_membership(self, link: Link, body: Membership, verb: str) -> None:
        self._check_owned(link, body.member, verb)
        try:
            group = Address.from_bytes_uncached(body.group)
        except ValueError as exc:
            raise Refused(ErrorCode.INVALID_ADDRESS, f"cannot {verb}: {exc}") from None
        if not group.is_group:
            raise Refused(
                ErrorCode.INVALID_ADDRESS,
                f"cannot {verb} {group}: only multicast and anycast addresses are groups",
            )


def _in_use(wanted: Unicast) -> Refused:
    return Refused(
        ErrorCode.ADDRESS_IN_USE,
        f"address {wanted} is already registered by another service; "
        "pick another instance id or register without one for a dynamic id",
    )
