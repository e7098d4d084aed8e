"""Message groups across real broker processes: one member per group, in order per sender,
free members first, bindings dropped after the final message, and reassignment when the
member holding a group dies.
"""

from __future__ import annotations

import asyncio

import pytest

import meshbus
from tests.conftest import BrokerProcess, start_mesh, stop_all
from tests.integration.helpers import (
    ACK_TIMEOUT,
    Collector,
    stat,
    wait_members,
    wait_routes,
    wait_until,
)

# A member gone this long loses its groups; short, so reassignment tests are quick.
GRACE = "0.3"


async def total(inboxes: list[Collector], count: int) -> None:
    async def enough() -> bool:
        return sum(len(i.messages) for i in inboxes) >= count

    await wait_until(enough, f"{count} group messages", ACK_TIMEOUT)


async def no_groups_bound(brokers: list[BrokerProcess]) -> None:
    async def none() -> bool:
        for broker in brokers:
            if (await stat(broker, detail=False))["groups_bound"] != 0:
                return False
        return True

    await wait_until(none, "groups_bound 0 on every broker")


async def members_on(
    brokers: list[BrokerProcess], pool: meshbus.Anycast, prefix: str
) -> tuple[list[meshbus.Connector], list[Collector]]:
    """One member of ``pool`` per broker, each on its own connector (no failover)."""
    conns = [
        await meshbus.connect(b.address, server=f"{prefix}{i}", failover=False)
        for i, b in enumerate(brokers)
    ]
    inboxes = []
    for conn in conns:
        member = await conn.register()
        await member.join(pool)
        inboxes.append(Collector(member))
    await wait_members(brokers, pool, len(conns))
    return conns, inboxes


async def test_each_group_lands_on_one_member_in_order_and_is_unbound_after_final(
    mesh3: list[BrokerProcess],
) -> None:
    """Two senders on two brokers interleave 20 messages each to groups g0..g9 of a pool
    with a member on each broker: every group's messages (both senders') reach one member,
    each sender's in send order, once; ``final`` marks each sender's last; after the
    final messages are acked no broker holds a binding."""
    pool = meshbus.Anycast("orders")
    conns, inboxes = await members_on(mesh3, pool, "ord")
    sender_conns = [
        await meshbus.connect(mesh3[i].address, server=f"gs{i}", failover=False) for i in (0, 1)
    ]
    try:
        senders = [await conn.register() for conn in sender_conns]
        groups = [f"g{g}" for g in range(10)]

        async def send_all(n: int, sender: meshbus.Service) -> None:
            for i in range(20):
                for group in groups:
                    payload = b"%d:%s:%d" % (n, group.encode(), i)
                    await sender.send(pool, payload, group=group, final=i == 19)

        await asyncio.gather(*(send_all(n, s) for n, s in enumerate(senders)))
        for conn in sender_conns:
            await conn.wait_acked(ACK_TIMEOUT)
            assert conn.unacked == 0
            assert conn._parts.unacked.given_up == 0
        await total(inboxes, 400)
        for inbox in inboxes:
            await inbox.settle(senders[0])
        assert sum(len(i.messages) for i in inboxes) == 400

        for group in groups:
            holders = [i for i in inboxes if i.of_group(group)]
            assert len(holders) == 1, f"{group} went to {len(holders)} members"
            got = holders[0].of_group(group)
            for n, sender in enumerate(senders):
                mine = [m for m in got if m.src == sender.address]
                assert [m.payload for m in mine] == [
                    b"%d:%s:%d" % (n, group.encode(), i) for i in range(20)
                ]
                assert [m.final for m in mine] == [False] * 19 + [True]
            assert all(m.dst == pool for m in got), "a pinned copy names the group address"
            assert not any(m.group_reassigned for m in got)
        await no_groups_bound(mesh3)
    finally:
        for inbox in inboxes:
            inbox.task.cancel()
        for conn in (*conns, *sender_conns):
            await conn.close()


async def test_new_groups_prefer_members_that_hold_none(mesh3: list[BrokerProcess]) -> None:
    """Three groups started one after another on a pool of three members land on three
    different members; once they end, the bindings are gone mesh-wide."""
    pool = meshbus.Anycast("fresh")
    conns, inboxes = await members_on(mesh3, pool, "fr")
    sender_conn = await meshbus.connect(mesh3[0].address, server="frs", failover=False)
    try:
        sender = await sender_conn.register()
        for group in ("h0", "h1", "h2"):
            await sender.send_reliable(pool, group.encode(), group=group)

        async def bound() -> bool:
            counts = [(await stat(b, detail=False))["groups_bound"] for b in mesh3]
            return counts == [3, 3, 3]

        await wait_until(bound, "three bindings on every broker")
        holders = {}
        for group in ("h0", "h1", "h2"):
            await sender.send_reliable(pool, b"last", group=group, final=True)
        await total(inboxes, 6)
        for group in ("h0", "h1", "h2"):
            with_group = [n for n, i in enumerate(inboxes) if i.of_group(group)]
            assert len(with_group) == 1, f"{group} on members {with_group}"
            holders[group] = with_group[0]
            got = inboxes[with_group[0]].of_group(group)
            assert [(m.payload, m.final) for m in got] == [(group.encode(), False), (b"last", True)]
        assert sorted(holders.values()) == [0, 1, 2], f"groups share a member: {holders}"
        await no_groups_bound(mesh3)
    finally:
        for inbox in inboxes:
            inbox.task.cancel()
        for conn in (*conns, sender_conn):
            await conn.close()


async def test_one_senders_final_does_not_unbind_a_group_another_sender_is_in(
    broker: BrokerProcess,
) -> None:
    """Two senders share group "g": the first sender's ``final`` ends *its* part only; the
    binding stays while the other sender is still in the group, so a third sender that
    joins in lands on the same member (one broker: it is every group's home)."""
    pool = meshbus.Anycast("shared")
    conns, inboxes = await members_on([broker, broker, broker], pool, "sh")
    sender_conns = [
        await meshbus.connect(broker.address, server=f"shs{i}", failover=False) for i in range(3)
    ]
    try:
        early, quitter, late = [await conn.register() for conn in sender_conns]
        await early.send_reliable(pool, b"early:0", group="g")
        await quitter.send_reliable(pool, b"quitter:0", group="g", final=True)
        await sender_conns[1].wait_acked(ACK_TIMEOUT)
        # The quitter's GROUP_END went out when its final was acked; a ping after it
        # returns once the broker has handled it.
        await sender_conns[1].ping()
        assert (await stat(broker, detail=False))["groups_bound"] == 1, (
            "the quitter's final unbound a group the early sender has not ended"
        )
        for i in range(1, 5):
            await late.send_reliable(pool, b"late:%d" % i, group="g")
        await early.send_reliable(pool, b"early:1", group="g", final=True)
        await late.send_reliable(pool, b"late:5", group="g", final=True)
        await total(inboxes, 8)
        holders = [n for n, inbox in enumerate(inboxes) if inbox.of_group("g")]
        assert len(holders) == 1, f"group g is on members {holders}"
        await no_groups_bound([broker])
    finally:
        for inbox in inboxes:
            inbox.task.cancel()
        for conn in (*conns, *sender_conns):
            await conn.close()


@pytest.mark.parametrize("death", ["connector", "broker"])
async def test_a_group_moves_to_another_member_when_its_member_dies(death: str) -> None:
    """The member holding a group dies (its connector reset without BYE, or -- alone on
    its broker -- that broker killed -9). The rest of the group, sent reliably, reaches
    one other member in order; the first message there says ``group_reassigned``."""
    # The sender gets a broker of its own, so killing a member's broker spares it.
    mesh = await start_mesh(4, "--group-grace", GRACE)
    sender_broker, member_brokers = mesh[0], mesh[1:]
    pool = meshbus.Anycast("jobs")
    conns, inboxes = await members_on(member_brokers, pool, "job")
    sender_conn = await meshbus.connect(sender_broker.address, server="jsend", failover=False)
    try:
        sender = await sender_conn.register()
        await wait_members(mesh, pool, 3)
        await wait_routes(member_brokers, sender.address)
        for i in range(10):
            await sender.send(pool, b"%d" % i, group="G")
        await sender_conn.wait_acked(ACK_TIMEOUT)
        await total(inboxes, 10)
        (first,) = [n for n, inbox in enumerate(inboxes) if inbox.messages]
        before = inboxes[first].messages
        assert [m.payload for m in before] == [b"%d" % i for i in range(10)]
        assert not any(m.group_reassigned for m in before)

        if death == "connector":
            conns[first]._parts.abort()  # a TCP reset: the broker sees no BYE
        else:
            member_brokers[first].process.kill()
            assert await member_brokers[first].process.wait() == -9
        for i in range(10, 20):
            await sender.send(pool, b"%d" % i, group="G", final=i == 19)
        await sender_conn.wait_acked(ACK_TIMEOUT)
        assert sender_conn._parts.unacked.given_up == 0
        await total(inboxes, 20)
        survivors = [n for n, inbox in enumerate(inboxes) if n != first and inbox.messages]
        assert len(survivors) == 1, f"the rest of the group went to members {survivors}"
        after = inboxes[survivors[0]]
        await after.settle(sender)
        assert [m.payload for m in after.messages] == [b"%d" % i for i in range(10, 20)]
        assert [m.group_reassigned for m in after.messages] == [True] + [False] * 9
        assert [m.final for m in after.messages] == [False] * 9 + [True]
        assert len(inboxes[first].messages) == 10, "nothing more reached the dead member"
        alive = [b for n, b in enumerate(mesh) if not (death == "broker" and n == first + 1)]
        await no_groups_bound(alive)
    finally:
        for inbox in inboxes:
            inbox.task.cancel()
        for conn in (*conns, sender_conn):
            await conn.close()
        await stop_all(mesh)
