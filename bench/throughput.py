"""One producer -> one consumer through one server, counted in bytes at the consumer.

The producer sends pre-encoded messages in large batches on a blocking socket;
the consumer thread only counts received bytes (``recv_into`` into one reused
buffer). Both spend their time in system calls with the GIL released, so the
server is what limits the rate. Time runs from the first send to the arrival of
the last expected byte.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.wire import Wire

_BATCH = 8192  # messages per sendall
_RECV_BUFFER = 4 * 1024 * 1024


@dataclass
class ThroughputResult:
    system: str
    count: int
    size: int
    seconds: float

    @property
    def msgs_per_s(self) -> float:
        return self.count / self.seconds

    @property
    def mib_per_s(self) -> float:
        return self.count * self.size / self.seconds / (1024 * 1024)


@dataclass
class Batches:
    """What the producer sends: ``full`` times ``batch``, then ``tail``."""

    batch: bytes
    full: int
    tail: bytes


def split_batches(count: int, encode: Callable[[int], bytes], per_batch: int = _BATCH) -> Batches:
    """``count`` messages as ``full`` repeats of one batch of (at most) ``per_batch``
    messages plus a tail: ``encode(n)`` gives the bytes of ``n`` messages."""
    batch_count = min(count, per_batch)
    full, rest = divmod(count, batch_count)
    return Batches(encode(batch_count), full, encode(rest) if rest else b"")


def time_delivery(
    name: str,
    producer: socket.socket,
    batches: Batches,
    consumers: Sequence[tuple[socket.socket, int]],
    timeout: float = 120.0,
) -> float:
    """Send ``batches`` on ``producer``; seconds from the first send until each consumer
    socket received its expected byte count (one counting thread per consumer)."""
    # One 4 MiB buffer in all, however many links share it out.
    buffer_size = max(256 * 1024, _RECV_BUFFER // len(consumers))
    ends: list[float] = []
    errors: list[BaseException] = []

    def consume(consumer: socket.socket, expected: int) -> None:
        buf = bytearray(buffer_size)
        got = 0
        try:
            consumer.settimeout(timeout)
            while got < expected:
                n = consumer.recv_into(buf)
                if not n:
                    raise ConnectionError(
                        f"{name} closed a consumer link after {got} of {expected} bytes"
                    )
                got += n
            ends.append(time.perf_counter())
        except BaseException as exc:  # reported to the main thread below
            errors.append(exc)

    threads = [
        threading.Thread(target=consume, args=consumer, name="bench-consumer")
        for consumer in consumers
    ]
    for thread in threads:
        thread.start()
    start = time.perf_counter()
    for _ in range(batches.full):
        producer.sendall(batches.batch)
    if batches.tail:
        producer.sendall(batches.tail)
    deadline = start + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.perf_counter()))
    if errors:
        raise errors[0]
    if len(ends) < len(consumers):
        raise TimeoutError(f"{name}: consumers did not receive everything in {timeout} s")
    return max(ends) - start


def measure_throughput(
    wire: Wire,
    host: str,
    port: int,
    count: int,
    size: int,
    destinations: int = 1,
    timeout: float = 120.0,
) -> ThroughputResult:
    """Send ``count`` messages of ``size`` bytes round-robin to ``destinations`` addresses
    (all on the one consumer link) and time their arrival."""
    consumer = wire.open_consumer(host, port, destinations)
    producer = wire.open_producer(host, port)
    try:
        # A whole number of rounds per batch keeps the round-robin going across batches.
        batches = split_batches(
            count,
            lambda n: wire.encode_messages(n, size, destinations),
            _BATCH - _BATCH % destinations or destinations,
        )
        expected = count * wire.delivered_size(size)
        seconds = time_delivery(wire.name, producer, batches, [(consumer, expected)], timeout)
        return ThroughputResult(wire.name, count, size, seconds)
    finally:
        producer.close()
        consumer.close()
