"""The load driver's view of each system: connect, subscribe, pre-encoded messages.

One driver design serves both meshbus and nats-server: the same blocking-socket
producer and byte-counting consumer for throughput, the same asyncio
requester/responder for latency. Only these adapters differ, and each does the
least its protocol allows, so the driver is never what is measured.
"""

from __future__ import annotations

import socket
from typing import Protocol

from meshbus.address import Unicast
from meshbus.protocol import ControlType, FrameDecoder, encode_control, encode_data
from meshbus.protocol.control import Empty, Hello, Register
from meshbus.protocol.layout import DATA_HEADER_SIZE

PRODUCER = Unicast("bench", 1)
CONSUMER = Unicast("bench", 2)


def consumers(destinations: int) -> list[Unicast]:
    """The consumer's addresses; one link carries them all."""
    return [Unicast("bench", 2 + i) for i in range(destinations)]


_CONNECT_TIMEOUT = 10.0


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


def _read_until(sock: socket.socket, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"server closed the link before {marker!r}: {data[-200:]!r}")
        data += chunk
    return data


class MeshbusWire:
    name = "meshbus"

    def _open(self, host: str, port: int, *addresses: Unicast, extra: bytes = b"") -> socket.socket:
        """HELLO, REGISTER ``addresses``, then ``extra`` frames; returns once all are answered."""
        sock = _connect(host, port)
        sock.sendall(
            encode_control(ControlType.HELLO, Hello(name="bench"), 1)
            + b"".join(
                encode_control(
                    ControlType.REGISTER, Register(server=a.server, instance=a.instance), 2 + i
                )
                for i, a in enumerate(addresses)
            )
            + extra
            + encode_control(ControlType.PING, Empty(), 1000)
        )
        decoder = FrameDecoder()
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("broker closed the link during set-up")
            decoder.feed(chunk)
            while (frame := decoder.next_frame()) is not None:
                if getattr(frame, "type", None) == ControlType.ERROR:
                    raise ConnectionError(f"broker refused set-up: {frame}")
                if getattr(frame, "type", None) == ControlType.PONG:
                    return sock

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
    name = "nats"
    subject = b"bench"

    def _open(self, host: str, port: int, extra: bytes) -> socket.socket:
        sock = _connect(host, port)
        _read_until(sock, b"\r\n")  # INFO
        sock.sendall(
            b'CONNECT {"verbose":false,"pedantic":false,"echo":false}\r\n' + extra + b"PING\r\n"
        )
        reply = _read_until(sock, b"PONG\r\n")
        if b"-ERR" in reply:
            raise ConnectionError(f"nats-server refused set-up: {reply!r}")
        return sock

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
