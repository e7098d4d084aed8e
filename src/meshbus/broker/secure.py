"""A broker that listens with TLS: the accepts and TLS handshakes of its links
(docs/security.md, "TLS").

The broker accepts each connection itself and runs its TLS handshake with
``loop.connect_accepted_socket``, rather than handing ``create_server`` an SSL
context: the loop's TLS listener drops a failed handshake without a word, and
counts it nowhere. Here a handshake in progress counts against
``--max-handshaking``, ends at ``--handshake-timeout``, and a failed one is
logged as one line. Only once the handshake is done does the connection get its
``Link`` opened (``connection_made``), which then waits for HELLO like any other.

After that the link reads and writes through the TLS transport; frame handling is
the same as on plain TCP, and a broker without TLS never comes here.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable

from meshbus.broker.endpoint import CloseReason
from meshbus.broker.link import Link
from meshbus.protocol.layout import ErrorCode
from meshbus.tls import failure_reason
from meshbus.util import BackgroundTasks

log = logging.getLogger("meshbus.broker")

# A pause after the accept itself failed (out of file descriptors, say), as asyncio's own
# listener makes: trying again at once would spin.
_ACCEPT_PAUSE = 1.0


class TLSAcceptor:
    """Accepts connections and runs their TLS handshakes; owns the listening socket and
    the handshakes in progress, nothing else."""

    def __init__(
        self,
        context: ssl.SSLContext,
        *,
        timeout: float,
        max_handshaking: int,
        require_cert: bool,
        waiting_for_hello: Callable[[], int],
        new_link: Callable[[], Link],
    ) -> None:
        """``context``: the broker's (meshbus.tls.server_context); ``timeout``: the
        longest a TLS handshake may take; ``max_handshaking``: connections that may be
        in their TLS handshake or waiting to send HELLO (``waiting_for_hello`` counts
        the latter) -- past it a new one is closed at once; ``require_cert``: refuse a
        link that showed no client certificate; ``new_link`` makes the link of a
        connection."""
        self._context = context
        self._timeout = timeout
        self._max_handshaking = max_handshaking
        self._require_cert = require_cert
        self._waiting_for_hello = waiting_for_hello
        self._new_link = new_link
        self._tasks = BackgroundTasks()
        self._listener: socket.socket | None = None
        self.handshaking = 0  # TLS handshakes in progress

    def listen(self, host: str, port: int) -> tuple[str, int]:
        """Bind ``host``:``port`` (port 0: a free one) and start accepting; the address
        bound. OSError if it cannot."""
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        listener = socket.create_server((host, port), family=family[0][0], backlog=1024)
        listener.setblocking(False)
        self._listener = listener
        self._tasks.spawn(self._accept_all(listener), "tls-accept")
        bound: tuple[str, int] = listener.getsockname()[:2]
        return bound

    async def stop(self) -> None:
        """Stop accepting, and drop the handshakes in progress."""
        await self._tasks.cancel()
        if self._listener is not None:
            self._listener.close()

    def admit(self, link: Link) -> bool:
        """A link whose TLS handshake is done opens: False (and the link refused, with
        an ERROR that says why) when the broker requires a client certificate and the
        link showed none. Called before the link reads a byte."""
        if not self._require_cert or link.shows_certificate():
            return True
        link.fail(
            ErrorCode.CERTIFICATE_REQUIRED,
            "this broker requires a client certificate signed by its CA (mutual TLS, "
            "--tls-verify-clients); the TLS handshake showed none",
            CloseReason.REFUSED,
        )
        return False

    async def _accept_all(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, peer = await loop.sock_accept(listener)
            except OSError as exc:
                log.warning("cannot accept a connection", extra={"error": str(exc)})
                await asyncio.sleep(_ACCEPT_PAUSE)
                continue
            remote = f"{peer[0]}:{peer[1]}"
            if self.handshaking + self._waiting_for_hello() >= self._max_handshaking:
                # No ERROR frame: the client expects TLS records, and a handshake is
                # what this limit keeps the broker from spending.
                log.info(
                    "closing link",
                    extra={
                        "remote": remote,
                        "reason": CloseReason.REFUSED.value,
                        "error": f"{self._max_handshaking} connections are already in "
                        "their handshake (--max-handshaking)",
                    },
                )
                sock.close()
                continue
            self._tasks.spawn(self._handshake(sock, remote), "tls-handshake")

    async def _handshake(self, sock: socket.socket, remote: str) -> None:
        """The TLS handshake of one connection; the loop opens its link when it is done.
        On failure the loop closes the socket: the connection leaves nothing behind."""
        self.handshaking += 1
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                self._new_link, sock, ssl=self._context, ssl_handshake_timeout=self._timeout
            )
        except OSError as exc:  # ssl.SSLError, a reset, the handshake timeout
            self._failed(remote, exc)
        finally:
            self.handshaking -= 1

    def _failed(self, remote: str, exc: OSError) -> None:
        """One line, no traceback. A warning when the handshake broke the rules or ran
        out of time; only news (INFO) when the client hung up, as a port probe does."""
        if isinstance(exc, ConnectionAbortedError):  # the loop's handshake timeout
            reason = f"no TLS handshake within {self._timeout:g} s (--handshake-timeout)"
        else:
            reason = failure_reason(exc)
        level = (
            logging.WARNING
            if isinstance(exc, ssl.SSLError | ConnectionAbortedError)
            else logging.INFO
        )
        log.log(level, "TLS handshake failed", extra={"remote": remote, "error": reason})
