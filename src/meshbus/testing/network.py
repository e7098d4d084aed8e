"""Fake TCP: transports, wires that carry bytes between two protocols on later loop turns,
and a network of listeners with partitions, holds, pauses and crashes."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

from meshbus.broker.core.link import Link
from meshbus.broker.mesh.dialer import Dialer
from meshbus.testing.sim import NotSettled, P, running_sim_loop


class _Eof:
    """The peer closed its direction (FIN) after everything before it."""


class _Reset:
    """The peer aborted (RST)."""


_EOF = _Eof()
_RESET = _Reset()
_Item = bytes | _Eof | _Reset


class FakeTransport(asyncio.Transport):
    """The ``asyncio.Transport`` calls a ``Link`` makes.

    Standalone (``wire`` None) what is written is kept in ``captured``; as an end of a
    ``Wire`` it goes to the other end. ``connection_lost`` reaches the protocol once, on a
    later loop turn, as with asyncio's own transports."""

    def __init__(
        self, *, peername: tuple[str, int] = ("fake", 0), wire: Wire | None = None, side: int = 0
    ) -> None:
        super().__init__()
        self.peername = peername
        self.wire = wire
        self.side = side
        self.protocol: asyncio.BaseProtocol | None = None
        self.captured = bytearray()
        self.bytes_written = 0
        self.dropped_writes = 0  # writes after close: lost, as on a closed socket
        self.closing = False
        self.aborted = False
        self.eof_written = False
        self.reading = True
        self.lost = False  # connection_lost was called
        self.lost_with: Exception | None = None
        self.high = 64 * 1024
        self.low = 16 * 1024
        self._writing_paused = False

    # -- what Link calls --------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.eof_written:
            raise RuntimeError("Cannot call write() after write_eof()")
        if self.closing or self.lost:
            self.dropped_writes += 1
            return
        if not data:
            return
        chunk = bytes(data)  # the writer may reuse its buffer
        self.bytes_written += len(chunk)
        if self.wire is None:
            self.captured += chunk
        else:
            self.wire.carry(self.side, chunk)
            self._check_high_water()

    def close(self) -> None:
        if self.closing or self.lost:
            return
        self.closing = True
        if self.wire is None:
            asyncio.get_running_loop().call_soon(self.connection_lost, None)
        else:
            self.wire.closed_by(self.side)

    def abort(self) -> None:
        self.fail(None)

    def is_closing(self) -> bool:
        return self.closing or self.lost

    def fail(self, exc: Exception | None) -> None:
        """Abort; the protocol hears ``exc`` (asyncio's _fatal_error), or None (abort)."""
        if self.lost:
            return
        self.closing = self.aborted = True
        if self.wire is None:
            asyncio.get_running_loop().call_soon(self.connection_lost, exc)
        else:
            self.wire.aborted_by(self.side, exc)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        if not self.reading:
            self.reading = True
            if self.wire is not None:
                self.wire.kick(self.side)

    def is_reading(self) -> bool:
        return self.reading and not self.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": self.peername}.get(name, default)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.high = 64 * 1024 if high is None else high
        self.low = self.high // 4 if low is None else low

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self.low, self.high

    def get_write_buffer_size(self) -> int:
        """Bytes written and not yet delivered (on a held wire they pile up)."""
        return 0 if self.wire is None else self.wire.queued_bytes(1 - self.side)

    def write_eof(self) -> None:
        if self.eof_written or self.closing:
            return
        self.eof_written = True
        if self.wire is not None:
            self.wire.eof_from(self.side)

    def can_write_eof(self) -> bool:
        return True

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self.protocol is not None
        return self.protocol

    # -- the network's side -----------------------------------------------------------------

    def connection_lost(self, exc: Exception | None) -> None:
        """Tell the protocol, once."""
        if self.lost:
            return
        self.lost = self.closing = True
        self.lost_with = exc
        if self.protocol is not None:
            self.protocol.connection_lost(exc)

    def _check_high_water(self) -> None:
        """asyncio's flow control: past ``high`` undelivered bytes the protocol is told
        to pause writing (the broker takes that for a slow consumer)."""
        if not self._writing_paused and self.get_write_buffer_size() > self.high:
            self._writing_paused = True
            if isinstance(self.protocol, asyncio.Protocol | asyncio.BufferedProtocol):
                self.protocol.pause_writing()

    def _drained(self) -> None:
        if self._writing_paused and self.get_write_buffer_size() <= self.low:
            self._writing_paused = False
            if isinstance(self.protocol, asyncio.Protocol | asyncio.BufferedProtocol):
                self.protocol.resume_writing()


def attach(protocol: P, peername: tuple[str, int] = ("fake", 0)) -> tuple[P, FakeTransport]:
    """``protocol`` on a capturing transport, ``connection_made`` called."""
    transport = FakeTransport(peername=peername)
    transport.set_protocol(protocol)
    protocol.connection_made(transport)
    return protocol, transport


def _feed(protocol: asyncio.BaseProtocol, data: bytes, transport: FakeTransport) -> int:
    """Hand ``data`` to ``protocol`` as one read; returns how many bytes it took (it may
    stop reading, or close, part way)."""
    if isinstance(protocol, asyncio.BufferedProtocol):
        view = memoryview(data)
        pos = 0
        while pos < len(data) and transport.reading and not transport.is_closing():
            buf = memoryview(protocol.get_buffer(len(data) - pos))
            n = min(len(buf), len(data) - pos)
            if n <= 0:
                raise RuntimeError(f"{protocol!r} gave an empty read buffer")
            buf[:n] = view[pos : pos + n]
            pos += n
            protocol.buffer_updated(n)
        return pos
    assert isinstance(protocol, asyncio.Protocol)
    protocol.data_received(data)
    return len(data)


def feed(protocol: asyncio.BaseProtocol, data: bytes) -> None:
    """One read of ``data`` by a protocol on a standalone transport (no wire); what it
    does not take because it closed or stopped reading is dropped."""
    transport = getattr(protocol, "transport", None)
    assert isinstance(transport, FakeTransport), "attach() the protocol first"
    taken = _feed(protocol, data, transport)
    assert taken == len(data) or transport.is_closing() or not transport.reading


class Wire:
    """One fake TCP connection between ``protocols[0]`` (the dialler) and
    ``protocols[1]`` (the listener), on ``transports`` of the same index.
    ``_inbox[i]`` is what end ``i`` has yet to read."""

    def __init__(
        self,
        network: FakeNetwork,
        wire_id: int,
        labels: tuple[str, str],
        protocols: tuple[asyncio.BaseProtocol, asyncio.BaseProtocol],
        peernames: tuple[tuple[str, int], tuple[str, int]],
    ) -> None:
        self.network = network
        self.wire_id = wire_id
        self.labels = labels
        self.transports = (
            FakeTransport(peername=peernames[0], wire=self, side=0),
            FakeTransport(peername=peernames[1], wire=self, side=1),
        )
        for transport, protocol in zip(self.transports, protocols, strict=True):
            transport.set_protocol(protocol)
        self.protocols = protocols
        self.held = False
        self._inbox: tuple[deque[_Item], deque[_Item]] = (deque(), deque())

    def __repr__(self) -> str:
        return f"<Wire {self.wire_id} {self.labels[0]} -> {self.labels[1]}>"

    @property
    def broken(self) -> bool:
        """Both ends have seen connection_lost."""
        return all(t.lost for t in self.transports)

    def queued_bytes(self, side: int) -> int:
        return sum(len(item) for item in self._inbox[side] if isinstance(item, bytes))

    # -- from the transports ---------------------------------------------------------------

    def carry(self, sender: int, data: bytes) -> None:
        self._put(1 - sender, data)

    def eof_from(self, sender: int) -> None:
        self._put(1 - sender, _EOF)

    def closed_by(self, side: int) -> None:
        """A graceful close: what was written still arrives, then EOF; the closing end
        reads nothing more."""
        self._inbox[side].clear()
        if not self.transports[side].eof_written:
            self._put(1 - side, _EOF)
        asyncio.get_running_loop().call_soon(self.transports[side].connection_lost, None)

    def aborted_by(self, side: int, exc: Exception | None = None) -> None:
        """An abort: what was not delivered yet is lost, and the other end is reset;
        ``exc`` is what the aborting end's protocol hears (a fatal error, if any)."""
        self._inbox[side].clear()
        self._inbox[1 - side].clear()
        self._put(1 - side, _RESET)
        asyncio.get_running_loop().call_soon(self.transports[side].connection_lost, exc)

    # -- what a test does to it ----------------------------------------------------------

    def cut(self) -> None:
        """The connection breaks: nothing more arrives, and both ends see connection_lost
        (a reset) on the next loop turn."""
        loop = asyncio.get_running_loop()
        for side, transport in enumerate(self.transports):
            self._inbox[side].clear()
            if not transport.lost:
                transport.closing = True
                loop.call_soon(transport.connection_lost, ConnectionResetError("wire cut"))

    def hold(self) -> None:
        """Stop delivering in both directions; what is written piles up (see ``release``)."""
        self.held = True

    def release(self) -> None:
        """Deliver what piled up while held, in order, and carry on."""
        self.held = False
        self.kick(0)
        self.kick(1)

    # -- delivery ----------------------------------------------------------------------------

    def _put(self, side: int, item: _Item) -> None:
        if self.transports[side].is_closing():
            return  # that end closed: nothing reaches it any more
        self._inbox[side].append(item)
        self.kick(side)

    def kick(self, side: int) -> None:
        if self._inbox[side]:
            self.network._ready_to_deliver(self, side)

    def deliverable(self, side: int) -> bool:
        transport = self.transports[side]
        return bool(self._inbox[side]) and not self.held and transport.reading

    def deliver(self, side: int) -> None:
        """What end ``side`` has to read, as one read: the bytes queued before any EOF or
        reset (coalesced, as a socket read takes what has arrived), or that EOF or reset."""
        inbox = self._inbox[side]
        transport = self.transports[side]
        if not self.deliverable(side):
            return
        if transport.is_closing():
            inbox.clear()  # it closed its end: it reads nothing more
            return
        protocol = self.protocols[side]
        item = inbox[0]
        if isinstance(item, _Reset):
            inbox.clear()
            transport.connection_lost(ConnectionResetError("connection reset by peer"))
        elif isinstance(item, _Eof):
            inbox.popleft()
            eof_received = getattr(protocol, "eof_received", None)
            if not (eof_received is not None and eof_received()):
                transport.close()
        else:
            chunks: list[bytes] = []
            while inbox and isinstance(head := inbox[0], bytes):
                chunks.append(head)
                inbox.popleft()
            data = b"".join(chunks)
            taken = _feed(protocol, data, transport)
            if taken < len(data) and not transport.is_closing():
                inbox.appendleft(data[taken:])  # it stopped reading: the rest waits
            self.transports[1 - side]._drained()
        self.kick(side)


# -- the network ---------------------------------------------------------------------------------


class FakeNetwork:
    """Fake TCP between protocols on one SimLoop, addressed by "host:port" strings.

    Delivery is FIFO per direction, and directions take turns in the order they got
    something to deliver: each loop turn, every direction that has bytes delivers them
    as one read. A write never reaches the other end inside the writer's callback."""

    def __init__(self) -> None:
        self.loop = running_sim_loop()
        self.clock = self.loop.clock
        self.wires: list[Wire] = []
        self._listeners: dict[str, Callable[[], asyncio.BaseProtocol]] = {}
        self._to_deliver: dict[tuple[Wire, int], None] = {}  # an ordered set
        self._pump_scheduled = False
        self._ids = itertools.count(1)
        self._apart: set[frozenset[str]] = set()
        self._paused: set[str] = set()

    # -- addresses ------------------------------------------------------------------------

    def listen(self, address: str, accept: Callable[[], asyncio.BaseProtocol]) -> None:
        """Take connections to ``address`` with protocols made by ``accept``."""
        if address in self._listeners:
            raise OSError(f"address {address} already in use")
        self._listeners[address] = accept

    def unlisten(self, address: str) -> None:
        self._listeners.pop(address, None)

    def connect(self, origin: str, address: str, protocol: P) -> Wire:
        """Link ``protocol`` (at ``origin``, a label) to the listener at ``address``;
        ``connection_made`` is called on both ends before this returns (listener first)."""
        accept = self._listeners.get(address)
        if accept is None:
            raise ConnectionRefusedError(f"nothing listens at {address}")
        if frozenset((origin, address)) in self._apart:
            raise ConnectionRefusedError(f"{origin} and {address} are partitioned")
        accepted = accept()
        wire_id = next(self._ids)
        host, _, port = address.rpartition(":")
        origin_host = origin.rpartition(":")[0] or origin or "dialler"
        wire = Wire(
            self,
            wire_id,
            (origin, address),
            (protocol, accepted),
            ((host, int(port)), (origin_host, 40000 + wire_id)),
        )
        self.wires.append(wire)
        if origin in self._paused or address in self._paused:
            wire.hold()  # the kernel takes the connection; the stopped process reads nothing
        accepted.connection_made(wire.transports[1])
        protocol.connection_made(wire.transports[0])
        return wire

    def dialer_from(self, origin: str) -> Dialer:
        """A ``Dialer`` (meshbus.broker.mesh.dialer) for the broker at ``origin``, which names
        its wires (``wire_between``, ``crash``)."""

        async def dial(host: str, port: int, new_link: Callable[[], Link]) -> Link:
            link = new_link()
            self.connect(origin, f"{host}:{port}", link)
            return link

        return dial

    @property
    def dialer(self) -> Dialer:
        """A ``Dialer`` for a broker whose wires need no name."""
        return self.dialer_from("")

    # -- wires ------------------------------------------------------------------------------

    def wires_of(self, address: str) -> list[Wire]:
        """The wires to or from ``address`` that are not broken."""
        return [w for w in self.wires if address in w.labels and not w.broken]

    def wire_between(self, one: str, other: str) -> Wire:
        """The one unbroken wire between two addresses, whichever dialled."""
        found = [w for w in self.wires_of(one) if set(w.labels) == {one, other}]
        assert len(found) == 1, f"wires between {one} and {other}: {found}"
        return found[0]

    def partition(self, one: str, other: str) -> None:
        """``one`` and ``other`` cannot reach each other: their wires break, and new
        connections between them are refused until ``heal``."""
        self._apart.add(frozenset((one, other)))
        for wire in self.wires_of(one):
            if set(wire.labels) == {one, other}:
                wire.cut()

    def heal(self, one: str, other: str) -> None:
        self._apart.discard(frozenset((one, other)))

    def pause(self, address: str) -> None:
        """The process at ``address`` stops (SIGSTOP): its wires, and any made to it
        meanwhile, carry nothing until ``resume``; connections to it still succeed."""
        self._paused.add(address)
        for wire in self.wires_of(address):
            wire.hold()

    def resume(self, address: str) -> None:
        """SIGCONT: what piled up on its wires is delivered, in order."""
        self._paused.discard(address)
        for wire in self.wires_of(address):
            if not self._paused & set(wire.labels):
                wire.release()

    def crash(self, address: str) -> None:
        """The host at ``address`` is gone: every wire of it breaks, nothing is accepted."""
        self.unlisten(address)
        for wire in self.wires_of(address):
            wire.cut()

    # -- running ------------------------------------------------------------------------------

    def _ready_to_deliver(self, wire: Wire, side: int) -> None:
        self._to_deliver[(wire, side)] = None
        if not self._pump_scheduled:
            self._pump_scheduled = True
            self.loop.call_soon(self._pump)

    def _pump(self) -> None:
        self._pump_scheduled = False
        turn, self._to_deliver = list(self._to_deliver), {}
        for wire, side in turn:
            try:
                wire.deliver(side)
            except Exception as exc:
                # As asyncio's transports do: the connection is closed with the error, and
                # the error reported (here, to the next settle).
                self.loop.call_exception_handler(
                    {
                        "message": f"{wire.protocols[side]!r} failed to take its input",
                        "exception": exc,
                    }
                )
                wire.transports[side].fail(exc)

    async def settle(self, max_turns: int = 10_000) -> None:
        """Run until nothing is left to deliver and no callback is pending (timers not yet
        due stay pending: time does not move here). Raises CallbackFailed for the first
        exception a callback raised meanwhile."""
        loop = self.loop
        for _ in range(max_turns):
            await asyncio.sleep(0)
            loop.raise_failures()
            if loop.idle():
                return
        raise NotSettled(f"still busy after {max_turns} loop turns")

    async def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``, stopping at every loop timer that falls due on
        the way, and settle after each."""
        clock = self.clock
        target = clock.now + seconds
        await self.settle()
        while (due := self.loop.next_timer()) is not None and due <= target:
            clock.advance(max(0.0, due - clock.now))
            await self.settle()
        clock.advance(target - clock.now)
        await self.settle()
