"""In-process fakes for the broker: one fake time, fake TCP, a fake network of brokers and
a raw protocol client. No process, no socket, no sleep.

* ``FakeClock`` -- the one time of a test: the brokers' clock (``Broker(clock=...)``) and
  the event loop's.
* ``SimLoop`` -- an asyncio event loop without I/O whose time is a ``FakeClock``. The
  broker also keeps time through the loop (a claim that lost retries after a random
  pause, a join waits, a dial times out), and those timers must not run on the wall
  clock either. Time moves only when the test moves it, so a run is the same every
  time; a test that awaits something only the passing of time could bring fails at
  once with ``SimulationStalled`` instead of hanging. ``tests/unit/broker/conftest.py``
  makes it the loop of every test here.
* ``FakeTransport`` -- what ``Link`` uses of an ``asyncio.Transport``. On its own it
  captures what is written (``captured``); as one end of a ``Wire`` it carries it to the
  other end.
* ``Wire`` -- one fake TCP connection. Bytes are queued per direction (FIFO) and
  delivered on a later loop turn, never inside the writer's frame handling; a graceful
  close is an EOF after the data, an abort a reset; a reader that paused reading gets
  nothing until it resumes. ``cut`` breaks it (both ends see ``connection_lost``);
  ``hold`` and ``release`` stall it without closing it (a hung host, a partition TCP has
  not given up on).
* ``FakeNetwork`` -- brokers on one loop keyed by addresses like ``"a:1"``:
  ``dialer_from(address)`` is a ``Dialer`` for ``Broker(dialer=...)``; ``settle()`` runs
  until nothing is left to deliver and no callback is pending, and raises
  ``CallbackFailed`` for an exception asyncio would only have logged;
  ``advance(seconds)`` moves the clock timer by timer, settling after each;
  ``partition``/``heal`` keep two addresses apart, ``crash`` takes one off the network.
* ``FakeClient`` -- a hand-driven protocol client on a wire to one broker (a connector,
  an operator, or a broker of its own making), like ``RawLink`` of the integration
  tests but in-process.
* ``start_broker`` / ``build_mesh`` -- in-process brokers founding and joining a mesh,
  with their timers off: tests call ``housekeeping`` and ``expire_requests`` themselves.
* ``Hub`` -- a ``Forwarder`` with real tables and an outbox, and links on capturing
  transports, without a ``Broker``: the forwarding decisions on their own.

Everything here is deterministic: one thread, FIFO queues, no wall clock. The broker's
random choices come from ``random`` (claim back-off, slot picks), which the conftest
seeds per test, and from Random instances of its routing and group tables, which
``start_broker`` seeds.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import selectors
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from meshbus.address import Anycast, Unicast
from meshbus.broker.config import BrokerConfig
from meshbus.broker.core.dispatch import ControlDispatch
from meshbus.broker.core.endpoint import CloseReason, Endpoint, PeerInfo, is_peer
from meshbus.broker.core.forward import Forwarder
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox, TrafficStats
from meshbus.broker.core.pending import PendingTable
from meshbus.broker.core.routing import RoutingTable
from meshbus.broker.core.usage import UsageTable
from meshbus.broker.mesh.dialer import Dialer
from meshbus.broker.security.users import UserTable
from meshbus.broker.server import Broker
from meshbus.protocol.codec import (
    ControlFrame,
    DataFrame,
    Frame,
    FrameDecoder,
    encode_control,
    encode_control_raw,
    encode_data,
)
from meshbus.protocol.control import (
    BODY_TYPES,
    NONCE_SIZE,
    ROLE_CONNECTOR,
    TOKEN_PROOF_SIZE,
    AddressBody,
    Auth,
    Body,
    Challenge,
    Claim,
    DeliveryFailure,
    Error,
    GroupBind,
    GroupBound,
    GroupEnd,
    Hello,
    Membership,
    MembersRequest,
    Move,
    Register,
    Relayed,
    Revoked,
    Routed,
    StreamRequest,
    Welcome,
)
from meshbus.protocol.layout import DEFAULT_MAX_FRAME, ControlType, ErrorCode

P = TypeVar("P", bound=asyncio.BaseProtocol)

# Far from 0: "0" is "never" in some of the broker's bookkeeping (move_sent, boost_until).
CLOCK_START = 1000.0


class SimulationStalled(RuntimeError):
    """Nothing can run until time moves, and only the test moves time: the test awaits
    something that needs ``FakeNetwork.advance``, or that never comes."""


class NotSettled(RuntimeError):
    """Still busy after the turn limit of ``settle``: frames or callbacks feed each other
    without end."""


class CallbackFailed(RuntimeError):
    """A loop callback or a protocol callback raised. asyncio would log it and go on (and
    close the connection, for a protocol); a test should hear of it."""


# -- time ---------------------------------------------------------------------------------


class FakeClock:
    """A clock that moves only when told to; call it for the time, like time.monotonic."""

    def __init__(self, start: float = CLOCK_START) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time forward. Loop timers that fall due run at the next loop turn
        (``FakeNetwork.settle``); ``FakeNetwork.advance`` steps through them in order."""
        if seconds < 0:
            raise ValueError("time does not go back")
        self.now += seconds


class _NoIO(selectors.BaseSelector):
    """The selector of a loop with nothing to wait for but its own timers."""

    def __init__(self, loop: SimLoop) -> None:
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:
            return []
        loop = self._loop
        if timeout is not None and loop.auto_advance:
            loop.clock.advance(timeout)
            return []
        pending = "no timer at all" if timeout is None else f"the next timer in {timeout:g} s"
        raise SimulationStalled(
            f"nothing can run until time moves ({pending}); advance it "
            "(await network.advance(seconds)) or stop awaiting what never comes"
        )

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        raise NotImplementedError("a SimLoop has no file descriptors")

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        raise NotImplementedError("a SimLoop has no file descriptors")

    def get_map(self) -> dict[Any, selectors.SelectorKey]:
        return {}


class SimLoop(asyncio.BaseEventLoop):
    """An event loop with no I/O whose time is ``clock``.

    Callbacks run in the order they were scheduled, timers in the order they fall due,
    all on fake time. With ``auto_advance`` the clock jumps to the next timer when
    nothing else can run (a simulation's time); without it (tests) that is a
    ``SimulationStalled``."""

    # Attributes of BaseEventLoop that it does not declare to type checkers.
    _ready: deque[asyncio.Handle]
    _scheduled: list[asyncio.TimerHandle]

    def __init__(self, clock: FakeClock | None = None, *, auto_advance: bool = False) -> None:
        super().__init__()
        self.clock = clock or FakeClock()
        self.auto_advance = auto_advance
        self._selector = _NoIO(self)
        # What asyncio would only log: ``FakeNetwork.settle`` raises the first of them.
        self.failures: list[dict[str, Any]] = []
        self.set_exception_handler(lambda loop, context: self.failures.append(context))

    def time(self) -> float:
        return self.clock.now

    def _process_events(self, event_list: list[Any]) -> None:
        pass  # no I/O, so no events

    def _write_to_self(self) -> None:
        pass  # nothing blocks in select, so nothing needs waking

    def next_timer(self) -> float | None:
        """When the earliest live timer falls due; None if there is none."""
        live = [handle.when() for handle in self._scheduled if not handle.cancelled()]
        return min(live) if live else None

    def raise_failures(self) -> None:
        if self.failures:
            context = self.failures.pop(0)
            exc = context.get("exception")
            raise CallbackFailed(context.get("message", "a callback failed")) from exc

    def idle(self) -> bool:
        """No callback ready to run, and no timer due."""
        if any(not handle.cancelled() for handle in self._ready):
            return False
        due = self.next_timer()
        return due is None or due > self.time()


def running_sim_loop() -> SimLoop:
    loop = asyncio.get_running_loop()
    if not isinstance(loop, SimLoop):
        raise RuntimeError(
            "the fakes need a SimLoop (tests/unit/broker/conftest.py makes it the loop there)"
        )
    return loop


# -- transports and wires -------------------------------------------------------------------


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


# -- a raw client ----------------------------------------------------------------------------------


class FakeClient(asyncio.Protocol):
    """A hand-driven protocol connection to one broker: frames out, decoded frames in.

    Frames the broker sends pile up in ``inbox`` until taken (``answer``, ``take``)."""

    def __init__(self, network: FakeNetwork, name: str = "raw") -> None:
        self.network = network
        self.name = name
        self.decoder = FrameDecoder()
        self.inbox: deque[Frame] = deque()
        self.transport: FakeTransport | None = None
        self.eof = False
        self.lost = False
        self.lost_with: Exception | None = None
        self.wire: Wire | None = None
        self._correlations = itertools.count(1)

    @classmethod
    def connect(cls, network: FakeNetwork, address: str, name: str = "raw") -> FakeClient:
        client = cls(network, name)
        client.wire = network.connect(name, address, client)
        return client

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, FakeTransport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.decoder.feed(data)
        while (frame := self.decoder.next_frame()) is not None:
            self.inbox.append(frame)

    def eof_received(self) -> bool:
        self.eof = True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.lost_with = exc

    # -- sending ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """The broker closed the link (or it broke)."""
        return self.eof or self.lost

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def send_control(self, type_: ControlType | int, body: Body, correlation: int = -1) -> int:
        """Send a control frame; returns its correlation (a fresh one unless given)."""
        if correlation < 0:
            correlation = next(self._correlations) + 1000
        self.send(encode_control(ControlType(type_), body, correlation))
        return correlation

    def send_raw_control(self, type_: int, body: bytes, correlation: int) -> None:
        """A control frame of any type number, with a body as given."""
        self.send(encode_control_raw(type_, body, correlation))

    def send_data(self, dst: bytes, src: bytes, payload: bytes = b"", **fields: int) -> None:
        self.send(encode_data(dst, src, payload, **fields))

    def close(self) -> None:
        assert self.transport is not None
        self.transport.close()

    def abort(self) -> None:
        """Go away as a crashed process does: a reset."""
        assert self.transport is not None
        self.transport.abort()

    # -- receiving -----------------------------------------------------------------------------

    def take(self, type_: ControlType | None = None) -> list[Frame]:
        """Every frame received so far (of control type ``type_`` only, if given), taken
        out of the inbox."""
        if type_ is None:
            frames = list(self.inbox)
            self.inbox.clear()
            return frames
        taken: list[Frame] = []
        kept: deque[Frame] = deque()
        for frame in self.inbox:
            wanted = isinstance(frame, ControlFrame) and frame.type == type_
            (taken if wanted else kept).append(frame)
        self.inbox = kept
        return taken

    def take_data(self) -> list[DataFrame]:
        frames = [f for f in self.inbox if isinstance(f, DataFrame)]
        self.inbox = deque(f for f in self.inbox if not isinstance(f, DataFrame))
        return frames

    def controls(self) -> list[ControlFrame]:
        """The control frames received and not taken, left in the inbox."""
        return [f for f in self.inbox if isinstance(f, ControlFrame)]

    def answer(self, correlation: int) -> ControlFrame:
        """Take the one frame that answers ``correlation``."""
        found = [f for f in self.controls() if f.correlation == correlation]
        assert len(found) == 1, (
            f"{self.name}: {len(found)} answers to correlation {correlation}; inbox: "
            f"{[describe_frame(f) for f in self.inbox]}"
        )
        self.inbox.remove(found[0])
        return found[0]

    async def ask(self, type_: ControlType, body: Body) -> ControlFrame:
        """Send a request, settle, and take its answer."""
        correlation = self.send_control(type_, body)
        await self.network.settle()
        return self.answer(correlation)

    # -- the usual conversations -------------------------------------------------------------

    async def hello(
        self, role: str = ROLE_CONNECTOR, *, name: str | None = None, **fields: Any
    ) -> Welcome:
        frame = await self.ask(
            ControlType.HELLO, Hello(role=role, name=self.name if name is None else name, **fields)
        )
        assert frame.type == ControlType.WELCOME, describe_frame(frame)
        assert isinstance(frame.body, Welcome)
        return frame.body

    async def register(self, server: str = "svc", instance: int = 0) -> bytes:
        frame = await self.ask(ControlType.REGISTER, Register(server=server, instance=instance))
        assert frame.type == ControlType.REGISTERED, describe_frame(frame)
        assert isinstance(frame.body, AddressBody)
        return frame.body.address

    async def join(self, member: bytes, group: bytes) -> None:
        frame = await self.ask(ControlType.JOIN, Membership(member=member, group=group))
        assert frame.type == ControlType.OK, describe_frame(frame)

    async def unregister(self, address: bytes) -> None:
        frame = await self.ask(ControlType.UNREGISTER, AddressBody(address=address))
        assert frame.type == ControlType.OK, describe_frame(frame)


_SAMPLE_ADDRESS = Unicast("sample", 1).to_bytes()
_SAMPLE_GROUP = Anycast("sample").to_bytes()
# Bodies for the types whose bodies have required fields; the others are their defaults.
_SAMPLES: dict[ControlType, Body] = {
    ControlType.REGISTER: Register(server="sample", instance=1),
    ControlType.REGISTERED: AddressBody(address=_SAMPLE_ADDRESS),
    ControlType.UNREGISTER: AddressBody(address=_SAMPLE_ADDRESS),
    ControlType.JOIN: Membership(member=_SAMPLE_ADDRESS, group=_SAMPLE_GROUP),
    ControlType.LEAVE: Membership(member=_SAMPLE_ADDRESS, group=_SAMPLE_GROUP),
    ControlType.ERROR: Error(code=int(ErrorCode.UNAVAILABLE)),
    ControlType.TIMEOUT: DeliveryFailure(msg_id=1, src=_SAMPLE_ADDRESS, dst=_SAMPLE_ADDRESS),
    ControlType.NO_ROUTE: DeliveryFailure(msg_id=1, src=_SAMPLE_ADDRESS, dst=_SAMPLE_ADDRESS),
    ControlType.CLAIM: Claim(key=_SAMPLE_ADDRESS),
    ControlType.RELEASE: Claim(key=_SAMPLE_ADDRESS),
    ControlType.MOVE: Move(address="sample:1"),
    ControlType.ROUTED: Routed(seq=1),
    ControlType.MEMBERS: MembersRequest(group=_SAMPLE_GROUP),
    ControlType.GROUP_BIND: GroupBind(group=_SAMPLE_GROUP, key=b"k"),
    ControlType.GROUP_BOUND: GroupBound(member=_SAMPLE_ADDRESS),
    ControlType.GROUP_END: GroupEnd(group=_SAMPLE_GROUP, key=b"k"),
    ControlType.RELAYED: Relayed(type=int(ControlType.OK)),
    ControlType.STREAM: StreamRequest(op="list"),
    ControlType.REVOKED: Revoked(address=_SAMPLE_ADDRESS),
    ControlType.CHALLENGE: Challenge(nonce=bytes(NONCE_SIZE)),
    ControlType.AUTH: Auth(user="sample", token_proof=bytes(TOKEN_PROOF_SIZE)),
}


def sample_body(type_: ControlType) -> Body:
    """A valid body for a control frame of ``type_`` (one a receiver decodes)."""
    return _SAMPLES.get(type_) or BODY_TYPES[type_]()


def describe_frame(frame: Frame) -> str:
    if isinstance(frame, DataFrame):
        return f"DATA(flags={frame.flags:#x}, msg_id={frame.msg_id}, payload={frame.payload!r})"
    try:
        name = ControlType(frame.type).name
    except ValueError:
        name = f"type {frame.type}"
    return f"{name}#{frame.correlation} {frame.body!r}"


def decode_all(data: bytes | bytearray) -> list[Frame]:
    """Every frame in ``data``, which must end on a frame boundary."""
    decoder = FrameDecoder()
    decoder.feed(data)
    frames: list[Frame] = []
    while (frame := decoder.next_frame()) is not None:
        frames.append(frame)
    assert decoder.buffered == 0, f"{decoder.buffered} bytes of a partial frame"
    return frames


# -- in-process brokers ----------------------------------------------------------------------------


def address_of(name: str) -> str:
    """The address the fake network gives the broker named ``name``."""
    return f"{name}:1"


async def start_broker(
    network: FakeNetwork,
    name: str,
    *,
    seeds: Sequence[str] = (),
    reread_users: Callable[[], UserTable] | None = None,
    **settings: Any,
) -> Broker:
    """A broker named ``name`` at ``address_of(name)``: it founds a mesh, or joins through
    ``seeds``; ``settings`` are BrokerConfig fields; ``reread_users`` is what a reload
    (``broker.sign_in.reload()``) reads. Its timers are off: call ``housekeeping`` and
    ``expire_requests`` after moving the clock."""
    address = address_of(name)
    config = BrokerConfig(seeds=list(seeds), **settings)
    # Seeded per name, so anycast picks, group bindings and redial jitter are the same
    # each run.
    broker = Broker(
        config,
        clock=network.clock,
        dialer=network.dialer_from(address),
        rng=random.Random(sum(name.encode())),
        reread_users=reread_users,
    )
    network.listen(address, broker.new_link)
    broker.named(name, address)
    await broker.run_mesh(timers=False)
    await network.settle()
    return broker


async def tick(network: FakeNetwork, brokers: Iterable[Broker], interval: float = 0.5) -> None:
    """One heartbeat interval of fake time: each broker in ``brokers`` does its
    housekeeping (its LOAD is its heartbeat), as its own timer would; the others, whose
    timers stay off, say nothing -- a paused process, or a hung one."""
    network.clock.advance(interval)
    for broker in brokers:
        broker.housekeeping()
    await network.settle()


async def build_mesh(network: FakeNetwork, count: int, **settings: Any) -> list[Broker]:
    """``count`` brokers named a, b, c, ...: the first founds the mesh, the others join
    through it one after the other. Every broker is linked to every other on return."""
    names = [chr(ord("a") + i) for i in range(count)]
    first = await start_broker(network, names[0], **settings)
    brokers = [first]
    for name in names[1:]:
        brokers.append(await start_broker(network, name, seeds=[address_of("a")], **settings))
    for broker in brokers:
        assert broker.mesh.ready
        assert sorted(broker.peers.names()) == sorted(set(names) - {broker.config.name})
    return brokers


def connect_client(network: FakeNetwork, broker: Broker | str, name: str = "raw") -> FakeClient:
    """A FakeClient linked to ``broker`` (a Broker, or the address of one)."""
    address = broker if isinstance(broker, str) else broker.config.advertise
    return FakeClient.connect(network, address, name)


async def connector(
    network: FakeNetwork, broker: Broker, name: str = "conn", **hello: Any
) -> FakeClient:
    """A FakeClient that said HELLO as a connector to ``broker``."""
    client = connect_client(network, broker, name)
    await client.hello(**hello)
    return client


def broker_side(client: FakeClient) -> Link:
    """The broker's link of ``client``'s wire."""
    assert client.wire is not None
    link = client.wire.protocols[1]
    assert isinstance(link, Link)
    return link


def routes_everywhere(brokers: Iterable[Broker], address: bytes) -> dict[str, str | None]:
    """Where each broker routes ``address``: "local", a peer's name, or None."""
    result: dict[str, str | None] = {}
    for broker in brokers:
        owner = broker.routing.owner(address)
        if owner is None:
            result[broker.config.name] = None
        else:
            result[broker.config.name] = owner.name if owner.is_peer else "local"
    return result


# -- a forwarder without a broker -----------------------------------------------------------------


class Hub:
    """A ``Forwarder`` with a real RoutingTable, PendingTable and Outbox, and links on
    capturing transports: the forwarding decisions without a Broker or a network.

    ``connector``/``peer`` make open links; ``feed`` hands a link one read; what each link
    was sent is in ``received``. Deadlines are on ``clock``."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.clock = clock or FakeClock()
        self.routing: RoutingTable[Endpoint] = RoutingTable(slot=1, is_remote=is_peer)
        self.pending: PendingTable[Endpoint] = PendingTable()
        self.stats = TrafficStats()
        self.outbox = Outbox(self.stats)
        self.traced: list[tuple[str, bytes, int, bytes]] = []
        self.forwarder = Forwarder(
            self.routing,
            self.pending,
            self.outbox,
            self.stats,
            self._deadline,
            lambda hop, src, msg_id, dst: self.traced.append((hop, src, msg_id, dst)),
            UsageTable(UserTable, self.routing),
        )
        self.dispatch = ControlDispatch(self.outbox)
        self.dispatch.install(self._no_handshake, {})
        self.closed: list[tuple[Link, CloseReason]] = []
        self._ids = itertools.count(1)

    def _deadline(self, timeout_ms: int) -> float:
        return self.clock() + (timeout_ms / 1000 if timeout_ms else 30.0)

    def _no_handshake(self, link: Link, frame: ControlFrame) -> None:
        raise AssertionError(f"{link!r} got {describe_frame(frame)} while handshaking")

    def link(self, max_frame: int = DEFAULT_MAX_FRAME) -> Link:
        """A new accepted link on a capturing transport, still handshaking."""
        link = Link(
            next(self._ids),
            routing=self.routing,
            forwarder=self.forwarder,
            dispatch=self.dispatch,
            outbox=self.outbox,
            on_open=lambda link: None,
            on_close=lambda link, reason: self.closed.append((link, reason)),
            max_frame=max_frame,
            max_pending_bytes=1 << 30,
        )
        attach(link)
        return link

    def connector(
        self,
        name: str = "conn",
        max_frame: int = DEFAULT_MAX_FRAME,
        session: bytes = b"",
        batched_no_route: bool = False,
    ) -> Link:
        link = self.link(max_frame)
        link.open_as_connector(
            name,
            session or name.encode().ljust(16, b"."),
            max_frame,
            False,
            batched_no_route=batched_no_route,
        )
        return link

    def peer(self, name: str, tag_out: int = 0x0A0B0C0D) -> Link:
        """A link to peer broker ``name``; its frames must carry our link id as their tag."""
        link = self.link()
        info = PeerInfo(
            listen=address_of(name),
            slot=2,
            tag_in=link.link_id,
            tag_out=tag_out.to_bytes(4, "big"),
            clock=self.clock,
            budget=1.5,
        )
        link.open_as_peer(name, info, DEFAULT_MAX_FRAME)
        return link

    def feed(self, link: Link, *frames: bytes) -> None:
        """``frames`` arrive at ``link`` in one read."""
        feed(link, b"".join(frames))

    def received(self, link: Link) -> list[Frame]:
        """What ``link`` was sent since the last call."""
        transport = link.transport
        assert isinstance(transport, FakeTransport)
        data = bytes(transport.captured)
        transport.captured.clear()
        return decode_all(data)
