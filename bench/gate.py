"""A TCP proxy in front of a broker, for partitions on loopback.

The other brokers dial the gate (the broker advertises the gate's address with
``--advertise``); the gate learns who dials from the HELLO and can shut one broker
out -- its open connections reset, new ones closed at once -- until let in again.
Cutting the a-b link in both gates partitions a from b while both still reach every
other broker: the fault of a switch port or a firewall rule, not of a process. Used
by the fault tests (tests/integration/test_faults.py) and by ``bench chaos``.
"""

from __future__ import annotations

import asyncio
import contextlib

from meshbus.protocol import ControlFrame, FrameDecoder
from meshbus.protocol.control import Hello


class BrokerGate:
    """A TCP proxy in front of one broker, which the other brokers dial (the broker
    advertises the gate's address). It reads each connection's HELLO to learn who
    dials, and drops the connections of the brokers it is told to shut out: those
    open are reset, new ones are closed at once, until ``open_to`` lets them in.

    ``upstream`` (the broker's own address) is known only once the broker has started
    on a free port, but its peers may dial the gate as soon as the broker announced the
    gate's address, before it is ready: such a connection waits for ``upstream``."""

    def __init__(self) -> None:
        self._upstream = ""
        self._upstream_known = asyncio.Event()
        self._shut_out: set[str] = set()
        self._open: dict[asyncio.StreamWriter, str] = {}
        self._handlers: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.address = ""

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = f"{host}:{port}"
        return self.address

    @property
    def upstream(self) -> str:
        return self._upstream

    @upstream.setter
    def upstream(self, address: str) -> None:
        self._upstream = address
        self._upstream_known.set()

    def shut_out(self, name: str) -> None:
        self._shut_out.add(name)
        for writer, who in list(self._open.items()):
            if who == name:
                writer.transport.abort()

    def open_to(self, name: str) -> None:
        self._shut_out.discard(name)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        # A connection accepted in the last turn has a handler task that has not started:
        # cancelled before it runs, it would never close its transport (a ResourceWarning
        # when it is collected). One turn lets each start and register its writer.
        await asyncio.sleep(0)
        for writer in list(self._open):
            writer.transport.abort()
        # Not cancelled first: with their transports aborted the handlers end by
        # themselves, and asyncio's streams log a cancelled connection handler as an error.
        self._upstream_known.set()
        if self._handlers:
            _, stuck = await asyncio.wait(list(self._handlers), timeout=2.0)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._open[writer] = ""
        try:
            await self._forward(reader, writer)
        finally:
            self._handlers.discard(task)
            self._open.pop(writer, None)
            writer.transport.abort()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = FrameDecoder()
        first = b""
        name = ""
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while not name:
                data = await reader.read(65536)
                if not data:
                    return
                first += data
                decoder.feed(data)
                frame = decoder.next_frame()
                if isinstance(frame, ControlFrame) and isinstance(frame.body, Hello):
                    name = frame.body.name or "?"
            if name in self._shut_out:
                return
            await self._upstream_known.wait()
            if not self._upstream:
                return  # closed before its broker started
            host, port = self._upstream.rsplit(":", 1)
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
            up_writer.write(first)
            self._open[writer] = name
            self._open[up_writer] = name
            try:
                await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
            finally:
                self._open.pop(up_writer, None)
                up_writer.transport.abort()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.transport.abort()
