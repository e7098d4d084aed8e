"""A mesh that heals: brokers re-link after a partition, a pause or an island, within a
few heartbeat intervals of the network working again, and never dial one that left.

Every broker's timers are driven by the test: ``tick`` moves the fake clock one
heartbeat interval and runs every live broker's housekeeping, as its own timer would.
"""

from __future__ import annotations

import pytest

from meshbus.address import Anycast
from meshbus.broker.mesh.fence import minority
from meshbus.broker.mesh.groups import home_of
from meshbus.broker.server import Broker
from meshbus.protocol.codec import ControlFrame
from meshbus.protocol.control import ROLE_CONNECTOR, Error, GroupBind, GroupBound, Hello, Revoked
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.testing import (
    FakeClient,
    FakeClock,
    FakeNetwork,
    address_of,
    build_mesh,
    connect_client,
    connector,
    routes_everywhere,
    tick,
)

INTERVAL = 0.5
MISSES = 3
# The goal: whole again within 3 heartbeat intervals + 1 s of the network working again.
HEAL_BUDGET = 3 * INTERVAL + 1.0
POOL = Anycast("pool").to_bytes()


def linked(brokers: list[Broker]) -> dict[str, list[str]]:
    return {b.config.name: b.peers.names() for b in brokers}


def full_mesh(brokers: list[Broker]) -> dict[str, list[str]]:
    names = [b.config.name for b in brokers]
    return {n: sorted(set(names) - {n}) for n in names}


async def ticks_until_whole(
    network: FakeNetwork, clock: FakeClock, brokers: list[Broker], budget: float
) -> float:
    """Tick until every broker is linked to every other; the time it took."""
    start = clock.now
    while linked(brokers) != full_mesh(brokers):
        assert clock.now - start <= budget, f"not whole after {budget} s: {linked(brokers)}"
        await tick(network, brokers, INTERVAL)
    return clock.now - start


@pytest.fixture
async def mesh3(network: FakeNetwork) -> list[Broker]:
    return await build_mesh(network, 3, heartbeat_interval=INTERVAL, heartbeat_misses=MISSES)


async def test_a_cut_link_between_two_brokers_that_both_reach_a_third_is_repaired(
    network: FakeNetwork, clock: FakeClock, mesh3: list[Broker]
) -> None:
    _, b, _ = mesh3
    on_b = await connector(network, b, "on-b")
    address = await on_b.register("svc", 1)
    network.partition(address_of("a"), address_of("b"))
    await network.settle()
    assert linked(mesh3) == {"a": ["c"], "b": ["c"], "c": ["a", "b"]}
    assert routes_everywhere(mesh3, address)["a"] is None  # one hop only: a cannot reach it
    for _ in range(8):  # apart for 4 s: the dials fail, the backoff stays capped
        await tick(network, mesh3, INTERVAL)
    assert linked(mesh3)["a"] == ["c"]
    network.heal(address_of("a"), address_of("b"))
    await ticks_until_whole(network, clock, mesh3, HEAL_BUDGET)
    assert routes_everywhere(mesh3, address) == {"a": "b", "b": "local", "c": "b"}


async def test_a_broker_paused_past_its_heartbeat_budget_is_linked_again_when_it_resumes(
    network: FakeNetwork, clock: FakeClock, mesh3: list[Broker]
) -> None:
    a, b, c = mesh3
    on_b = await connector(network, b, "on-b")
    address = await on_b.register("svc", 1)
    # A pause (SIGSTOP): b reads nothing, writes nothing and runs no timer for 3 s.
    network.pause(address_of("b"))
    for _ in range(6):
        await tick(network, [a, c], INTERVAL)
    assert linked([a, c]) == {"a": ["c"], "c": ["a"]}, "its peers declared it dead"
    assert routes_everywhere([a, c], address) == {"a": None, "c": None}
    network.resume(address_of("b"))  # it reads what piled up: goodbyes, and new HELLOs
    await network.settle()
    await ticks_until_whole(network, clock, mesh3, HEAL_BUDGET)
    assert routes_everywhere(mesh3, address) == {"a": "b", "b": "local", "c": "b"}


async def test_pausing_each_broker_in_turn_leaves_one_mesh_not_islands(
    network: FakeNetwork, clock: FakeClock, mesh3: list[Broker]
) -> None:
    for paused in mesh3:
        others = [b for b in mesh3 if b is not paused]
        network.pause(paused.config.advertise)
        for _ in range(6):
            await tick(network, others, INTERVAL)
        network.resume(paused.config.advertise)
        await network.settle()
        await ticks_until_whole(network, clock, mesh3, HEAL_BUDGET)


async def test_a_broker_cut_off_from_everyone_dials_its_seed_again(
    network: FakeNetwork, clock: FakeClock
) -> None:
    a, b = await build_mesh(network, 2, heartbeat_interval=INTERVAL, peer_forget=1.0)
    network.partition(address_of("a"), address_of("b"))
    # Long enough that b forgets a as a lost peer: only its seed is left to find it by.
    for _ in range(10):
        await tick(network, [a, b], INTERVAL)
    assert linked([a, b]) == {"a": [], "b": []}
    assert len(b.mesh.redials) == 0
    network.heal(address_of("a"), address_of("b"))
    await ticks_until_whole(network, clock, [a, b], HEAL_BUDGET)


async def test_a_broker_that_drained_is_not_dialled_again(
    network: FakeNetwork, clock: FakeClock, mesh3: list[Broker]
) -> None:
    a, b, c = mesh3
    await c.mesh.drain(0.0)
    await c.mesh.stop()
    await network.settle()
    network.crash(address_of("c"))
    for _ in range(4):
        await tick(network, [a, b], INTERVAL)
    assert linked([a, b]) == {"a": ["b"], "b": ["a"]}
    assert "c" not in a.mesh.redials.names()
    assert "c" not in b.mesh.redials.names()


async def test_a_crashed_broker_stays_a_candidate_until_forgotten(
    network: FakeNetwork, clock: FakeClock
) -> None:
    a, _ = await build_mesh(network, 2, heartbeat_interval=INTERVAL, peer_forget=3.0)
    network.crash(address_of("b"))
    await network.settle()
    assert a.mesh.redials.names() == ["b"]
    for _ in range(4):  # 2 s: still dialled, with a capped backoff
        await tick(network, [a], INTERVAL)
    assert a.mesh.redials.names() == ["b"]
    for _ in range(4):  # past peer_forget
        await tick(network, [a], INTERVAL)
    assert a.mesh.redials.names() == []


async def test_a_group_bound_on_both_sides_of_a_split_converges_to_one_member(
    network: FakeNetwork, clock: FakeClock
) -> None:
    """Apart, each broker is the home of every group it sees and binds the group to a
    member of its own; linked again, every broker keeps the binding of the group's home
    in the whole mesh -- one member, not one each, and not swapped."""
    brokers = await build_mesh(network, 2, heartbeat_interval=INTERVAL)
    network.partition(address_of("a"), address_of("b"))
    await network.settle()
    bound: dict[str, bytes] = {}
    for broker in brokers:
        name = broker.config.name
        client = await connector(network, broker, f"on-{name}")
        member = await client.register(f"m{name}")
        await client.join(member, POOL)
        answer = await client.ask(ControlType.GROUP_BIND, GroupBind(group=POOL, key=b"g"))
        assert isinstance(answer.body, GroupBound)
        bound[name] = answer.body.member
    assert bound["a"] != bound["b"], "each side bound the group to its own member"
    network.heal(address_of("a"), address_of("b"))
    await ticks_until_whole(network, clock, brokers, HEAL_BUDGET)
    home = home_of(POOL + b"g", ["a", "b"])
    held = {bx.config.name: bx.guarantees.groups.get((POOL, b"g")) for bx in brokers}
    assert {name: binding.member for name, binding in held.items() if binding} == {
        "a": bound[home],
        "b": bound[home],
    }


async def test_a_fixed_address_taken_on_both_sides_of_a_split_has_one_owner_after(
    network: FakeNetwork, clock: FakeClock
) -> None:
    """Apart, each broker grants ``game01:1`` to its own connector (no peer to ask).
    Linked again, every broker keeps one owner -- the one on the broker with the smaller
    name -- and the other connector is told (REVOKED); its frames from the address, sent
    before it heard, are dropped and counted, not a reason to close its link."""
    brokers = await build_mesh(network, 2, heartbeat_interval=INTERVAL)
    network.partition(address_of("a"), address_of("b"))
    await network.settle()
    on_a = await connector(network, brokers[0], "on-a")
    on_b = await connector(network, brokers[1], "on-b")
    wanted = await on_a.register("game01", 1)
    assert await on_b.register("game01", 1) == wanted
    network.heal(address_of("a"), address_of("b"))
    await ticks_until_whole(network, clock, brokers, HEAL_BUDGET)
    assert routes_everywhere(brokers, wanted) == {"a": "local", "b": "a"}
    [revoked] = on_b.take(ControlType.REVOKED)
    assert isinstance(revoked, ControlFrame)
    assert isinstance(revoked.body, Revoked)
    assert revoked.body.address == wanted
    assert "split" in revoked.body.reason
    assert on_a.take(ControlType.REVOKED) == []
    on_b.send_data(Anycast("nobody").to_bytes(), wanted, b"sent before it heard")
    await network.settle()
    assert brokers[1].stats.dropped_revoked == 1
    assert brokers[1].links.connectors, "on-b's link stays open"


# -- one group, one member, across a cut link --------------------------------------------------

GRACE = 4.0  # the default --group-grace


def group_homed_at(name: str, brokers: list[str], prefix: bytes = b"g") -> bytes:
    """A message group id (``prefix`` and a number) whose home, over ``brokers``, is
    ``name``."""
    return next(
        key for i in range(1000) if home_of(POOL + (key := prefix + b"%d" % i), brokers) == name
    )


async def bound_group(
    network: FakeNetwork, mesh3: list[Broker], home: str
) -> tuple[bytes, bytes, bytes]:
    """A group homed at ``home``, bound to member m_b on b (the only member then); then m_c
    on c joins the pool. Returns (group id, m_b, m_c)."""
    _, b, c = mesh3
    key = group_homed_at(home, ["a", "b", "c"])
    on_b = await connector(network, b, "on-b")
    m_b = await on_b.register("m")
    await on_b.join(m_b, POOL)
    await network.settle()
    bound = await on_b.ask(ControlType.GROUP_BIND, GroupBind(group=POOL, key=key))
    assert isinstance(bound.body, GroupBound)
    assert bound.body.member == m_b
    on_c = await connector(network, c, "on-c")
    m_c = await on_c.register("m")
    await on_c.join(m_c, POOL)
    await network.settle()
    return key, m_b, m_c


async def gone_past_the_grace(
    network: FakeNetwork, brokers: list[Broker], key: bytes, m_b: bytes
) -> FakeClient:
    """A sender on a that reports m_b unreachable at once (its home starts counting the
    grace), then time past the grace with ``brokers`` running; the sender is returned."""
    on_a = await connector(network, brokers[0], "on-a")
    await on_a.ask(ControlType.GROUP_BIND, GroupBind(group=POOL, key=key, failed=m_b))
    for _ in range(int(GRACE / INTERVAL) + 2):
        await tick(network, brokers, INTERVAL)
    return on_a


async def test_a_group_is_not_moved_from_a_member_behind_a_cut_link(
    network: FakeNetwork, clock: FakeClock, mesh3: list[Broker]
) -> None:
    """a, the group's home, cannot see m_b past the grace -- but c still names b in its
    broker list, so b is out of reach, not gone, and m_b may be processing: the group stays
    with it (moving it would hand the group to m_c while m_b has it)."""
    a, _, _ = mesh3
    key, m_b, _ = await bound_group(network, mesh3, home="a")
    network.partition(address_of("a"), address_of("b"))
    await network.settle()
    on_a = await gone_past_the_grace(network, mesh3, key, m_b)
    assert linked(mesh3) == {"a": ["c"], "b": ["c"], "c": ["a", "b"]}
    assert a.mesh.out_of_reach.names() == ["b"]
    again = await on_a.ask(ControlType.GROUP_BIND, GroupBind(group=POOL, key=key, failed=m_b))
    assert isinstance(again.body, GroupBound)
    assert again.body.member == m_b
    network.heal(address_of("a"), address_of("b"))
    await ticks_until_whole(network, clock, mesh3, HEAL_BUDGET)
    assert a.mesh.out_of_reach.names() == []
    held = {bx.config.name: bx.guarantees.groups.get((POOL, key)) for bx in mesh3}
    assert {name: binding.member for name, binding in held.items() if binding} == {
        "a": m_b,
        "b": m_b,
        "c": m_b,
    }


async def test_a_group_whose_home_is_behind_a_cut_link_is_not_bound_on_this_side(
    network: FakeNetwork, mesh3: list[Broker]
) -> None:
    """Without b, a would be (or ask c to be) the home of b's group and bind it afresh --
    to m_c, a second member. It counts b while c names it, and refuses for now."""
    key, m_b, _ = await bound_group(network, mesh3, home="b")
    network.partition(address_of("a"), address_of("b"))
    await network.settle()
    on_a = await gone_past_the_grace(network, mesh3, key, m_b)
    refused = await on_a.ask(ControlType.GROUP_BIND, GroupBind(group=POOL, key=key, failed=m_b))
    assert isinstance(refused.body, Error), refused
    assert refused.body.code == ErrorCode.TRY_AGAIN
    assert "broker b" in refused.body.message
    assert "out of reach from broker a" in refused.body.message


async def test_a_group_homed_behind_a_link_cut_a_moment_ago_is_not_bound_on_this_side(
    network: FakeNetwork, mesh3: list[Broker]
) -> None:
    """Before c's next broker list, a knows b only as a lost peer. It counts it as out of
    reach from the moment it lost it, so a group homed at b that starts now is not bound
    afresh on a's side (where it would go to m_c while b binds it to m_b)."""
    a, _, _ = mesh3
    await bound_group(network, mesh3, home="b")
    fresh = group_homed_at("b", ["a", "b", "c"], prefix=b"new")
    network.partition(address_of("a"), address_of("b"))
    await network.settle()  # no tick: no broker list has come from c since the cut
    assert a.mesh.out_of_reach.names() == ["b"]
    on_a = await connector(network, a, "on-a")
    refused = await on_a.ask(ControlType.GROUP_BIND, GroupBind(group=POOL, key=fresh))
    assert isinstance(refused.body, Error), refused
    assert refused.body.code == ErrorCode.TRY_AGAIN


async def test_a_group_homed_at_a_broker_that_just_crashed_is_answered_try_again(
    network: FakeNetwork, clock: FakeClock, mesh3: list[Broker]
) -> None:
    """kill -9 of b, the home of a group that starts now: a counts b as out of reach for
    a moment and answers TRY_AGAIN -- a condition that passes, which the client asks
    again through -- not UNAVAILABLE, the answer for a group with no member. Once the
    sighting is over the home is another broker and the group is bound."""
    a, _, c = mesh3
    on_c = await connector(network, c, "on-c")
    member = await on_c.register("m")
    await on_c.join(member, POOL)
    fresh = group_homed_at("b", ["a", "b", "c"], prefix=b"new")
    network.crash(address_of("b"))
    await network.settle()
    on_a = await connector(network, a, "on-a")
    refused = await on_a.ask(ControlType.GROUP_BIND, GroupBind(group=POOL, key=fresh))
    assert isinstance(refused.body, Error), refused
    assert refused.body.code == ErrorCode.TRY_AGAIN
    assert "ask again in a moment" in refused.body.message
    start = clock.now
    while a.mesh.out_of_reach.names():
        assert clock.now - start <= HEAL_BUDGET, "b is sighted past a budget and an interval"
        await tick(network, [a, c], INTERVAL)
    bound = await on_a.ask(ControlType.GROUP_BIND, GroupBind(group=POOL, key=fresh))
    assert isinstance(bound.body, GroupBound), bound
    assert bound.body.member == member


async def test_a_crashed_brokers_groups_still_move_after_the_grace(
    network: FakeNetwork, mesh3: list[Broker]
) -> None:
    """Nobody names a crashed broker once its peers noticed: out of reach only for a
    budget and an interval, then its member is gone and the group moves on."""
    a, _, c = mesh3
    key, m_b, m_c = await bound_group(network, mesh3, home="a")
    network.crash(address_of("b"))
    await network.settle()
    on_a = await gone_past_the_grace(network, [a, c], key, m_b)
    assert a.mesh.out_of_reach.names() == []
    moved = await on_a.ask(ControlType.GROUP_BIND, GroupBind(group=POOL, key=key, failed=m_b))
    assert isinstance(moved.body, GroupBound)
    assert moved.body.member == m_c
    assert moved.body.reassigned


@pytest.mark.parametrize(
    ("linked", "lost", "in_minority"),
    [
        (0, 0, False),  # a mesh of one: nothing lost
        (1, 1, False),  # two of three: the majority
        (0, 2, True),  # one of three: cut off
        (0, 1, True),  # one of two: half is not a majority
        (1, 2, True),  # two of four
        (2, 2, False),  # three of five
    ],
)
def test_a_broker_is_in_a_minority_when_it_and_its_peers_are_no_more_than_half(
    linked: int, lost: int, in_minority: bool
) -> None:
    why = minority("b", linked, [f"lost{i}" for i in range(lost)])
    assert bool(why) is in_minority
    if in_minority:
        assert f"linked to {linked} of the {linked + lost} other brokers" in why
        assert "lost0" in why


async def test_under_pause_minority_a_broker_cut_off_from_the_others_takes_no_connectors(
    network: FakeNetwork, clock: FakeClock
) -> None:
    a, b, c = await build_mesh(
        network, 3, heartbeat_interval=INTERVAL, partition_handling="pause-minority"
    )
    on_a, on_b = await connector(network, a, "on-a"), await connector(network, b, "on-b")
    network.partition(address_of("b"), address_of("a"))
    await network.settle()
    assert not on_b.closed, "linked to c, b is half of what it knows with a lost: it stays"
    assert b.mesh.minority.refusal() == ""
    network.partition(address_of("b"), address_of("c"))
    await network.settle()
    (error,) = on_b.take(ControlType.ERROR)
    assert isinstance(error.body, Error)
    assert error.body.code == ErrorCode.UNAVAILABLE
    assert "broker b is cut off from most of the mesh (linked to 0 of the 2" in error.body.message
    assert on_b.closed
    assert not on_a.closed, "a, linked to c, is in the majority"
    refused = connect_client(network, b, "late")
    refused.send_control(ControlType.HELLO, Hello(role=ROLE_CONNECTOR, name="late"))
    await network.settle()
    (frame,) = refused.take(ControlType.ERROR)
    assert isinstance(frame.body, Error)
    assert frame.body.code == ErrorCode.REDIRECT
    assert "cut off from most of the mesh" in frame.body.message
    network.heal(address_of("b"), address_of("a"))
    network.heal(address_of("b"), address_of("c"))
    await ticks_until_whole(network, clock, [a, b, c], HEAL_BUDGET)
    await connector(network, b, "after")  # welcomed again
    assert b.mesh.minority.pauses == 1
