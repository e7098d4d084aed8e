"""The fakes keep the promises the broker tests (and the simulation to come) rely on:
FIFO delivery on a later turn, TCP-like closes, cuts, holds, and time that moves only
when told."""

from __future__ import annotations

import asyncio

import pytest

from meshbus.testing import (
    CallbackFailed,
    FakeClock,
    FakeNetwork,
    SimLoop,
    SimulationStalled,
    running_sim_loop,
)


class Recorder(asyncio.Protocol):
    """A protocol that writes down what happens to it."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.events.append("made")

    def data_received(self, data: bytes) -> None:
        self.events.append(data.decode())

    def eof_received(self) -> bool:
        self.events.append("eof")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.events.append(f"lost:{type(exc).__name__ if exc else None}")


def pair(network: FakeNetwork) -> tuple[Recorder, Recorder]:
    server = Recorder()
    network.listen("s:1", lambda: server)
    client = Recorder()
    network.connect("c", "s:1", client)
    return client, server


async def test_the_loop_of_these_tests_runs_on_the_fake_clock(clock: FakeClock) -> None:
    loop = running_sim_loop()
    assert isinstance(loop, SimLoop)
    assert loop.time() == clock() == clock.now
    clock.advance(2.5)
    assert loop.time() == clock.now


async def test_bytes_arrive_on_a_later_turn_in_order_per_direction(network: FakeNetwork) -> None:
    client, server = pair(network)
    assert client.transport is not None
    assert server.transport is not None
    client.transport.write(b"1")
    client.transport.write(b"2")
    server.transport.write(b"x")
    assert server.events == ["made"], "nothing arrives inside the writer's callback"
    await network.settle()
    # One read takes what has arrived, as a socket read does.
    assert server.events == ["made", "12"]
    assert client.events == ["made", "x"]


async def test_a_close_delivers_what_was_written_then_eof(network: FakeNetwork) -> None:
    client, server = pair(network)
    assert client.transport is not None
    client.transport.write(b"last words")
    client.transport.close()
    client.transport.write(b"after close")  # lost, as on a closed socket
    await network.settle()
    assert server.events == ["made", "last words", "eof", "lost:None"]
    assert client.events == ["made", "lost:None"]


async def test_an_abort_resets_the_other_end(network: FakeNetwork) -> None:
    client, server = pair(network)
    assert client.transport is not None
    client.transport.write(b"never read")
    client.transport.abort()
    await network.settle()
    assert server.events == ["made", "lost:ConnectionResetError"]
    assert client.events == ["made", "lost:None"]


async def test_a_cut_wire_loses_both_ends_once(network: FakeNetwork) -> None:
    client, server = pair(network)
    assert client.transport is not None
    client.transport.write(b"in flight")
    wire = network.wire_between("c", "s:1")
    wire.cut()
    wire.cut()
    await network.settle()
    assert server.events == ["made", "lost:ConnectionResetError"]
    assert client.events == ["made", "lost:ConnectionResetError"]
    assert wire.broken
    assert network.wires_of("s:1") == []


async def test_a_held_wire_delivers_nothing_until_released(network: FakeNetwork) -> None:
    client, server = pair(network)
    assert client.transport is not None
    wire = network.wire_between("c", "s:1")
    wire.hold()
    client.transport.write(b"a")
    client.transport.write(b"b")
    await network.settle()
    assert server.events == ["made"]
    assert client.transport.get_write_buffer_size() == 2
    wire.release()
    await network.settle()
    assert server.events == ["made", "ab"]
    assert client.transport.get_write_buffer_size() == 0


async def test_a_paused_reader_gets_nothing_until_it_resumes(network: FakeNetwork) -> None:
    client, server = pair(network)
    assert client.transport is not None
    assert server.transport is not None
    server.transport.pause_reading()
    client.transport.write(b"waits")
    await network.settle()
    assert server.events == ["made"]
    server.transport.resume_reading()
    await network.settle()
    assert server.events == ["made", "waits"]


async def test_a_partition_breaks_the_wires_and_refuses_new_ones_until_healed(
    network: FakeNetwork,
) -> None:
    client, server = pair(network)
    network.partition("c", "s:1")
    await network.settle()
    assert client.events[-1] == server.events[-1] == "lost:ConnectionResetError"
    with pytest.raises(ConnectionRefusedError):
        network.connect("c", "s:1", Recorder())
    network.connect("d", "s:1", Recorder())  # others still get through
    network.heal("c", "s:1")
    network.connect("c", "s:1", Recorder())


async def test_a_protocol_that_raises_fails_the_next_settle(network: FakeNetwork) -> None:
    class Broken(Recorder):
        def data_received(self, data: bytes) -> None:
            raise ValueError("cannot take it")

    broken = Broken()
    network.listen("b:1", lambda: broken)
    client = Recorder()
    network.connect("c", "b:1", client)
    assert client.transport is not None
    client.transport.write(b"boom")
    with pytest.raises(CallbackFailed) as failed:
        await network.settle()
    assert isinstance(failed.value.__cause__, ValueError)
    await network.settle()
    assert broken.events[-1] == "lost:ValueError", "its connection is closed, as asyncio does"
    assert client.events[-1] == "lost:ConnectionResetError"


async def test_nothing_listens_at_an_unknown_address(network: FakeNetwork) -> None:
    with pytest.raises(ConnectionRefusedError):
        network.connect("c", "nobody:1", Recorder())


async def test_advance_runs_loop_timers_in_order_on_fake_time(
    network: FakeNetwork, clock: FakeClock
) -> None:
    loop = running_sim_loop()
    start = clock.now
    fired: list[tuple[str, float]] = []
    loop.call_later(0.5, lambda: fired.append(("half", clock.now - start)))
    loop.call_later(0.1, lambda: fired.append(("tenth", clock.now - start)))
    loop.call_later(5.0, lambda: fired.append(("late", clock.now - start)))
    await network.settle()
    assert fired == [], "settle does not move time"
    await network.advance(1.0)
    assert [name for name, _ in fired] == ["tenth", "half"]
    assert [at for _, at in fired] == pytest.approx([0.1, 0.5]), "each at its own time"
    assert clock.now - start == pytest.approx(1.0)


def test_awaiting_what_only_time_brings_stalls_at_once() -> None:
    """A plain test with a loop of its own: the stall ends that loop's run."""

    async def wait_a_second() -> None:
        later = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(1.0, later.set_result, None)
        await later

    stalled = SimLoop()
    try:
        with pytest.raises(SimulationStalled):
            stalled.run_until_complete(wait_a_second())
    finally:
        tasks = asyncio.all_tasks(stalled)
        for task in tasks:
            task.cancel()
        stalled.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        stalled.close()
