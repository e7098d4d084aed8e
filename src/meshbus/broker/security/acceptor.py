"""A broker that listens with TLS: the accepts and TLS handshakes of its links
(docs/security.md, "TLS").

The broker accepts each connection itself and runs its TLS handshake with
``loop.connect_accepted_socket``, rather than handing ``create_server`` an SSL
context: the loop's TLS listener drops a failed handshake without a word, and
counts it nowhere. Here a handshake in progress counts against
``--max-handshaking`` and ``--max-handshaking-per-source`` (meshbus.broker.security.handshakes),
ends at ``--handshake-timeout``, and a failed one is logged as one line. Only once
the handshake is done does the connection get its ``Link`` opened
(``connection_made``), which then waits for HELLO like any other.

After that the link reads and writes through the TLS transport; frame handling is
the same as on plain TCP, and a broker without TLS never comes here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import ssl
from collections.abc import Callable

from meshbus.broker.core.endpoint import CloseReason
from meshbus.broker.core.link import Link
from meshbus.broker.core.registry import LinkRegistry
from meshbus.broker.security.handshakes import evicted_why, source_of
from meshbus.protocol.layout import ErrorCode
from meshbus.tls import failure_reason
from meshbus.util import BackgroundTasks

log = logging.getLogger("meshbus.broker")

# A pause after the accept itself failed (out of file descriptors, say), as asyncio's own
# listener makes: trying again at once would spin.
_ACCEPT_PAUSE = 1.0
# What a TLS handshake is cancelled with when a newer connection from its source took its
# place (``_drop``): set apart from the acceptor's own stop.
_EVICTED = "evicted"


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
        links: LinkRegistry,
        new_link: Callable[[], Link],
        evict: Callable[[Link], None],
    ) -> None:
        """``context``: the broker's (meshbus.tls.server_context); ``timeout``: the
        longest a TLS handshake may take; ``max_handshaking``: connections that may be
        in their TLS handshake or waiting to send HELLO (``links.handshaking``) -- past
        it a new one is closed at once; ``require_cert``: refuse a link that showed no
        client certificate; ``new_link`` makes the link of a connection, counted in
        ``links.by_source`` from its accept; ``evict`` closes an open link that waited
        longest when its source went past its cap (a TLS handshake still in progress
        is dropped here)."""
        self._context = context
        self._timeout = timeout
        self._max_handshaking = max_handshaking
        self._require_cert = require_cert
        self._links = links
        self._new_link = new_link
        self._evict = evict
        self._tasks = BackgroundTasks()
        self._listener: socket.socket | None = None
        # The links in their TLS handshake, and its task; and the sockets of those whose
        # task has not started yet.
        self._handshakes: dict[Link, asyncio.Task[None]] = {}
        self._unstarted: dict[Link, socket.socket] = {}

    @property
    def handshaking(self) -> int:
        """TLS handshakes in progress."""
        return len(self._handshakes)

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
            if self.handshaking + len(self._links.handshaking) >= self._max_handshaking:
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
            link = self._new_link()
            link.came_from(peer[0], peer[1])
            self._unstarted[link] = sock
            task = self._tasks.spawn(self._handshake(link), "tls-handshake")
            task.add_done_callback(functools.partial(self._ended, link))
            self._handshakes[link] = task
            evicted = self._links.by_source.add(source_of(link.host), link)
            if evicted is not None:
                self._drop(evicted)

    def _drop(self, link: Link) -> None:
        """Close ``link``, the one of its source that waited longest: in its TLS
        handshake, that handshake is called off (no ERROR frame, as above); past it,
        ``evict`` closes it."""
        task = self._handshakes.get(link)
        if task is None:
            self._evict(link)
            return
        log.info(
            "closing link",
            extra={
                "remote": link.remote,
                "reason": CloseReason.REFUSED.value,
                "error": evicted_why(self._links.by_source.per_source, link.host),
            },
        )
        task.cancel(_EVICTED)

    async def _handshake(self, link: Link) -> None:
        """The TLS handshake of one connection; the loop opens its link when it is done.
        On failure the loop closes the socket: the connection leaves nothing behind."""
        sock = self._unstarted.pop(link)  # the loop's from here on
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: link, sock, ssl=self._context, ssl_handshake_timeout=self._timeout
            )
        except OSError as exc:  # ssl.SSLError, a reset, the handshake timeout
            self._failed(link.remote, exc)
        except asyncio.CancelledError as exc:
            if exc.args != (_EVICTED,):
                raise

    def _ended(self, link: Link, task: asyncio.Task[None]) -> None:
        """A handshake's task is done, whichever way; one cancelled before it started
        still has its socket here."""
        del self._handshakes[link]
        sock = self._unstarted.pop(link, None)
        if sock is not None:
            sock.close()
        if link.transport is None:  # never opened: the registry has it only here
            self._links.by_source.remove(link)

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
