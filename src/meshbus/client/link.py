"""One TCP link from a connector to a broker, and the state of the connector's links.

``BrokerLink`` turns bytes into frames and hands each to the part that reads it. A
link starts with the handshake (meshbus.protocol.handshake): the broker answers the
HELLO -- after a CHALLENGE, which the link answers with the handshake's AUTH, when the
broker has users -- and ``welcomed`` gets the outcome, Welcomed or HelloRefused, or
ConnectionLost when the link closes first. After that, data frames and the
answers to requests go to the inbound dispatcher (meshbus.client.inbound); what the
broker says to the link itself before it closes it (an ERROR, a BYE) the link keeps,
to say why it was lost; news for the keeper (BROKERS, MOVE) goes to the keeper.

``Links`` is which link the connector sends on, the links it is leaving, and
whether it may send at all. A connector normally has one link. While it moves to
another broker it has two for a moment: the new one carries everything it sends,
the old one is read until the old broker closes it, so nothing already routed to it
is lost.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Collection
from typing import Final, Protocol, cast

from meshbus.errors import ConnectionLost, MeshbusError, NotConnected, ProtocolError, TLSError
from meshbus.protocol.codec import ControlFrame, DataFrame, FrameDecoder
from meshbus.protocol.control import Bye, Error
from meshbus.protocol.handshake import Challenged, DiallingHandshake, HelloRefused, Welcomed
from meshbus.protocol.layout import ControlType
from meshbus.tls import handshake_error

log = logging.getLogger("meshbus.client")

# Writes are gathered and handed to the socket once per loop turn, or as soon as this
# many bytes wait: one syscall for a burst of sends instead of one per frame, while a
# sender that never yields still reaches the transport (and its write pausing) often.
_FLUSH_BYTES: Final = 1 << 16


class FrameReader(Protocol):
    """Where a link's frames go once it is open (meshbus.client.inbound.Inbound)."""

    def on_data(self, frame: DataFrame) -> None: ...

    def on_control(self, link: BrokerLink, frame: ControlFrame) -> bool:
        """True if it took the frame; the link handles the rest."""
        ...


class BrokerLink(asyncio.Protocol):
    """One link to one broker. ``full_inboxes`` is the connector's set of services whose
    inbox is full: while it is not empty, the link hands out no frame and reads nothing."""

    def __init__(
        self,
        address: str,
        handshake: DiallingHandshake,
        *,
        max_frame: int,
        reader: FrameReader,
        full_inboxes: Collection[object],
        on_news: Callable[[BrokerLink, ControlFrame], None],
        on_lost: Callable[[BrokerLink, ConnectionLost], None],
        on_writable: Callable[[], None],
    ) -> None:
        self.address = address
        self.broker_name = ""
        self.transport: asyncio.Transport | None = None
        self.tls = False  # the link is TLS (known once connected)
        self.closed = False
        self.error = ""  # what the broker said before it closed the link (ERROR, BYE)
        self.heard_at = 0.0
        self.write_paused = False
        self._loop = asyncio.get_running_loop()
        self.welcomed: asyncio.Future[Welcomed | HelloRefused] = self._loop.create_future()
        self._gone: asyncio.Future[None] = self._loop.create_future()  # connection_lost
        self._handshake: DiallingHandshake | None = handshake  # None once answered
        self._decoder = FrameDecoder(max_frame)
        self._decoded: list[DataFrame | ControlFrame] = []  # see dispatch
        self._handed = 0
        self._reader = reader
        self._full_inboxes = full_inboxes
        self._on_news = on_news
        self._on_lost = on_lost
        self._on_writable = on_writable
        self._out: list[bytes] = []
        self._out_bytes = 0

    def __repr__(self) -> str:
        return f"<BrokerLink {self.broker_name or '?'} at {self.address}>"

    # -- asyncio callbacks ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.tls = transport.get_extra_info("sslcontext") is not None
        self.heard_at = self._loop.time()
        if self._full_inboxes:
            self.transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        self.heard_at = self._loop.time()
        try:
            self._decoder.feed(data)
        except ProtocolError as exc:
            self._protocol_error(exc)
            return
        self.dispatch()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self._gone.done():
            self._gone.set_result(None)
        reason = self.error or (str(exc) if exc else "the broker closed the connection")
        error = ConnectionLost(
            f"lost the link to broker {self.broker_name or self.address}: {reason}"
        )
        if not self.welcomed.done():
            self.welcomed.set_exception(error if self.error else self._unanswered(exc))
            # Read now: a dial cancelled while it connected (a failover's deadline)
            # leaves nobody to await it, and asyncio would log it as never retrieved.
            # One that awaits it still gets it.
            self.welcomed.exception()
        self._on_lost(self, error)

    def _unanswered(self, exc: Exception | None) -> MeshbusError:
        """The link closed before the broker answered HELLO, without a word: most likely
        a TLS setting the two ends do not share."""
        if isinstance(exc, ssl.SSLError):
            return handshake_error(exc, self.address)
        if self.tls:
            return TLSError(
                f"broker {self.address} closed the link right after the TLS handshake, "
                "before answering HELLO; it may have refused this client's certificate "
                "(with --tls-verify-clients it must be signed by the broker's --tls-ca "
                "and be valid)"
            )
        return ConnectionLost(
            f"broker {self.address} closed the link during the handshake, before answering "
            "HELLO; it may require TLS: connect with tls=... (on the command line "
            "--tls-ca FILE)"
        )

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._on_writable()

    # -- frames ----------------------------------------------------------------------

    def dispatch(self) -> None:
        """Hand out the frames read, stopping while an inbox is full: the rest wait (decoded,
        or in the decoder), so an inbox never holds more than ``max_inbox`` messages.

        The decoder decodes what one read brought in one pass; the frames it gave and
        this link has not handed out yet are ``_decoded[_handed:]``. A handler may call
        ``dispatch`` again (a drained inbox does): each frame is counted as handed out
        before it is."""
        full = self._full_inboxes
        reader = self._reader
        try:
            while not full:
                decoded = self._decoded
                handed = self._handed
                if handed == len(decoded):
                    decoded = self._decoded = self._decoder.frames()
                    handed = self._handed = 0
                    if not decoded:
                        return
                frame = decoded[handed]
                self._handed = handed + 1
                if self._handshake is not None:
                    if not self._answered(self._handshake.receive(frame)):
                        return
                elif isinstance(frame, DataFrame):
                    reader.on_data(frame)
                elif not reader.on_control(self, frame):
                    self._notice(frame)
        except ProtocolError as exc:
            self._protocol_error(exc)

    def _answered(self, outcome: Welcomed | HelloRefused | Challenged) -> bool:
        """The broker answered the HELLO (or the AUTH); True if the link is open, or still
        handshaking after answering the broker's CHALLENGE."""
        if isinstance(outcome, Challenged):
            self.write(outcome.reply)
            return True
        self._handshake = None
        if isinstance(outcome, Welcomed):
            self.broker_name = outcome.welcome.broker
        else:
            self.error = outcome.message  # the broker closes the link next
        if not self.welcomed.done():
            self.welcomed.set_result(outcome)
        return isinstance(outcome, Welcomed)

    def _notice(self, frame: ControlFrame) -> None:
        """A frame nobody waited for: what the broker says before it closes the link,
        or news for the keeper."""
        body = frame.body
        if isinstance(body, Error):
            self.error = body.message
            log.warning(
                "broker %s sent an error: %s (code %s)",
                self.broker_name or self.address,
                body.message,
                body.code,
                extra={"code": body.code, "error": body.message},
            )
        elif frame.type == ControlType.BYE and isinstance(body, Bye):
            self.error = f"the broker said goodbye: {body.reason}"
        else:
            self._on_news(self, frame)

    def _protocol_error(self, exc: ProtocolError) -> None:
        log.warning(
            "broker %s broke the protocol: %s",
            self.broker_name or self.address,
            exc,
            extra={"error": str(exc)},
        )
        self.abort(f"the broker sent an invalid frame: {exc}")

    # -- writing ---------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        out = self._out
        out.append(data)
        self._out_bytes += len(data)
        if self._out_bytes >= _FLUSH_BYTES:
            self.flush()
        elif len(out) == 1:
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Hand what was written to the socket."""
        if not self._out:
            return
        data = b"".join(self._out) if len(self._out) > 1 else self._out[0]
        self._out.clear()
        self._out_bytes = 0
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    @property
    def writable(self) -> bool:
        """The socket takes bytes (not closed, not closing)."""
        return self.transport is not None and not self.transport.is_closing()

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        self.flush()
        if self.transport is not None:
            self.transport.close()

    def abort(self, why: str = "") -> None:
        """Close the link at once, dropping what is not sent; ``why`` becomes the reason
        it was lost."""
        if why:
            self.error = why
        self.closed = True
        self._out.clear()
        if self.transport is not None:
            self.transport.abort()

    async def gone(self, grace: float) -> None:
        """Return once the transport is gone, aborting it past ``grace`` seconds.

        Closing a TLS link sends its close_notify and waits for the broker's: a loop
        ended meanwhile (``asyncio.run`` returning right after ``close()``) finds the
        socket still open, which uvloop refuses with EBUSY."""
        if self.transport is None:
            return  # never connected: nothing to wait for
        try:
            async with asyncio.timeout(grace):
                await asyncio.shield(self._gone)
        except TimeoutError:
            self.transport.abort()
            await self._gone


class Links:
    """Which link the connector sends on (``current``), the links it is leaving after a
    move (``old``), and whether it may send: ``connected`` is clear while it fails
    over, ``closed`` once it ended -- ``lost`` then says why, if the mesh was lost
    rather than the connector closed. ``max_frame`` is the frame size limit in force:
    the smallest that any broker agreed to so far. Its state changes only through the
    methods below: the keeper's (``take_over``, ``failing_over``, ``leaving``,
    ``left``, ``agreed``) and the connector's end (``end``)."""

    def __init__(self, max_frame: int) -> None:
        self.current: BrokerLink | None = None
        self.old: set[BrokerLink] = set()
        self.connected = asyncio.Event()
        self.closed = False
        self.lost: ConnectionLost | None = None
        self.max_frame = max_frame

    def take_over(self, link: BrokerLink) -> None:
        """Send on ``link`` from now on (connected, failed over or moved)."""
        self.current = link
        self.connected.set()

    def failing_over(self) -> None:
        """The current link is lost: senders wait until another takes over."""
        self.connected.clear()

    def leaving(self, link: BrokerLink) -> None:
        """``link`` is being left after a move: read until its broker closes it."""
        self.old.add(link)

    def left(self, link: BrokerLink) -> bool:
        """``link`` closed; True if it was one being left (the move is over)."""
        if link in self.old:
            self.old.discard(link)
            return True
        return False

    def agreed(self, max_frame: int) -> None:
        """A broker agreed to this frame size limit: the smallest so far holds."""
        self.max_frame = min(self.max_frame, max_frame)

    def end(self, lost: ConnectionLost | None) -> None:
        """The connector ended: closed by the user, or (``lost``) the mesh was lost.
        Senders waiting out a failover wake up, and raise."""
        self.closed = True
        if lost is not None:
            self.lost = lost
        self.connected.set()

    def all(self) -> list[BrokerLink]:
        return [link for link in (self.current, *self.old) if link is not None]

    def check_usable(self) -> None:
        """ConnectionLost if the mesh was lost, NotConnected if the connector is closed."""
        if self.lost is not None:
            raise self.lost
        if self.closed or self.current is None:
            raise NotConnected("the connector is closed")

    async def usable(self) -> BrokerLink:
        """The link to send on; waits while the connector fails over."""
        self.check_usable()
        if not self.connected.is_set():
            await self.connected.wait()
            self.check_usable()
        assert self.current is not None
        return self.current

    def sendable(self) -> BrokerLink | None:
        """The link a frame may go out on right now, without waiting: None while the
        connector fails over or after it ended (the frame is not sent)."""
        link = self.current
        if self.closed or link is None or link.closed or not self.connected.is_set():
            return None
        return link
