"""The load driver's view of each system: connect, subscribe, pre-encoded messages.

One driver design serves both meshbus and nats-server: the same blocking-socket
producer and byte-counting consumer for throughput, the same asyncio
requester/responder for latency. Only these adapters differ, and each does the
least its protocol allows, so the driver is never what is measured.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Generator
from typing import Protocol

from meshbus.address import Unicast
from meshbus.auth import Credentials
from meshbus.protocol import ControlFrame, ControlType, FrameDecoder, encode_control, encode_data
from meshbus.protocol.codec import Frame
from meshbus.protocol.control import Challenge, Empty, Hello, Register
from meshbus.protocol.handshake import sign_in_message
from meshbus.protocol.layout import DATA_HEADER_SIZE

PRODUCER = Unicast("bench", 1)
CONSUMER = Unicast("bench", 2)


def consumers(destinations: int) -> list[Unicast]:
    """The consumer's addresses; one link carries them all."""
    return [Unicast("bench", 2 + i) for i in range(destinations)]


_CONNECT_TIMEOUT = 10.0
_READ = 65536


class StartTLS:
    """What a set-up dialogue yields where the link turns to TLS: at once for a meshbus
    broker, after its INFO for nats-server."""


START_TLS = StartTLS()

# A link's set-up as a conversation with no I/O of its own: it yields the bytes to send
# (b"" for none), and is sent the next chunk read; or it yields START_TLS, and is sent b""
# once the link is TLS. It returns once the link is ready for traffic. One dialogue
# serves the blocking sockets of ``throughput`` (``open_link``) and the event loop of
# ``latency`` (``open_transport``).
Dialogue = Generator[bytes | StartTLS, bytes, None]


class Wire(Protocol):
    name: str

    def open_producer(self, host: str, port: int) -> socket.socket: ...

    def open_consumer(self, host: str, port: int, destinations: int = 1) -> socket.socket: ...

    def encode_messages(self, count: int, size: int, destinations: int = 1) -> bytes: ...

    def delivered_size(self, size: int) -> int: ...


def _connect(host: str, port: int) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def open_link(
    host: str, port: int, dialogue: Dialogue, tls: ssl.SSLContext | None
) -> socket.socket:
    """A blocking socket to ``host:port`` once ``dialogue`` has set it up (TLS with
    ``tls`` where the dialogue says)."""
    sock = _connect(host, port)
    try:
        step = next(dialogue)
        while True:
            if isinstance(step, StartTLS):
                assert tls is not None
                sock = tls.wrap_socket(sock, server_hostname=host)
                step = dialogue.send(b"")
                continue
            if step:
                sock.sendall(step)
            chunk = sock.recv(_READ)
            if not chunk:
                raise ConnectionError("the server closed the link during set-up")
            step = dialogue.send(chunk)
    except StopIteration:
        return sock
    except BaseException:
        sock.close()
        raise


class _SetUp(asyncio.Protocol):
    """The protocol of a link while ``open_transport`` sets it up: chunks read, in order."""

    def __init__(self) -> None:
        self.chunks: asyncio.Queue[bytes] = asyncio.Queue()

    def data_received(self, data: bytes) -> None:
        self.chunks.put_nowait(data)

    def eof_received(self) -> bool | None:
        self.chunks.put_nowait(b"")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.chunks.put_nowait(b"")


async def open_transport(
    host: str, port: int, dialogue: Dialogue, tls: ssl.SSLContext | None
) -> asyncio.Transport:
    """The same on the running event loop: the transport of the set-up link, to be given
    its protocol (``set_protocol``) by the caller."""
    loop = asyncio.get_running_loop()
    sock = _connect(host, port)
    sock.setblocking(False)
    setup = _SetUp()
    transport, _ = await loop.create_connection(lambda: setup, sock=sock)
    try:
        step = next(dialogue)
        while True:
            if isinstance(step, StartTLS):
                assert tls is not None
                upgraded = await loop.start_tls(transport, setup, tls, server_hostname=host)
                assert upgraded is not None
                transport = upgraded
                step = dialogue.send(b"")
                continue
            if step:
                transport.write(step)
            chunk = await asyncio.wait_for(setup.chunks.get(), _CONNECT_TIMEOUT)
            if not chunk:
                raise ConnectionError("the server closed the link during set-up")
            step = dialogue.send(chunk)
    except StopIteration:
        return transport
    except BaseException:
        transport.close()
        raise


def _read_until(marker: bytes, data: bytes = b"") -> Generator[bytes | StartTLS, bytes, bytes]:
    """Part of a dialogue: read on from ``data`` until ``marker``; all that was read."""
    while marker not in data:
        data += yield b""
    return data


def _challenge_nonce(frame: Frame) -> bytes:
    """The nonce of a CHALLENGE; b"" for a frame that is not one (an ERROR raises)."""
    if isinstance(frame, ControlFrame):
        if frame.type == ControlType.ERROR:
            raise ConnectionError(f"broker refused the sign-in: {frame}")
        if isinstance(frame.body, Challenge):
            return frame.body.nonce
    return b""


class MeshbusWire:
    """A raw meshbus link: HELLO (signed in with ``credentials`` to a broker with users),
    REGISTERs, then PING; over TLS with ``tls``."""

    name = "meshbus"

    def __init__(
        self, credentials: Credentials | None = None, tls: ssl.SSLContext | None = None
    ) -> None:
        self.credentials = credentials
        self.tls = tls

    def dialogue(self, *addresses: Unicast, extra: bytes = b"") -> Dialogue:
        """HELLO (and the sign-in), REGISTER ``addresses``, then ``extra`` frames; done
        once all are answered."""
        if self.tls is not None:
            yield START_TLS
        hello = encode_control(ControlType.HELLO, Hello(name="bench"), 1)
        setup = (
            b"".join(
                encode_control(
                    ControlType.REGISTER, Register(server=a.server, instance=a.instance), 2 + i
                )
                for i, a in enumerate(addresses)
            )
            + extra
            + encode_control(ControlType.PING, Empty(), 1000)
        )
        decoder = FrameDecoder()
        out = hello + setup
        if self.credentials is not None:
            # The broker takes nothing but the AUTH after its CHALLENGE.
            nonce = b""
            decoder.feed((yield hello))
            while not nonce:
                while (frame := decoder.next_frame()) is not None:
                    nonce = _challenge_nonce(frame)
                if not nonce:
                    decoder.feed((yield b""))
            auth = self.credentials.answer(sign_in_message(nonce))
            out = encode_control(ControlType.AUTH, auth, 1) + setup
        decoder.feed((yield out))
        while True:
            while (frame := decoder.next_frame()) is not None:
                if getattr(frame, "type", None) == ControlType.ERROR:
                    raise ConnectionError(f"broker refused set-up: {frame}")
                if getattr(frame, "type", None) == ControlType.PONG:
                    return
            decoder.feed((yield b""))

    def _open(self, host: str, port: int, *addresses: Unicast, extra: bytes = b"") -> socket.socket:
        """A blocking link set up by ``dialogue``."""
        return open_link(host, port, self.dialogue(*addresses, extra=extra), self.tls)

    def open_producer(self, host: str, port: int) -> socket.socket:
        return self._open(host, port, PRODUCER)

    def open_consumer(self, host: str, port: int, destinations: int = 1) -> socket.socket:
        return self._open(host, port, *consumers(destinations))

    def encode_messages(self, count: int, size: int, destinations: int = 1) -> bytes:
        dsts = [c.to_bytes() for c in consumers(destinations)]
        src, payload = PRODUCER.to_bytes(), b"x" * size
        return b"".join(
            encode_data(dsts[i % destinations], src, payload, msg_id=i + 1) for i in range(count)
        )

    def delivered_size(self, size: int) -> int:
        return DATA_HEADER_SIZE + size


class NatsWire:
    """A raw nats-server link: CONNECT, then ``extra`` (SUBs), then PING; with ``tls``,
    TLS after the server's INFO, as nats-server 2.9 wants it."""

    name = "nats"
    subject = b"bench"

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls

    def dialogue(self, extra: bytes) -> Dialogue:
        yield from _read_until(b"\r\n")  # INFO
        if self.tls is not None:
            yield START_TLS
        connect = b'CONNECT {"verbose":false,"pedantic":false,"echo":false}\r\n'
        data = yield from _read_until(b"PONG\r\n", (yield connect + extra + b"PING\r\n"))
        if b"-ERR" in data:
            raise ConnectionError(f"nats-server refused set-up: {data!r}")

    def _open(self, host: str, port: int, extra: bytes) -> socket.socket:
        return open_link(host, port, self.dialogue(extra), self.tls)

    def open_producer(self, host: str, port: int) -> socket.socket:
        return self._open(host, port, b"")

    def _subjects(self, destinations: int) -> list[bytes]:
        # Equal lengths for every subject, so delivered_size holds for each message.
        return [self.subject + b"%04d" % i for i in range(destinations)]

    def open_consumer(self, host: str, port: int, destinations: int = 1) -> socket.socket:
        subs = b"".join(
            b"SUB %s %04d\r\n" % (subject, i + 1)
            for i, subject in enumerate(self._subjects(destinations))
        )
        return self._open(host, port, subs)

    def encode_messages(self, count: int, size: int, destinations: int = 1) -> bytes:
        payload = b"x" * size
        ones = [b"PUB %s %d\r\n%s\r\n" % (s, size, payload) for s in self._subjects(destinations)]
        return b"".join(ones[i % destinations] for i in range(count))

    def delivered_size(self, size: int) -> int:
        # MSG <subject> <sid> <size>: subjects and sids padded to one width.
        return len(b"MSG " + self.subject + b"0000 0001 %d\r\n" % size) + size + 2
