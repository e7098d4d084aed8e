"""Services and groups: REGISTER, UNREGISTER, JOIN and LEAVE from connectors. They reach
these handlers through meshbus.broker.core.dispatch.

Every handler answers with exactly one frame carrying the request's correlation id
(REGISTERED, OK or ERROR), so the connector can match answers to questions. Refusals
that leave the link usable (address in use, a limit) raise ``Refused`` and become ERROR
frames with a non-fatal code.

Every change to the routing table made here is announced to the peer brokers, and a
connector that asked for it (HELLO ``synced``) hears SYNCED once every peer applied it.
A REGISTER of a chosen address (a fixed id, or an address a connector brings along after
failover) must be granted by every peer first (a claim). Until the mesh has answered,
the link is blocked: nothing after the REGISTER is handled, so a JOIN or a send from the
new address pipelined behind it still finds it registered.

What it touches: the routing table, route sync (announcements, claims, confirmations),
the peers (whether there are any), the watchers of services leaving, and the limits --
the config's per-connector ones and the users' quotas (docs/architecture.md §7).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from meshbus.address import Address, Unicast, describe_address, server_name_bytes
from meshbus.broker.config import BrokerConfig
from meshbus.broker.core.dispatch import Refused
from meshbus.broker.core.endpoint import Endpoint, LinkState
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox
from meshbus.broker.core.registry import Peers
from meshbus.broker.core.reserved import RESERVED_SERVERS
from meshbus.broker.core.routing import RoutingError, RoutingTable
from meshbus.broker.core.usage import UsageTable
from meshbus.broker.core.watch import ServiceWatch
from meshbus.broker.mesh.sync import RouteSync
from meshbus.broker.security.quotas import MEMBERSHIPS, SERVICES
from meshbus.protocol.control import (
    OP_ADD,
    OP_JOIN,
    OP_LEAVE,
    OP_REMOVE,
    AddressBody,
    Body,
    Empty,
    Error,
    Membership,
    Register,
    owner_of,
)
from meshbus.protocol.layout import ControlType, ErrorCode

# A claim that lost while nobody took the address is tried again, up to this many times,
# after a random pause of up to CLAIM_BACKOFF seconds times the attempt number.
CLAIM_ATTEMPTS = 6
CLAIM_BACKOFF = 0.01


class ServiceCommands:
    def __init__(
        self,
        *,
        config: BrokerConfig,
        routing: RoutingTable[Endpoint],
        sync: RouteSync,
        peers: Peers,
        watch: ServiceWatch,
        outbox: Outbox,
        usage: UsageTable,
        rng: random.Random,
        service_left: Callable[[Link, bytes], None] = lambda link, address: None,
    ) -> None:
        """``usage`` is what each user holds, against its quotas; ``rng`` draws the pause
        before a lost claim is tried again; ``service_left`` hears of each service
        unregistered (its subject subscriptions end: meshbus.broker.nats.services)."""
        self._config = config
        self._routing = routing
        self._sync = sync
        self._peers = peers
        self._watch = watch
        self._outbox = outbox
        self._usage = usage
        self._rng = rng
        self._service_left = service_left

    def answer(
        self, link: Link, type_: ControlType, body: Body, correlation: int, changed: bool
    ) -> None:
        """Answer now -- before any frame routed by the change, so the connector knows the
        address or membership first -- and, for a connector that asked, send SYNCED with
        the same correlation once every peer has applied the change (meshbus.broker.mesh.sync)."""
        outbox = self._outbox
        outbox.reply(link, type_, body, correlation)
        if not changed or not link.wants_synced:
            return
        if not self._peers:
            # Known mesh-wide already; queued, not flushed, so a burst stays one write.
            outbox.reply(link, ControlType.SYNCED, Empty(), correlation)
            return

        def synced() -> None:
            if link.state is LinkState.OPEN:
                outbox.reply(link, ControlType.SYNCED, Empty(), correlation)

        self._sync.after_confirmed(synced)

    def on_register(self, link: Link, correlation: int, body: Register) -> None:
        routing = self._routing
        limit = self._config.max_services
        if routing.owned_count(link) >= limit:
            raise Refused(
                ErrorCode.LIMIT_EXCEEDED,
                f"limit exceeded: this connector already has {limit} services registered "
                "(the broker's --max-services); unregister some first",
            )
        self._usage.check(link.user, SERVICES)
        try:
            server = server_name_bytes(body.server)
            if server in RESERVED_SERVERS:
                raise Refused(
                    ErrorCode.INVALID_ADDRESS,
                    f"cannot register: the server name {body.server!r} is the broker's own "
                    "(streams' members and the NATS bridge); choose another name",
                )
            if body.instance == 0:
                address = routing.allocate_dynamic(server, link, link.session, link.epoch)
                self._sync.announce(OP_ADD, address, owner_of(link.session, link.epoch))
                self.answer(
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
        if not owned and self._peers:
            # A free address: every peer must agree. The link waits (module docstring).
            link.block()
            self._claim(link, wanted, correlation, 1)
            return
        # Free in a mesh of one, or the connector's own address coming back (it moved, or
        # failed over before this broker dropped it): no claim. A rival claim needs this
        # broker's grant too, and here the address is the session's, so it is refused.
        self._take(link, raw)
        self.answer(link, ControlType.REGISTERED, AddressBody(address=raw), correlation, True)

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
            self.answer(link, ControlType.REGISTERED, AddressBody(address=raw), correlation, True)
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
        self._service_left(link, body.address)
        self.answer(link, ControlType.OK, Empty(), correlation, True)

    def on_join(self, link: Link, correlation: int, body: Membership) -> None:
        self._check_membership(link, body, "join")
        self._check_group_limits(link, body)
        self._routing.join(body.member, body.group)
        self._sync.announce(OP_JOIN, body.member, body.group)
        self.answer(link, ControlType.OK, Empty(), correlation, True)

    def on_leave(self, link: Link, correlation: int, body: Membership) -> None:
        self._check_membership(link, body, "leave")
        self._routing.leave(body.member, body.group)
        self._sync.announce(OP_LEAVE, body.member, body.group)
        self.answer(link, ControlType.OK, Empty(), correlation, True)

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
        self._usage.check(link.user, MEMBERSHIPS)

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
