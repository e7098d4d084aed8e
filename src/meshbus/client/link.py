"""One TCP link from a connector to a broker: bytes in, frames handed to the connector.

A link starts with the handshake (meshbus.protocol.handshake): the first frame
from the broker answers the HELLO, and ``welcomed`` gets the outcome -- Welcomed
or Refused -- or ConnectionLost when the link closes first. Frames behind the
WELCOME are the connector's, as is everything after.

A connector normally has one link. While it moves to another broker it has two
for a moment: the new one carries everything it sends, the old one is read
until the old broker closes it, so nothing already routed to it is lost.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, cast

from meshbus.client.inbound import on_control, on_data
from meshbus.errors import ConnectionLost, ProtocolError
from meshbus.protocol.codec import DataFrame, FrameDecoder
from meshbus.protocol.handshake import (
    DiallingHandshake,
    HandshakeState,
    Refused,
    Welcomed,
)

# Writes are gathered and handed to the socket once per loop turn, or as soon as this
# many bytes wait: one syscall for a burst of sends instead of one per frame, while a
# sender that never yields still reaches the transport (and its write pausing) often.
_FLUSH_BYTES = 1 << 16

if TYPE_CHECKING:
    from meshbus.client.connector import Connector


class BrokerLink(asyncio.Protocol):
    def __init__(
        self, connector: Connector, address: str, max_frame: int, handshake: DiallingHandshake
    ) -> None:
        self.connector = connector
        self.address = address
        self.broker_name = ""
        self.transport: asyncio.Transport | None = None
        self.decoder = FrameDecoder(max_frame)
        self.closed = False
        self.error = ""  # what the broker said before it closed the link (ERROR, BYE)
        self.heard_at = 0.0
        self.write_paused = False
        self._handshake = handshake
        self._loop = asyncio.get_running_loop()
        self.welcomed: asyncio.Future[Welcomed | Refused] = self._loop.create_future()
        self.lost: asyncio.Future[None] = self._loop.create_future()
        self._out: list[bytes] = []
        self._out_bytes = 0

    def __repr__(self) -> str:
        return f"<BrokerLink {self.broker_name or '?'} at {self.address}>"

    # -- asyncio callbacks ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.heard_at = asyncio.get_running_loop().time()
        if self.connector._full_inboxes:
            self.transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        self.heard_at = asyncio.get_running_loop().time()
        try:
            self.decoder.feed(data)
        except ProtocolError as exc:
            self.connector._protocol_error(self, exc)
            return
        self.dispatch()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.lost.done():
            self.lost.set_result(None)
        reason = self.error or (str(exc) if exc else "the broker closed the connection")
        error = ConnectionLost(
            f"lost the link to broker {self.broker_name or self.address}: {reason}"
        )
        if not self.welcomed.done():
            self.welcomed.set_exception(error)
        self.connector._link_lost(self, error)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self.connector._resume_writing()

    # -- frames ----------------------------------------------------------------------

    def dispatch(self) -> None:
        """Hand out the buffered frames, stopping while an inbox is full: the rest stay
        in the decoder, so an inbox never holds more than ``max_inbox`` messages."""
        connector = self.connector
        decoder = self.decoder
        try:
            while not connector._full_inboxes and (frame := decoder.next_frame()) is not None:
                if self._handshake.state is HandshakeState.AWAIT_WELCOME:
                    if not self._answered(self._handshake.receive(frame)):
                        return
                elif isinstance(frame, DataFrame):
                    on_data(connector, frame)
                else:
                    on_control(connector, self, frame)
        except ProtocolError as exc:
            connector._protocol_error(self, exc)

    def _answered(self, outcome: Welcomed | Refused) -> bool:
        """The broker answered the HELLO; True if the link is open."""
        if isinstance(outcome, Welcomed):
            self.broker_name = outcome.welcome.broker
        else:
            self.error = outcome.message  # the broker closes the link next
        if not self.welcomed.done():
            self.welcomed.set_result(outcome)
        return isinstance(outcome, Welcomed)

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

    def abort(self) -> None:
        self.closed = True
        self._out.clear()
        if self.transport is not None:
            self.transport.abort()
