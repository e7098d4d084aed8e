"""Control frames from connectors: handshake, register/unregister, join/leave, stat, drain.

Every handler answers with exactly one frame carrying the request's correlation
id (OK, REGISTERED, STATS, PONG or ERROR), so the connector can match answers
to questions. Refusals that leave the link usable (address in use, unknown
control type) are ERROR frames with a non-fatal code; frames that make the link
untrustworthy raise FrameError and the link is closed by the hot path.

Every change to the routing table made here is announced to the peer brokers.
A REGISTER of a chosen address (a fixed id, or an address a connector brings
along after failover) must be granted by every peer first (a claim). Until the
mesh has answered, the link is blocked: nothing after the REGISTER is handled,
so a JOIN or a send from the new address pipelined behind it still finds it
registered.
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING

from meshbus.address import Address, Unicast, describe_address, server_name_bytes
from meshbus.broker.link import CloseReason, LinkState
from meshbus.broker.routing import RoutingError
from meshbus.protocol.codec import FrameError, describe
from meshbus.protocol.control import (
    OP_ADD,
    OP_JOIN,
    OP_LEAVE,
    OP_REMOVE,
    ROLE_BROKER,
    ROLE_CONNECTOR,
    ROLE_OPERATOR,
    AddressBody,
    Body,
    Drain,
    Empty,
    Error,
    Hello,
    Membership,
    Register,
    StatRequest,
    Stats,
    Welcome,
)
from meshbus.protocol.layout import MIN_MAX_FRAME, PROTOCOL_VERSION, ControlType, ErrorCode

if TYPE_CHECKING:
    from meshbus.broker.link import Link
    from meshbus.broker.server import Broker


# A claim that lost while nobody took the address is tried again, up to this many times,
# after a random pause of up to CLAIM_BACKOFF seconds times the attempt number.
CLAIM_ATTEMPTS = 6
CLAIM_BACKOFF = 0.01


class Refused(Exception):
    """A request the broker declines; answered with a non-fatal ERROR frame."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ControlHandler:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._correlation = 0  # of the request being handled
        self._ctype = 0

    def handle(self, link: Link, ctype: int, correlation: int, body: Body | None) -> None:
        handler = _HANDLERS.get(ControlType(ctype)) if ctype in _KNOWN else None
        if handler is None or body is None:
            self.broker.reply(
                link,
                ControlType.ERROR,
                Error(
                    code=ErrorCode.UNSUPPORTED_CONTROL,
                    message=f"{describe(ctype)} is not a request a broker accepts from a connector",
                ),
                correlation,
            )
            return
        self._correlation = correlation
        self._ctype = ctype
        try:
            answer_type, answer = handler(self, link, body)
        except Refused as exc:
            answer_type, answer = ControlType.ERROR, Error(code=exc.code, message=str(exc))
        if answer_type is not None:
            assert answer is not None
            changed = ctype in _CHANGES and answer_type is not ControlType.ERROR
            self._answer(link, answer_type, answer, correlation, changed)

    def _answer(
        self, link: Link, type_: ControlType, body: Body, correlation: int, changed: bool
    ) -> None:
        """Answer now -- before any frame routed by the change, so the connector knows the
        address or membership first -- and, for a connector that asked, send SYNCED with
        the same correlation once every peer has applied the change (meshbus.broker.sync)."""
        broker = self.broker
        broker.reply(link, type_, body, correlation)
        if not changed or not link.wants_synced:
            return
        if not broker.mesh.peers:
            broker.reply(link, ControlType.SYNCED, Empty(), correlation)
            return

        def synced() -> None:
            if link.state is LinkState.OPEN:
                broker.reply(link, ControlType.SYNCED, Empty(), correlation)
                broker.flush_outbox()

        broker.sync.after_confirmed(synced)

    def _hello(self, link: Link, body: Body) -> Answer:
        assert isinstance(body, Hello)
        if link.state is LinkState.OPEN:
            raise Refused(ErrorCode.ALREADY_HANDSHAKEN, "HELLO was already received on this link")
        if body.protocol != PROTOCOL_VERSION:
            raise FrameError(
                ErrorCode.UNSUPPORTED_VERSION,
                f"connector speaks protocol {body.protocol}; this broker speaks {PROTOCOL_VERSION}",
            )
        broker = self.broker
        mesh = broker.mesh
        if body.role == ROLE_BROKER:
            refused = mesh.accept_peer(link, body, self._correlation)
            if refused is not None:
                link.fail(ErrorCode(refused.code), refused.message, CloseReason.REFUSED)
            return None, None
        if body.role not in (ROLE_CONNECTOR, ROLE_OPERATOR):
            raise FrameError(ErrorCode.PROTOCOL_ERROR, f"unknown HELLO role {body.role!r}")
        link.operator = body.role == ROLE_OPERATOR
        # An operator asks about *this* broker, full, joining or draining as it may be.
        refusal = "" if link.operator else broker.refusal()
        if refusal:
            link.fail(ErrorCode.REDIRECT, refusal, CloseReason.REFUSED, redirect=broker.redirect())
            return None, None
        # Each side enforces the smaller of the two limits, so neither sends what the other
        # must refuse.
        link.max_frame = max(MIN_MAX_FRAME, min(body.max_frame, broker.config.max_frame))
        link.name = body.name
        link.session = body.session
        link.wants_synced = body.synced
        link.state = LinkState.OPEN
        if not link.operator:
            broker.connector_opened(link)
        return ControlType.WELCOME, Welcome(
            broker=broker.config.name,
            slot=broker.routing.slot,
            max_frame=link.max_frame,
            brokers=mesh.connector_list(),
            trace_every=broker.telemetry.trace_every,
        )

    def _register(self, link: Link, body: Body) -> Answer:
        assert isinstance(body, Register)
        if link.operator:
            raise Refused(
                ErrorCode.UNSUPPORTED_CONTROL,
                "an operator's link (meshbus stat, drain) cannot register services",
            )
        routing = self.broker.routing
        try:
            if body.instance == 0:
                address = routing.allocate_dynamic(
                    server_name_bytes(body.server), link, link.session
                )
                self.broker.sync.announce(OP_ADD, address, link.session)
                return ControlType.REGISTERED, AddressBody(address=address)
            wanted = Unicast(body.server, body.instance)
        except (ValueError, TypeError) as exc:
            raise Refused(ErrorCode.INVALID_ADDRESS, f"cannot register: {exc}") from None
        except RoutingError as exc:
            raise Refused(ErrorCode.INSTANCES_EXHAUSTED, str(exc)) from None
        raw = wanted.to_bytes()
        owned = routing.owner(raw) is not None
        if owned and not self._may_take(link, raw):
            raise _in_use(wanted)
        if not owned and self.broker.mesh.peers:
            # A free address: every peer must agree. The link waits (module docstring).
            link.block()
            self._claim(link, wanted, self._correlation, 1)
            return None, None
        # Free in a mesh of one, or the connector's own address coming back (it moved, or
        # failed over before this broker dropped it): no claim. A rival claim needs this
        # broker's grant too, and here the address is the session's, so it is refused.
        self._take(link, raw)
        return ControlType.REGISTERED, AddressBody(address=raw)

    def _claim(self, link: Link, wanted: Unicast, correlation: int, attempt: int) -> None:
        raw = wanted.to_bytes()
        routing = self.broker.routing
        owner = routing.owner(raw)
        claim = self.broker.sync.claim(
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
            return
        owner = self.broker.routing.owner(raw)
        if not granted and owner is None and attempt < CLAIM_ATTEMPTS:
            # Simultaneous claims can all lose (each arbiter granted another first); nobody
            # owns the address, so try again after a random pause: one of them gets there.
            loop.call_later(
                random.uniform(0, CLAIM_BACKOFF * attempt),
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
            self.broker.reply(
                link, ControlType.ERROR, Error(code=exc.code, message=str(exc)), correlation
            )
        self.broker.flush_outbox()
        loop.call_soon(link.unblock)

    def _may_take(self, link: Link, address: bytes) -> bool:
        """A connector may take over an address its own session registered (failover)."""
        routing = self.broker.routing
        return (
            routing.owner(address) is not link
            and bool(link.session)
            and routing.session_of(address) == link.session
        )

    def _take(self, link: Link, address: bytes) -> None:
        self.broker.routing.take_over(address, link, link.session)
        self.broker.sync.announce(OP_ADD, address, link.session)

    def _unregister(self, link: Link, body: Body) -> Answer:
        assert isinstance(body, AddressBody)
        self._check_owned(link, body.address, "unregister")
        self.broker.routing.remove_service(body.address, link)
        self.broker.sync.announce(OP_REMOVE, body.address)
        self.broker.guarantees.services_left([body.address])
        return ControlType.OK, Empty()

    def _join(self, link: Link, body: Body) -> Answer:
        assert isinstance(body, Membership)
        self._check_membership(link, body, "join")
        self.broker.routing.join(body.member, body.group)
        self.broker.sync.announce(OP_JOIN, body.member, body.group)
        return ControlType.OK, Empty()

    def _leave(self, link: Link, body: Body) -> Answer:
        assert isinstance(body, Membership)
        self._check_membership(link, body, "leave")
        self.broker.routing.leave(body.member, body.group)
        self.broker.sync.announce(OP_LEAVE, body.member, body.group)
        return ControlType.OK, Empty()

    def _stat(self, link: Link, body: Body) -> Answer:
        assert isinstance(body, StatRequest)
        return ControlType.STATS, Stats(data=self.broker.snapshot(detail=body.detail))

    def _ping(self, link: Link, body: Body) -> Answer:
        return ControlType.PONG, Empty()

    def _drain(self, link: Link, body: Body) -> Answer:
        """An operator asks for a drain; the broker drains and exits (as on SIGTERM)."""
        assert isinstance(body, Drain)
        self.broker.request_drain(body.grace or None, requested_by=link)
        return ControlType.OK, Empty()

    def _guarantee(self, link: Link, body: Body) -> Answer:
        """MEMBERS, GROUP_BIND, GROUP_END, WATCH, STREAM: answered (perhaps through another
        broker) by meshbus.broker.guarantees and meshbus.broker.streams."""
        self.broker.on_guarantee(link, self._ctype, self._correlation, body)
        return None, None

    def _bye(self, link: Link, body: Body) -> Answer:
        link.close(CloseReason.CLIENT_BYE)
        return None, None

    def _check_owned(self, link: Link, address: bytes, verb: str) -> None:
        if self.broker.routing.owner(address) is not link:
            raise Refused(
                ErrorCode.NOT_REGISTERED,
                f"cannot {verb} {describe_address(address)}: this connector has not registered it",
            )

    def _check_membership(self, link: Link, body: Membership, verb: str) -> None:
        self._check_owned(link, body.member, verb)
        try:
            group = Address.from_bytes(body.group)
        except ValueError as exc:
            raise Refused(ErrorCode.INVALID_ADDRESS, f"cannot {verb}: {exc}") from None
        if not group.is_group:
            raise Refused(
                ErrorCode.INVALID_ADDRESS,
                f"cannot {verb} {group}: only multicast and anycast addresses are groups",
            )


Answer = tuple[ControlType | None, Body | None]


def _in_use(wanted: Unicast) -> Refused:
    return Refused(
        ErrorCode.ADDRESS_IN_USE,
        f"address {wanted} is already registered by another service; "
        "pick another instance id or register without one for a dynamic id",
    )


_KNOWN = frozenset(int(t) for t in ControlType)
# Requests that change the routing table: a connector that asked gets SYNCED after them.
_CHANGES = frozenset(
    int(t)
    for t in (ControlType.REGISTER, ControlType.UNREGISTER, ControlType.JOIN, ControlType.LEAVE)
)

_HANDLERS = {
    ControlType.HELLO: ControlHandler._hello,
    ControlType.REGISTER: ControlHandler._register,
    ControlType.UNREGISTER: ControlHandler._unregister,
    ControlType.JOIN: ControlHandler._join,
    ControlType.LEAVE: ControlHandler._leave,
    ControlType.STAT: ControlHandler._stat,
    ControlType.PING: ControlHandler._ping,
    ControlType.BYE: ControlHandler._bye,
    ControlType.DRAIN: ControlHandler._drain,
    ControlType.MEMBERS: ControlHandler._guarantee,
    ControlType.GROUP_BIND: ControlHandler._guarantee,
    ControlType.GROUP_END: ControlHandler._guarantee,
    ControlType.WATCH: ControlHandler._guarantee,
    ControlType.STREAM: ControlHandler._guarantee,
    ControlType.TRACE: ControlHandler._guarantee,
}
