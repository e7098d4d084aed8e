"""Claims between in-process brokers: a fixed address is registered once mesh-wide, and a
connector's own session takes its address back from anywhere."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest

from meshbus.address import Unicast
from meshbus.broker.server import Broker
from meshbus.protocol.control import Error, Register
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.testing import (
    FakeClient,
    FakeNetwork,
    address_of,
    build_mesh,
    connector,
    describe_frame,
    routes_everywhere,
)

WANTED = Unicast("svc", 7)
# A claim that lost retries up to 6 times after pauses of at most 10 ms x the attempt.
RETRIES_DONE = 1.0


def outcome(client: FakeClient, correlation: int) -> str:
    """REGISTERED, or the name of the error code the register was refused with."""
    answer = client.answer(correlation)
    if answer.type == ControlType.REGISTERED:
        return "REGISTERED"
    assert answer.type == ControlType.ERROR, describe_frame(answer)
    assert isinstance(answer.body, Error)
    return ErrorCode(answer.body.code).name


def no_reservations_left(brokers: list[Broker]) -> None:
    """No address is reserved anywhere (slot reservations last as long as their links)."""
    held = {
        b.config.name: len(b.sync.claims) - len(b.sync.claims.reserved_slots()) for b in brokers
    }
    assert held == dict.fromkeys(held, 0)


async def register_at_once(
    network: FakeNetwork, size: int, order: Sequence[int]
) -> tuple[list[Broker], list[FakeClient], dict[str, int]]:
    """A connector on each of ``size`` brokers; all send REGISTER svc:7 in one turn, in
    ``order`` (broker indexes)."""
    brokers = await build_mesh(network, size)
    clients = [
        await connector(network, broker, f"conn-{broker.config.name}", session=bytes([i]) * 16)
        for i, broker in enumerate(brokers)
    ]
    correlations = {
        clients[i].name: clients[i].send_control(
            ControlType.REGISTER, Register(server="svc", instance=7)
        )
        for i in order
    }
    return brokers, clients, correlations


@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["a-first", "b-first"])
async def test_of_two_simultaneous_claims_the_smaller_name_wins_in_the_first_round(
    network: FakeNetwork, order: tuple[int, int]
) -> None:
    _, clients, correlations = await register_at_once(network, 2, order)
    await network.settle()  # no time passes: no retry
    assert outcome(clients[0], correlations["conn-a"]) == "REGISTERED"


@pytest.mark.parametrize(
    "order",
    [(0, 1), (1, 0), *itertools.permutations(range(3))],
    ids=lambda order: "".join("abc"[i] for i in order),
)
async def test_simultaneous_registers_of_one_address_have_exactly_one_winner(
    network: FakeNetwork, order: tuple[int, ...]
) -> None:
    size = len(order)
    brokers, clients, correlations = await register_at_once(network, size, order)
    await network.advance(RETRIES_DONE)  # a round nobody won is retried
    outcomes = {c.name: outcome(c, correlations[c.name]) for c in clients}
    winners = [name for name, result in outcomes.items() if result == "REGISTERED"]
    assert len(winners) == 1, outcomes
    assert sorted(outcomes.values()).count("ADDRESS_IN_USE") == size - 1, outcomes
    home = winners[0].removeprefix("conn-")
    routes = routes_everywhere(brokers, WANTED.to_bytes())
    assert routes == {b.config.name: "local" if b.config.name == home else home for b in brokers}
    no_reservations_left(brokers)


async def test_a_connectors_session_takes_its_address_back_after_failover(
    network: FakeNetwork,
) -> None:
    """The connector reconnects to b while a still holds its address (a has not noticed
    it went): its session takes the address over; another session cannot."""
    brokers = await build_mesh(network, 3)
    a, b, c = brokers
    session = b"S" * 16
    before = await connector(network, a, "before", session=session)
    address = await before.register("svc", 7)
    await network.settle()
    after = await connector(network, b, "after", session=session)
    assert await after.register("svc", 7) == address
    await network.settle()
    assert routes_everywhere(brokers, address) == {"a": "b", "b": "local", "c": "b"}
    before.abort()  # the old link dies late: it no longer owns anything
    await network.settle()
    assert routes_everywhere(brokers, address) == {"a": "b", "b": "local", "c": "b"}
    rival = await connector(network, c, "rival", session=b"R" * 16)
    correlation = rival.send_control(ControlType.REGISTER, Register(server="svc", instance=7))
    await network.advance(RETRIES_DONE)
    assert outcome(rival, correlation) == "ADDRESS_IN_USE"
    no_reservations_left(brokers)


async def test_a_connector_of_a_crashed_broker_registers_its_address_again_elsewhere(
    network: FakeNetwork,
) -> None:
    brokers = await build_mesh(network, 3)
    a, b, c = brokers
    session = b"S" * 16
    before = await connector(network, a, "before", session=session)
    address = await before.register("svc", 7)
    await network.settle()
    network.crash(address_of("a"))
    await network.settle()
    assert routes_everywhere([b, c], address) == {"b": None, "c": None}
    after = await connector(network, c, "after", session=session)
    assert await after.register("svc", 7) == address
    await network.settle()
    assert routes_everywhere([b, c], address) == {"b": "c", "c": "local"}
    no_reservations_left([b, c])


async def test_a_peer_that_knows_the_owner_refuses_the_claim(network: FakeNetwork) -> None:
    """a and c cannot reach each other; b links both. c never saw a's claim or its ADD,
    so only b's refusal keeps the address unique."""
    brokers = await build_mesh(network, 3)
    a, _, c = brokers
    network.partition(address_of("a"), address_of("c"))
    await network.settle()
    assert (a.peers.names(), c.peers.names()) == (["b"], ["b"])
    first = await connector(network, a, "first", session=b"F" * 16)
    address = await first.register("svc", 7)
    await network.settle()
    assert routes_everywhere(brokers, address) == {"a": "local", "b": "a", "c": None}
    second = await connector(network, c, "second", session=b"2" * 16)
    correlation = second.send_control(ControlType.REGISTER, Register(server="svc", instance=7))
    await network.advance(RETRIES_DONE)
    assert outcome(second, correlation) == "ADDRESS_IN_USE"
    assert routes_everywhere(brokers, address) == {"a": "local", "b": "a", "c": None}


async def test_a_claim_won_after_its_connector_left_leaves_no_reservation(
    network: FakeNetwork,
) -> None:
    brokers = await build_mesh(network, 2)
    a, b = brokers
    wire = network.wire_between(address_of("a"), address_of("b"))
    leaving = await connector(network, a, "leaving", session=b"L" * 16)
    wire.hold()  # the CLAIM to b waits on the wire
    leaving.send_control(ControlType.REGISTER, Register(server="svc", instance=7))
    await network.settle()
    # The link is blocked (not reading) while its REGISTER waits, so an EOF would wait
    # too; a connection that breaks -- a write to a crashed client fails -- does not.
    assert leaving.wire is not None
    leaving.wire.cut()
    await network.settle()
    wire.release()  # b grants; a won, for a connector that has gone
    await network.settle()
    assert routes_everywhere(brokers, WANTED.to_bytes()) == {"a": None, "b": None}
    later = await connector(network, b, "later", session=b"N" * 16)
    correlation = later.send_control(ControlType.REGISTER, Register(server="svc", instance=7))
    await network.advance(RETRIES_DONE)
    assert outcome(later, correlation) == "REGISTERED", "nobody has the address"
    no_reservations_left(brokers)
