"""Request/response latency through one server, with C requests in flight.

One requester link keeps ``concurrency`` requests outstanding: each response
is timed (monotonic clock, send to receipt) and immediately replaced by the
next request. One responder link answers every request with its payload. Both
run on one uvloop event loop in the bench process, for meshbus and for
nats-server alike; only the framing (``RequestCodec``) differs. The first
``warmup`` responses are not counted.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import statistics
import time
from dataclasses import dataclass
from typing import Protocol, cast

from bench.wire import CONSUMER, PRODUCER, Dialogue, MeshbusWire, NatsWire, open_transport
from meshbus.auth import Credentials
from meshbus.protocol import DataFlags, encode_data
from meshbus.protocol.layout import DATA_HEADER, DATA_HEADER_SIZE, KIND_DATA

_REQUEST = int(DataFlags.REQUEST)
_RESPONSE = int(DataFlags.RESPONSE)


class RequestCodec(Protocol):
    name: str
    tls: ssl.SSLContext | None

    def requester_dialogue(self) -> Dialogue: ...

    def responder_dialogue(self) -> Dialogue: ...

    def request(self, request_id: int, payload: bytes) -> bytes: ...

    def take_responses(self, buf: bytearray) -> list[int]:
        """Remove complete responses from ``buf``; return their request ids."""
        ...

    def answer(self, buf: bytearray) -> bytes:
        """Remove complete requests from ``buf``; return the encoded responses."""
        ...


class MeshbusRequests:
    name = "meshbus"

    def __init__(
        self, credentials: Credentials | None = None, tls: ssl.SSLContext | None = None
    ) -> None:
        self._wire = MeshbusWire(credentials, tls)
        self.tls = tls
        self._dst = CONSUMER.to_bytes()
        self._src = PRODUCER.to_bytes()

    def requester_dialogue(self) -> Dialogue:
        return self._wire.dialogue(PRODUCER)

    def responder_dialogue(self) -> Dialogue:
        return self._wire.dialogue(CONSUMER)

    def request(self, request_id: int, payload: bytes) -> bytes:
        return encode_data(
            self._dst, self._src, payload, msg_id=request_id, flags=_REQUEST, timeout_ms=30_000
        )

    def _frames(self, buf: bytearray) -> list[tuple[int, int, bytes, int, int, bytes]]:
        frames = []
        pos = 0
        size = len(buf)
        while size - pos >= 4:
            total = int.from_bytes(buf[pos : pos + 4], "big") + 4
            if size - pos < total:
                break
            if buf[pos + 4] == KIND_DATA:
                fields = DATA_HEADER.unpack_from(buf, pos)
                payload = bytes(buf[pos + DATA_HEADER_SIZE : pos + total])
                # flags, src, msg_id, response_for
                frames.append((fields[3], fields[8], fields[6], fields[9], total, payload))
            pos += total
        del buf[:pos]
        return frames

    def take_responses(self, buf: bytearray) -> list[int]:
        return [f[3] for f in self._frames(buf) if f[0] & _RESPONSE]

    def answer(self, buf: bytearray) -> bytes:
        out = []
        for flags, msg_id, src, _, _, payload in self._frames(buf):
            if flags & _REQUEST:
                out.append(
                    encode_data(src, self._dst, payload, response_for=msg_id, flags=_RESPONSE)
                )
        return b"".join(out)


_NATS_MSG = re.compile(rb"MSG (\S+) \S+ (?:(\S+) )?(\d+)\r\n")


class NatsRequests:
    name = "nats"

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self._wire = NatsWire(tls)
        self.tls = tls

    def requester_dialogue(self) -> Dialogue:
        return self._wire.dialogue(b"SUB rsp.* 1\r\n")

    def responder_dialogue(self) -> Dialogue:
        return self._wire.dialogue(b"SUB req 1\r\n")

    def request(self, request_id: int, payload: bytes) -> bytes:
        return b"PUB req rsp.%d %d\r\n%s\r\n" % (request_id, len(payload), payload)

    def _messages(self, buf: bytearray) -> list[tuple[bytes, bytes | None, bytes]]:
        messages: list[tuple[bytes, bytes | None, bytes]] = []
        pos = 0
        while True:
            if buf.startswith(b"PING\r\n", pos):  # the server's keep-alive; answered below
                messages.append((b"", b"PING", b""))
                pos += 6
                continue
            match = _NATS_MSG.match(buf, pos)
            if match is None:
                break
            start = match.end()
            end = start + int(match.group(3))
            if end + 2 > len(buf):
                break
            messages.append((match.group(1), match.group(2), bytes(buf[start:end])))
            pos = end + 2
        del buf[:pos]
        return messages

    def take_responses(self, buf: bytearray) -> list[int]:
        return [int(subject[4:]) for subject, _, _ in self._messages(buf) if subject]

    def answer(self, buf: bytearray) -> bytes:
        out = []
        for subject, reply, payload in self._messages(buf):
            if subject and reply:
                out.append(b"PUB %s %d\r\n%s\r\n" % (reply, len(payload), payload))
        return b"".join(out)


@dataclass
class LatencyResult:
    system: str
    requests: int
    concurrency: int
    seconds: float
    latencies_us: list[float]

    @property
    def p50_us(self) -> float:
        return statistics.median(self.latencies_us)

    @property
    def p99_us(self) -> float:
        ordered = sorted(self.latencies_us)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds


class _Responder(asyncio.Protocol):
    def __init__(self, codec: RequestCodec) -> None:
        self.codec = codec
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        out = self.codec.answer(self.buf)
        if out and self.transport is not None:
            self.transport.write(out)


class _Requester(asyncio.Protocol):
    def __init__(self, codec: RequestCodec, total: int, warmup: int, payload: bytes) -> None:
        self.codec = codec
        self.total = total
        self.warmup = warmup
        self.payload = payload
        self.buf = bytearray()
        self.sent: dict[int, int] = {}
        self.next_id = 1
        self.received = 0
        self.latencies_ns: list[int] = []
        self.started = 0.0
        self.done: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def send_next(self, count: int) -> None:
        out = []
        now = time.perf_counter_ns()
        for _ in range(count):
            if self.next_id > self.total:
                break
            self.sent[self.next_id] = now
            out.append(self.codec.request(self.next_id, self.payload))
            self.next_id += 1
        if out and self.transport is not None:
            self.transport.write(b"".join(out))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        now = time.perf_counter_ns()
        ids = self.codec.take_responses(self.buf)
        for request_id in ids:
            sent = self.sent.pop(request_id)
            self.received += 1
            if self.received == self.warmup:
                self.started = time.perf_counter()
            elif self.received > self.warmup:
                self.latencies_ns.append(now - sent)
        self.send_next(len(ids))
        if self.received >= self.total and not self.done.done():
            self.done.set_result(time.perf_counter())


async def measure_latency(
    codec: RequestCodec,
    host: str,
    port: int,
    requests: int,
    concurrency: int,
    size: int = 16,
    timeout: float = 120.0,
) -> LatencyResult:
    warmup = min(1000, max(1, requests // 10))
    total = requests + warmup
    responder_transport = await open_transport(host, port, codec.responder_dialogue(), codec.tls)
    try:
        requester_transport = await open_transport(
            host, port, codec.requester_dialogue(), codec.tls
        )
    except BaseException:
        responder_transport.close()
        raise
    requester = _Requester(codec, total, warmup, b"x" * size)
    for transport, protocol in (
        (responder_transport, _Responder(codec)),
        (requester_transport, requester),
    ):
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
    try:
        requester.send_next(concurrency)
        ended = await asyncio.wait_for(requester.done, timeout)
    finally:
        requester_transport.close()
        responder_transport.close()
    return LatencyResult(
        codec.name,
        requests,
        concurrency,
        ended - requester.started,
        [ns / 1000 for ns in requester.latencies_ns],
    )
