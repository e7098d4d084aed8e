"""Requests that wait for an answer: control requests to the broker, data requests to services.

``ask`` sends a control request (REGISTER, JOIN, STAT, MEMBERS, STREAM, ...) and
returns the body of its answer, of the type the caller expects; an ERROR answer
becomes the matching MeshbusError, and an answer of another type is the broker
breaking the protocol. A broker that is alive and does not answer within
``request_timeout`` raises ``Timeout`` (a dead one is the keepalive's to find).

``request`` sends a data frame with the REQUEST flag and waits for the RESPONSE,
or for the broker's TIMEOUT or NO_ROUTE; a local guard of the deadline plus a
second covers a broker that died or stalled, so a request never hangs.

``patiently`` asks until a deadline while the answer is "not now" (ERROR TRY_AGAIN,
a link lost to a failover, a broker slow to answer): a condition of the mesh that
passes in a moment is not the application's to handle.

The waiting itself -- the futures, and failing them when their link is lost -- is
``Waiters``' (meshbus.client.waiters).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from meshbus.address import Address
from meshbus.client.link import BrokerLink, Links
from meshbus.client.message import Message
from meshbus.client.outbound import Outbound
from meshbus.client.waiters import Waiters
from meshbus.errors import (
    AddressInUse,
    ConnectionLost,
    InvalidArgument,
    MeshbusError,
    NoRoute,
    PermissionDenied,
    ProtocolError,
    RegistrationError,
    RemoteProtocolError,
    StreamError,
    StreamExists,
    Timeout,
    TryAgain,
)
from meshbus.protocol.codec import (
    BytesLike,
    ControlFrame,
    describe,
    encode_control_raw,
    encode_data,
)
from meshbus.protocol.control import Body, Error, encode_in_bounds
from meshbus.protocol.ext import Ext, wrap
from meshbus.protocol.layout import (
    DEFAULT_MAX_FRAME,
    FATAL_ERRORS,
    FLAG_EXT,
    FLAG_REQUEST,
    ControlType,
    ErrorCode,
)

B = TypeVar("B", bound=Body)
T = TypeVar("T")

# How long after a request's deadline the client gives up on the broker's TIMEOUT frame.
_LOCAL_TIMEOUT_GRACE = 1.0
# ``patiently``: the first wait before asking again, doubled after each answer up to the
# cap, and each wait drawn from its upper half -- the senders of many groups homed at one
# lost broker do not ask in step. A crashed broker's groups get a home again within about
# 2 s (docs/mesh.md, "One group, one member"), so the cap keeps a send at most 0.5 s late.
_ASK_AGAIN_FIRST = 0.05
_ASK_AGAIN_MAX = 0.5


class Requester:
    def __init__(
        self,
        links: Links,
        outbound: Outbound,
        waiters: Waiters,
        request_timeout: float,
        rng: random.Random,
    ) -> None:
        self._links = links
        self._outbound = outbound
        self._waiters = waiters
        self._request_timeout = request_timeout
        self._rng = rng  # the pauses of ``patiently``
        self._next_correlation = 1

    async def ask(
        self,
        type_: ControlType,
        body: Body,
        answer: type[B],
        subject: str = "",
        *,
        link: BrokerLink | None = None,
        synced: asyncio.Future[ControlFrame] | None = None,
    ) -> B:
        """Send a control request and return its answer's body, an ``answer``.

        Without ``link`` it goes to the current broker (waiting out a failover). With
        ``synced``, that future gets the SYNCED frame that follows a change's answer.
        ``subject`` names what the request is about, for the error messages."""
        return await self.ask_and_apply(
            type_, body, answer, _itself, subject, link=link, synced=synced
        )

    async def ask_and_apply(
        self,
        type_: ControlType,
        body: Body,
        answer: type[B],
        apply: Callable[[B], T],
        subject: str = "",
        *,
        link: BrokerLink | None = None,
        synced: asyncio.Future[ControlFrame] | None = None,
    ) -> T:
        """``ask``, and return what ``apply`` makes of the answer's body.

        ``apply`` runs as the answer is read, before any frame that came behind it: the
        service a REGISTER answer makes, or the membership a JOIN answer confirms, is in
        place for the first message the broker routes to it."""
        correlation = self._next_correlation
        self._next_correlation = correlation % 0xFFFFFFFF + 1
        try:
            # A number the broker's decoder would refuse costs the link (PROTOCOL_ERROR):
            # refused here instead, as the caller's mistake.
            raw = encode_in_bounds(type_, body)
        except (OverflowError, ValueError) as exc:  # msgpack: integers of at most 64 bits
            raise InvalidArgument(f"a number in the {describe(type_)} request: {exc}") from exc
        request = encode_control_raw(int(type_), raw, correlation, max_frame=DEFAULT_MAX_FRAME)
        if link is None:
            link = await self._links.usable()
        if synced is not None:
            self._waiters.expect_synced(correlation, link, synced)
        address = link.address

        def settle(frame: ControlFrame) -> T:
            reply = frame.body
            if isinstance(reply, Error):
                if synced is not None:
                    synced.cancel()  # no change, so no SYNCED
                raise _error_from(reply, type_, subject)
            if not isinstance(reply, answer):
                raise ProtocolError(
                    f"broker {address} answered {describe(type_)} with {describe(frame.type)}"
                )
            return apply(reply)

        limit = self._request_timeout
        with self._waiters.answer(correlation, link, settle) as future:
            if link.closed:
                future.set_exception(ConnectionLost(f"the link to {address} is closed"))
            else:
                link.write(request)
            try:
                # A dead broker is the keepalive's to find; this is for one that is alive
                # and does not answer (a relay that went wrong, a bug): never wait forever.
                async with asyncio.timeout(limit or None):
                    return await future
            except TimeoutError:
                raise Timeout(
                    f"broker {address} did not answer {describe(type_)}"
                    + (f" for {subject}" if subject else "")
                    + f" within {limit} s (connect(request_timeout=...))",
                    limit,
                ) from None

    async def patiently(
        self, ask: Callable[[], Awaitable[T]], deadline: float, limit: float, what: str
    ) -> T:
        """What ``ask`` returns, asked again while the broker cannot answer now:
        ``TryAgain``, a ``ConnectionLost`` while the connector fails over (each ask waits
        for the new link), or a ``Timeout`` of a broker slow to answer. A permanent answer
        (no member, permission denied) or the connector's end raises at once.

        ``deadline`` is on the loop's clock, ``limit`` the seconds it stands for; when it
        passes, ``Timeout`` says what ``what`` was waiting for and the last reason."""
        wait = _ASK_AGAIN_FIRST
        reason: MeshbusError | None = None
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    try:
                        return await ask()
                    except (TryAgain, ConnectionLost, Timeout) as exc:
                        self._links.check_usable()  # the mesh was lost for good, or closed
                        reason = exc
                    await asyncio.sleep(self._rng.uniform(wait / 2, wait))
                    wait = min(2 * wait, _ASK_AGAIN_MAX)
        except TimeoutError:
            error = Timeout(
                f"{what} within {limit:g} s (send(timeout=...)): "
                + (str(reason) if reason else "the broker did not answer"),
                limit,
            )
            # `raise error from reason`, spelled out: compiled by mypyc, that form left
            # __cause__ None here (tests/integration/test_send_retry.py caught it).
            error.__cause__ = reason
            error.__suppress_context__ = True
            raise error  # noqa: B904 (the cause is set above)

    async def request(
        self, src: bytes, dst: Address, payload: BytesLike, timeout_ms: int, headers: bytes = b""
    ) -> Message:
        """Send a request from ``src`` and wait for its response; ``headers``: a header
        block (meshbus.protocol.headers), carried in an extension block."""
        links = self._links
        link = links.current
        if link is None or links.closed or not links.connected.is_set():
            link = await links.usable()
        msg_id = self._outbound.new_msg_id()
        flags = FLAG_REQUEST
        if headers:
            payload, flags = wrap(Ext(headers=headers), payload), FLAG_REQUEST | FLAG_EXT
        frame = encode_data(
            dst.to_bytes(),
            src,
            payload,
            msg_id=msg_id,
            flags=flags,
            timeout_ms=timeout_ms,
            max_frame=links.max_frame,
        )
        timeout = timeout_ms / 1000
        key = (src, msg_id)
        loop = asyncio.get_running_loop()
        future = self._waiters.expect_response(key, link, loop)
        # The broker sends TIMEOUT at the deadline; this local guard covers a broker that
        # died or stalled, so a request can never hang. A plain timer that fails the
        # future: no cancellation of the caller's task is involved (asyncio.timeout's
        # bookkeeping cost more than the rest of a request's client side).
        guard = loop.call_later(timeout + _LOCAL_TIMEOUT_GRACE, _give_up, future, dst, timeout)
        try:
            link.write(frame)
            return await future
        except Timeout as exc:  # the broker's TIMEOUT, or the guard's
            exc.timeout = timeout
            raise
        finally:
            guard.cancel()
            self._waiters.forget_response(key)


def _give_up(future: asyncio.Future[Message], dst: Address, timeout: float) -> None:
    if not future.done():
        future.set_exception(Timeout(f"no response from {dst} within {timeout} s", timeout))


def _error_from(body: Error, request: ControlType, subject: str) -> MeshbusError:
    code = body.code
    if code == ErrorCode.ADDRESS_IN_USE:
        return AddressInUse(body.message, subject, code)
    if code in FATAL_ERRORS:
        return RemoteProtocolError(code, body.message)
    if code == ErrorCode.PERMISSION_DENIED:
        return PermissionDenied(body.message)
    if request == ControlType.STREAM and code == ErrorCode.STREAM_EXISTS:
        return StreamExists(body.message, code)
    if request == ControlType.STREAM:
        return StreamError(body.message, code)
    if code == ErrorCode.TRY_AGAIN:
        return TryAgain(body.message)
    if request == ControlType.GROUP_BIND and code == ErrorCode.UNAVAILABLE:
        return NoRoute(body.message)
    return RegistrationError(f"{request.name.lower()} refused: {body.message}", code)


def _itself(body: B) -> B:
    return body
