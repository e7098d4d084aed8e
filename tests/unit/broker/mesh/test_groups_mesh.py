"""Message groups and MEMBERS between in-process brokers: a group's home decides and every
broker holds its bindings; a pick prefers a local member."""

from __future__ import annotations

from typing import Any

import pytest

from meshbus.address import Anycast
from meshbus.broker.mesh.groups import home_of
from meshbus.broker.server import Broker
from meshbus.protocol.control import (
    Error,
    GroupBind,
    GroupBound,
    GroupEnd,
    MemberList,
    MembersRequest,
)
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.testing import (
    FakeClient,
    FakeNetwork,
    address_of,
    build_mesh,
    connector,
    describe_frame,
    start_broker,
)

ORDERS = Anycast("orders").to_bytes()
POOL = Anycast("pool").to_bytes()
NAMES = ["a", "b", "c"]


@pytest.fixture
async def mesh3(network: FakeNetwork) -> list[Broker]:
    return await build_mesh(network, 3)


def key_homed_at(home: str) -> bytes:
    """A message group id whose home, in a mesh of a, b and c, is ``home``."""
    for n in range(1000):
        key = f"order-{n}".encode()
        if home_of(ORDERS + key, NAMES) == home:
            return key
    raise AssertionError(f"no group homed at {home}")


async def member_of(
    network: FakeNetwork, broker: Broker, group: bytes, name: str
) -> tuple[FakeClient, bytes]:
    client = await connector(network, broker, name)
    address = await client.register(name)
    await client.join(address, group)
    return client, address


def count_binds(brokers: list[Broker], monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many binds each broker decides from now on (the live dict is updated)."""
    counts = dict.fromkeys((b.config.name for b in brokers), 0)
    for broker in brokers:
        table = broker.guarantees.groups

        def counted(*args: Any, _decide: Any = table.bind, _name: str = broker.config.name) -> Any:
            counts[_name] += 1
            return _decide(*args)

        monkeypatch.setattr(table, "bind", counted)
    return counts


async def bind(client: FakeClient, key: bytes) -> GroupBound | Error:
    answer = await client.ask(ControlType.GROUP_BIND, GroupBind(group=ORDERS, key=key))
    assert answer.type in (ControlType.GROUP_BOUND, ControlType.ERROR), describe_frame(answer)
    assert isinstance(answer.body, GroupBound | Error)
    return answer.body


async def test_a_bind_from_a_broker_that_is_not_home_is_decided_at_home_and_replicated(
    network: FakeNetwork, mesh3: list[Broker], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, _ = mesh3
    key = key_homed_at("c")
    _, member = await member_of(network, b, ORDERS, "worker")
    sender = await connector(network, a, "sender")
    await network.settle()
    decided = count_binds(mesh3, monkeypatch)
    bound = await bind(sender, key)
    assert isinstance(bound, GroupBound)
    assert bound.member == member
    assert not bound.reassigned
    assert decided == {"a": 0, "b": 0, "c": 1}, "only the home decides"
    for broker in mesh3:
        binding = broker.guarantees.groups.get((ORDERS, key))
        assert binding is not None, broker.config.name
        assert binding.member == member, broker.config.name
    # Another sender, through another broker, gets the same member.
    other = await connector(network, b, "other")
    again = await bind(other, key)
    assert isinstance(again, GroupBound)
    assert again.member == member
    assert decided == {"a": 0, "b": 0, "c": 2}


async def test_a_bind_with_no_member_is_unavailable_with_its_correlation(
    network: FakeNetwork, mesh3: list[Broker]
) -> None:
    sender = await connector(network, mesh3[0], "sender")
    refused = await bind(sender, key_homed_at("b"))
    assert isinstance(refused, Error)
    assert refused.code == ErrorCode.UNAVAILABLE
    assert all(len(broker.guarantees.groups) == 0 for broker in mesh3)


async def test_a_bind_relayed_to_a_home_that_is_lost_is_answered_try_again(
    network: FakeNetwork, mesh3: list[Broker]
) -> None:
    a = mesh3[0]
    await member_of(network, mesh3[1], ORDERS, "worker")
    sender = await connector(network, a, "sender")
    await network.settle()
    wire = network.wire_between(address_of("a"), address_of("c"))
    wire.hold()
    correlation = sender.send_control(
        ControlType.GROUP_BIND, GroupBind(group=ORDERS, key=key_homed_at("c"))
    )
    await network.settle()
    assert sender.controls() == [], "relayed to c; the answer is on the held wire"
    wire.cut()
    await network.settle()
    answer = sender.answer(correlation)
    assert answer.type == ControlType.ERROR
    assert isinstance(answer.body, Error)
    assert answer.body.code == ErrorCode.TRY_AGAIN


async def test_members_with_pick_prefers_a_local_member(
    network: FakeNetwork, mesh3: list[Broker]
) -> None:
    a, b, c = mesh3
    _, on_a = await member_of(network, a, POOL, "worker-a")
    _, on_b = await member_of(network, b, POOL, "worker-b")
    await network.settle()
    for broker, local in ((a, on_a), (b, on_b)):
        asker = await connector(network, broker, "asker")
        for _ in range(10):
            answer = await asker.ask(ControlType.MEMBERS, MembersRequest(group=POOL, pick=True))
            assert isinstance(answer.body, MemberList)
            assert answer.body.members == [local]
    asker = await connector(network, c, "asker")
    everyone = await asker.ask(ControlType.MEMBERS, MembersRequest(group=POOL))
    assert isinstance(everyone.body, MemberList)
    assert sorted(everyone.body.members) == sorted([on_a, on_b])
    picked = await asker.ask(ControlType.MEMBERS, MembersRequest(group=POOL, pick=True))
    assert isinstance(picked.body, MemberList)
    assert len(picked.body.members) == 1
    assert picked.body.members[0] in (on_a, on_b), "no local member: any member"


async def test_members_with_pick_prefers_a_member_holding_no_message_group(
    network: FakeNetwork, mesh3: list[Broker]
) -> None:
    a = mesh3[0]
    _, first = await member_of(network, a, ORDERS, "worker-1")
    _, second = await member_of(network, a, ORDERS, "worker-2")
    sender = await connector(network, a, "sender")
    await network.settle()
    bound = await bind(sender, key_homed_at("b"))
    assert isinstance(bound, GroupBound)
    idle = second if bound.member == first else first
    for _ in range(10):
        answer = await sender.ask(ControlType.MEMBERS, MembersRequest(group=ORDERS, pick=True))
        assert isinstance(answer.body, MemberList)
        assert answer.body.members == [idle]


async def test_a_big_group_table_reaches_a_joining_broker_in_frames_under_the_limit(
    network: FakeNetwork,
) -> None:
    """30,000 bindings are some 2 MB: in one GROUPS frame they passed the 1 MiB frame
    limit, and the joining broker closed the link. They go in chunks."""
    a = await start_broker(network, "a")
    member = Anycast("m").to_bytes()
    for i in range(30_000):
        a.guarantees.groups.put((POOL, b"group-%d" % i), member, 300.0, 0.0)
    b = await start_broker(network, "b", seeds=[address_of("a")])
    assert b.peers.names() == ["a"]
    assert len(b.guarantees.groups) == 30_000


async def test_a_connector_binds_and_ends_a_group_only_as_its_own_service(
    network: FakeNetwork, mesh3: list[Broker]
) -> None:
    a = mesh3[0]
    await member_of(network, a, ORDERS, "worker")
    sender = await connector(network, a, "sender")
    sending = await sender.register("sender")
    forger = await connector(network, a, "forger")
    await forger.register("forger")
    key = key_homed_at("a")
    bind_as_sender = GroupBind(group=ORDERS, key=key, sender=sending)
    end_as_sender = GroupEnd(group=ORDERS, key=key, sender=sending)
    assert (
        await sender.ask(ControlType.GROUP_BIND, bind_as_sender)
    ).type == ControlType.GROUP_BOUND
    for type_, body in (
        (ControlType.GROUP_END, end_as_sender),
        (ControlType.GROUP_BIND, bind_as_sender),
    ):
        answer = await forger.ask(type_, body)
        assert isinstance(answer.body, Error), describe_frame(answer)
        assert answer.body.code == ErrorCode.NOT_REGISTERED
    binding = a.guarantees.groups.get((ORDERS, key))
    assert binding is not None
    assert binding.senders == {sending}, "the forger's GROUP_END ended nothing"
    assert (await sender.ask(ControlType.GROUP_END, end_as_sender)).type == ControlType.OK
    assert binding.senders == set()
