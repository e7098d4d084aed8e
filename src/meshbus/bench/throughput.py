"""One producer -> one consumer through one server, counted in bytes at the consumer.

The producer sends pre-encoded messages in large batches on a blocking socket;
the consumer thread only counts received bytes (``recv_into`` into one reused
buffer). Both spend their time in system calls with the GIL released, so the
server is what limits the rate. Time runs from the first send to the arrival of
the last expected byte.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from meshbus.bench.wire import Wire

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
        batch_count = min(count, _BATCH - _BATCH % destinations or destinations)
        batch = wire.encode_messages(batch_count, size, destinations)
        full, rest = divmod(count, batch_count)
        tail = wire.encode_messages(rest, size, destinations) if rest else b""
        expected = count * wire.delivered_size(size)
        done: dict[str, float | BaseException] = {}

        def consume() -> None:
            buf = bytearray(_RECV_BUFFER)
            got = 0
            try:
                consumer.settimeout(timeout)
                while got < expected:
                    n = consumer.recv_into(buf)
                    if not n:
                        raise ConnectionError(
                            f"{wire.name} closed the consumer link after {got} of {expected} bytes"
                        )
                    got += n
                done["end"] = time.perf_counter()
            except BaseException as exc:  # reported to the main thread below
                done["error"] = exc

        thread = threading.Thread(target=consume, name="bench-consumer")
        thread.start()
        start = time.perf_counter()
        for _ in range(full):
            producer.sendall(batch)
        if tail:
            producer.sendall(tail)
        thread.join(timeout)
        error = done.get("error")
        if isinstance(error, BaseException):
            raise error
        end = done.get("end")
        if not isinstance(end, float):
            raise TimeoutError(f"{wire.name}: consumer did not receive everything in {timeout} s")
        return ThroughputResult(wire.name, count, size, end - start)
    finally:
        producer.close()
        consumer.close()
