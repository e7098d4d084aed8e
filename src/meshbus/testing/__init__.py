"""In-process fakes for brokers and clients: one fake time, fake TCP, a fake network of brokers and
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
* ``connect_over`` -- a real connector (``meshbus.connect``'s client) linked to those
  brokers through the fake network (``client_dialer``), its random choices seeded: its
  failover, moves, redirects and resends on fake time.
* ``Hub`` -- a ``Forwarder`` with real tables and an outbox, and links on capturing
  transports, without a ``Broker``: the forwarding decisions on their own.

Everything here is deterministic: one thread, FIFO queues, no wall clock. The broker's
random choices come from ``random`` (claim back-off, slot picks), which the conftest
seeds per test, and from Random instances of its routing and group tables, which
``start_broker`` seeds; a connector's from the Random ``connect_over`` seeds.
"""

from __future__ import annotations

from meshbus.testing.brokers import (
    Hub,
    address_of,
    broker_side,
    build_mesh,
    connect_client,
    connector,
    routes_everywhere,
    start_broker,
    tick,
)
from meshbus.testing.clients import client_dialer, connect_over
from meshbus.testing.network import FakeNetwork, FakeTransport, Wire, attach, feed
from meshbus.testing.raw import FakeClient, decode_all, describe_frame, sample_body
from meshbus.testing.sim import (
    CLOCK_START,
    CallbackFailed,
    FakeClock,
    NotSettled,
    SimLoop,
    SimulationStalled,
    running_sim_loop,
)

__all__ = [
    "CLOCK_START",
    "CallbackFailed",
    "FakeClient",
    "FakeClock",
    "FakeNetwork",
    "FakeTransport",
    "Hub",
    "NotSettled",
    "SimLoop",
    "SimulationStalled",
    "Wire",
    "address_of",
    "attach",
    "broker_side",
    "build_mesh",
    "client_dialer",
    "connect_client",
    "connect_over",
    "connector",
    "decode_all",
    "describe_frame",
    "feed",
    "routes_everywhere",
    "running_sim_loop",
    "sample_body",
    "start_broker",
    "tick",
]
