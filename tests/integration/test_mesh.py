"""Several real broker processes as one mesh: forming it, routing across it, uniqueness.

Failover, drain, join and capacity are in test_mesh_lifecycle.py.
"""

from __future__ import annotations

import asyncio
import random
import signal
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import meshbus
from meshbus.protocol import ControlType, encode_control
from meshbus.protocol.control import ROLE_BROKER, Hello, Welcome
from tests.conftest import BrokerProcess, start_broker, stop_all
from tests.integration.helpers import (
    IO_TIMEOUT,
    RawLink,
    assert_next_is,
    data_frame,
    stat,
    wait_members,
    wait_routes,
    wait_until,
)

# -- forming the mesh ---------------------------------------------------------------------


async def test_three_brokers_form_a_full_mesh_with_neighbour_ids(mesh3):
    stats = {b.name: await stat(b) for b in mesh3}
    names = set(stats)
    for name, data in stats.items():
        assert data["name"] == name
        assert set(data["peers"]) == names - {name}
        assert len(data["peer_links"]) == 2, "exactly one link per pair of brokers"
        assert data["ready"]
        assert data["capacity"] == 50
        assert {m["name"] for m in data["mesh"]} == names
        assert len({m["slot"] for m in data["mesh"]}) == 3, "every broker has its own slot"
    # Neighbour identifiers: the id A gave B is the one B stamps on frames to A.
    for name, data in stats.items():
        for link in data["peer_links"]:
            other = next(p for p in stats[link["name"]]["peer_links"] if p["name"] == name)
            assert link["tag_in"] == other["tag_out"]
            assert link["tag_out"] == other["tag_in"]


async def test_connector_learns_every_broker_from_one(mesh3):
    async with await meshbus.connect(mesh3[1].address, server="learn") as conn:
        assert sorted(conn.brokers) == sorted(b.address for b in mesh3)
        assert conn.broker_name == mesh3[1].name


async def test_stat_json_has_the_mesh_keys(mesh3):
    data = await stat(mesh3[0], detail=False)
    assert {"name", "connectors", "services", "routes", "peers", "capacity"} <= set(data)
    assert data["connectors"] == 0  # stat's own link is an operator's, not a connector
    assert isinstance(data["services"], int)
    assert isinstance(data["routes"], int)
    assert "service_addresses" not in data  # detail=False


async def test_join_fails_clearly_without_a_seed():
    from tests.integration.helpers import launch_broker

    with pytest.raises(AssertionError, match="no seed answered"):
        await launch_broker("--seed", "127.0.0.1:1", "--join-timeout", "0.3")


async def test_a_second_broker_with_a_taken_name_fails_at_once_saying_so():
    from tests.integration.helpers import launch_broker, start_broker_process

    first = await launch_broker("--name", "twin")
    try:
        second = await start_broker_process(
            "--listen",
            "127.0.0.1:0",
            "--name",
            "twin",
            "--seed",
            first.address,
            "--join-timeout",
            "60",
        )
        _, err = await asyncio.wait_for(second.communicate(), 10)
        assert second.returncode == 1
        assert "a broker named 'twin' is already in the mesh" in err.decode()
        assert "no seed answered" not in err.decode()
    finally:
        await stop_all([first])


async def test_sigterm_while_joining_stops_the_broker_at_once():
    from tests.integration.helpers import free_port, start_broker_process

    port = free_port()
    joining = await start_broker_process(
        "--listen",
        f"127.0.0.1:{port}",
        "--seed",
        f"127.0.0.1:{free_port()}",
        "--join-timeout",
        "60",
    )
    try:
        await wait_listening(port)  # it listens before it joins
        joining.send_signal(signal.SIGTERM)
        await asyncio.wait_for(joining.wait(), 5)
    finally:
        if joining.returncode is None:
            joining.kill()
            await joining.wait()


async def wait_listening(port: int) -> None:
    for _ in range(200):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        return
    raise AssertionError(f"nothing listens on port {port}")


# -- routing across brokers ------------------------------------------------------------------


@pytest.fixture
async def conns3(mesh3) -> Any:
    """One connector on each broker of the mesh."""
    opened = [
        await meshbus.connect(b.address, server=f"c{i}", failover=False)
        for i, b in enumerate(mesh3)
    ]
    try:
        yield opened
    finally:
        for conn in opened:
            await conn.close()


async def test_unicast_across_brokers_in_one_hop(mesh3, conns3):
    a = await conns3[0].register()
    b = await conns3[1].register(instance=7)
    await wait_routes(mesh3, b.address)
    for i in range(100):
        await a.send(b.address, b"%d" % i)
    for i in range(100):
        msg = await b.recv(timeout=IO_TIMEOUT)
        assert (msg.payload, msg.src, msg.dst) == (b"%d" % i, a.address, b.address)
    # One broker-to-broker hop: A sent 100 frames to B, and C saw none of them.
    stats = {s["name"]: s for s in [await stat(x) for x in mesh3]}
    link_ab = next(p for p in stats[mesh3[0].name]["peer_links"] if p["name"] == mesh3[1].name)
    link_ac = next(p for p in stats[mesh3[0].name]["peer_links"] if p["name"] == mesh3[2].name)
    assert link_ab["msgs_out"] >= 100
    assert link_ac["msgs_out"] == 0


async def test_multicast_sends_one_copy_per_peer_broker(mesh3):
    topic = meshbus.Multicast("fanout")
    publisher_conn = await meshbus.connect(mesh3[0].address, server="pub", failover=False)
    subscriber_conns = [
        await meshbus.connect(b.address, server=f"sub{i}{j}", failover=False)
        for i, b in enumerate(mesh3)
        for j in range(2)
    ]
    try:
        publisher = await publisher_conn.register()
        members = []
        for conn in subscriber_conns:  # 2 links per broker, 3 members per link
            for _ in range(3):
                member = await conn.register()
                await member.join(topic)
                members.append(member)
        await wait_members(mesh3, topic, len(members))
        before = {p["name"]: p["msgs_out"] for p in (await stat(mesh3[0]))["peer_links"]}
        count = 50
        for i in range(count):
            await publisher.send(topic, b"m%d" % i)
        for member in members:
            got = [(await member.recv(timeout=IO_TIMEOUT)).payload for _ in range(count)]
            assert got == [b"m%d" % i for i in range(count)]
        after = {p["name"]: p["msgs_out"] for p in (await stat(mesh3[0]))["peer_links"]}
        # 6 members behind each peer broker, on 2 links: still exactly one copy per peer.
        for peer in (mesh3[1].name, mesh3[2].name):
            assert after[peer] - before[peer] == count
    finally:
        for conn in (publisher_conn, *subscriber_conns):
            await conn.close()


async def test_anycast_prefers_a_local_member(mesh3, conns3):
    pool = meshbus.Anycast("local")
    sender = await conns3[0].register()
    local = await conns3[0].register()
    remote = await conns3[1].register()
    for member in (local, remote):
        await member.join(pool)
    await wait_members(mesh3, pool, 2)
    for i in range(30):
        await sender.send(pool, b"%d" % i)
    got = [(await local.recv(timeout=IO_TIMEOUT)).payload for _ in range(30)]
    assert got == [b"%d" % i for i in range(30)]
    await sender.send(remote.address, b"marker")
    await assert_next_is(remote, b"marker")  # nothing went to the remote member


async def test_anycast_remote_choice_is_weighted_by_member_count(mesh3, conns3):
    pool = meshbus.Anycast("weighted")
    sender = await conns3[0].register()
    on_b = [await conns3[1].register()]
    on_c = [await conns3[2].register() for _ in range(3)]
    for member in on_b + on_c:
        await member.join(pool)
    await wait_members(mesh3, pool, 4)
    total = 400
    for i in range(total):
        await sender.send(pool, b"%d" % i)
    received: Counter[str] = Counter()
    seen = []
    for member, name in [(m, "b") for m in on_b] + [(m, "c") for m in on_c]:
        await sender.send(member.address, b"end")
        while (msg := await member.recv(timeout=IO_TIMEOUT)).payload != b"end":
            received[name] += 1
            seen.append(msg.payload)
    assert sorted(seen) == sorted(b"%d" % i for i in range(total)), "each message exactly once"
    # Broker C has 3 of the 4 members: about 75% (300 +- 26 at 3 sigma); wide bounds.
    assert 0.6 * total < received["c"] < 0.9 * total, received


async def test_request_across_brokers_with_reverse_routing(mesh3, conns3):
    requester = await conns3[0].register()
    responder = await conns3[2].register()
    pool = meshbus.Anycast("answers")
    await responder.join(pool)
    await wait_members(mesh3, pool, 1)

    async def serve() -> None:
        async for msg in responder:
            if msg.is_request:
                await msg.reply(b"re:" + msg.payload)

    server = asyncio.create_task(serve())
    try:
        answers = await asyncio.gather(
            *(requester.request(pool, b"q%d" % i, timeout=IO_TIMEOUT) for i in range(50))
        )
        assert [a.payload for a in answers] == [b"re:q%d" % i for i in range(50)]
        assert all(a.src == responder.address for a in answers)
        # The pending entries lived on the entry broker (A) and are gone.
        entry, far = await stat(mesh3[0]), await stat(mesh3[2])
        assert entry["counters"]["requests"] >= 50
        assert entry["counters"]["pending"] == 0
        assert far["counters"]["requests"] == 0
    finally:
        server.cancel()


async def test_timeout_and_no_route_across_brokers(mesh3, conns3):
    requester = await conns3[0].register()
    silent = await conns3[1].register()
    await wait_routes(mesh3, silent.address)
    with pytest.raises(meshbus.Timeout):
        await requester.request(silent.address, b"hello?", timeout=0.3)
    assert (await silent.recv(timeout=IO_TIMEOUT)).is_request  # it did get there
    with pytest.raises(meshbus.NoRoute):
        await requester.request(meshbus.Unicast("nobody", 1), b"x", timeout=IO_TIMEOUT)
    # Sent right after the service left: whether the entry broker already knows (it
    # answers NO_ROUTE itself) or the far broker finds the route stale (it reports back
    # through the entry broker), the requester hears NoRoute, never a Timeout.
    await silent.unregister()
    with pytest.raises(meshbus.NoRoute):
        await requester.request(silent.address, b"gone", timeout=IO_TIMEOUT)


async def test_a_change_is_known_mesh_wide_when_it_is_answered(mesh3, conns3):
    """No waiting for propagation: once join() or register() has returned, a message
    sent through any other broker sees the change (the broker answers only after every
    peer confirmed it)."""
    sender = await conns3[0].register()
    for round_ in range(30):
        member = await conns3[1 + round_ % 2].register()
        topic = meshbus.Multicast(f"fresh.{round_}")
        await member.join(topic)
        await sender.send(topic, b"right away")
        await assert_next_is(member, b"right away")
        pool = meshbus.Anycast(f"pool.{round_}")
        await member.join(pool)
        await sender.send(pool, b"one of you")
        await assert_next_is(member, b"one of you")
        answering = await conns3[1 + round_ % 2].register(instance=200 + round_)
        answer = asyncio.create_task(answering.recv(timeout=IO_TIMEOUT))
        with pytest.raises(meshbus.Timeout):  # routed, not NoRoute: nobody replies
            await sender.request(answering.address, b"there?", timeout=0.05)
        assert (await answer).payload == b"there?"


# -- uniqueness ------------------------------------------------------------------------------


async def test_dynamic_ids_are_unique_across_the_mesh(mesh3):
    conns = [
        await meshbus.connect(b.address, server="same", failover=False)
        for b in mesh3
        for _ in range(2)
    ]
    try:
        services = await asyncio.gather(*(c.register() for c in conns for _ in range(50)))
        addresses = [s.address for s in services]
        assert len(set(addresses)) == len(addresses) == 300
    finally:
        for conn in conns:
            await conn.close()


async def test_a_fixed_address_registered_at_once_on_two_brokers_goes_to_one(mesh3):
    for round_ in range(5):
        conns = [await meshbus.connect(b.address, server="fixed", failover=False) for b in mesh3]
        try:
            results = await asyncio.gather(
                *(c.register(instance=100 + round_) for c in conns), return_exceptions=True
            )
            winners = [r for r in results if isinstance(r, meshbus.Service)]
            losers = [r for r in results if isinstance(r, meshbus.AddressInUse)]
            assert len(winners) == 1, results
            assert len(losers) == 2, results
            await wait_routes(mesh3, winners[0].address)
            # Every broker routes it to the winner.
            for conn in conns:
                probe = await conn.register()
                await probe.send(winners[0].address, b"to the winner")
                await assert_next_is(winners[0], b"to the winner")
        finally:
            for conn in conns:
                await conn.close()


# -- loop guards ----------------------------------------------------------------------------


async def open_raw_peer(broker: BrokerProcess, name: str) -> tuple[RawLink, Welcome]:
    """A test link that introduces itself as broker ``name``."""
    link = await RawLink.open(broker.address)
    await link.send(
        encode_control(
            ControlType.HELLO,
            Hello(role=ROLE_BROKER, name=name, listen="127.0.0.1:1", tag=99),
            1,
        )
    )
    frame = await link.read_control()
    assert frame.type == ControlType.WELCOME, frame
    assert isinstance(frame.body, Welcome)
    return link, frame.body


async def test_frames_from_a_peer_are_never_forwarded_and_bad_hops_are_dropped(mesh3):
    """A frame from a peer for a service on a third broker is not forwarded; frames with
    the wrong hop count or link tag are dropped and counted; the broker carries on."""
    far = await meshbus.connect(mesh3[2].address, server="far", failover=False)
    near = await meshbus.connect(mesh3[0].address, server="near", failover=False)
    try:
        far_svc = await far.register()
        near_svc = await near.register()
        await wait_routes(mesh3, far_svc.address)
        raw, welcome = await open_raw_peer(mesh3[0], "zz-test")
        tag = welcome.tag
        before = (await stat(mesh3[0]))["counters"]
        await raw.send(
            data_frame(far_svc.address, near_svc.address, b"loop?", hops=1, link_tag=tag)
        )
        await raw.send(
            data_frame(near_svc.address, far_svc.address, b"hops0", hops=0, link_tag=tag)
        )
        await raw.send(
            data_frame(near_svc.address, far_svc.address, b"hops2", hops=2, link_tag=tag)
        )
        await raw.send(data_frame(near_svc.address, far_svc.address, b"badtag", hops=1, link_tag=7))
        await raw.send(data_frame(near_svc.address, far_svc.address, b"ok", hops=1, link_tag=tag))
        await assert_next_is(near_svc, b"ok")  # only the well-formed frame arrived
        after = (await stat(mesh3[0]))["counters"]
        assert after["dropped_bad_hop"] - before["dropped_bad_hop"] == 3
        assert after["dropped_no_route"] - before["dropped_no_route"] == 1
        await near_svc.send(far_svc.address, b"still routing")
        await assert_next_is(far_svc, b"still routing")
        await raw.close()
    finally:
        await far.close()
        await near.close()


async def test_a_connector_frame_with_hops_is_a_protocol_error(raw_link):
    raw = raw_link
    await raw.hello()
    src = await raw.register()
    await raw.send(data_frame(src, src, b"x", hops=1))
    frames = await raw.read_until_closed()
    assert frames
    assert frames[-1].type == ControlType.ERROR


# -- convergence ----------------------------------------------------------------------------


async def tables(brokers: list[BrokerProcess]) -> list[tuple[list[str], dict[str, list[str]]]]:
    out = []
    for b in brokers:
        data = await stat(b)
        services = [a for a in data["service_addresses"] if not a.startswith("stat:")]
        out.append((services, data["groups"]))
    return out


@pytest.mark.slow
async def test_tables_converge_after_random_churn(mesh3):
    """Random register/unregister/join/leave on all three brokers at once, then: every
    broker's table is the same, and the same as what the connectors hold."""
    rng = random.Random(1234)
    conns = [
        await meshbus.connect(b.address, server=f"churn{i}", failover=False)
        for i, b in enumerate(mesh3)
        for _ in range(2)
    ]
    groups = [meshbus.Multicast(f"t{i}") for i in range(3)] + [meshbus.Anycast("p")]
    try:

        async def churn(conn: meshbus.Connector, seed: int) -> None:
            local = random.Random(seed)
            for _ in range(120):
                live = conn.services
                action = local.random()
                if action < 0.4 or not live:
                    await conn.register(instance=local.choice([None, None, local.randrange(1, 60)]))
                elif action < 0.6:
                    await local.choice(live).unregister()
                elif action < 0.85:
                    await local.choice(live).join(local.choice(groups))
                else:
                    await local.choice(live).leave(local.choice(groups))

        async def safe_churn(conn: meshbus.Connector, seed: int) -> None:
            try:
                await churn(conn, seed)
            except meshbus.AddressInUse:
                pass  # a fixed id taken by another connector: fine, that is the point

        await asyncio.gather(*(safe_churn(c, rng.randrange(10**9)) for c in conns))
        expected_services = sorted(str(s.address) for c in conns for s in c.services)
        expected_groups: dict[str, list[str]] = {}
        for c in conns:
            for s in c.services:
                for g in s.groups:
                    expected_groups.setdefault(str(g), []).append(str(s.address))

        async def converged() -> bool:
            views = await tables(mesh3)
            return all(v == views[0] for v in views)

        await wait_until(converged, "the routing tables to converge")
        services, groups_seen = (await tables(mesh3))[0]
        assert sorted(services) == expected_services
        # The broadcast group holds one service per connector that has any: not churned here.
        groups_seen.pop("multicast:$all", None)
        assert {g: sorted(m) for g, m in groups_seen.items()} == {
            g: sorted(m) for g, m in expected_groups.items()
        }
    finally:
        for conn in conns:
            await conn.close()


def full_mesh(brokers: list[BrokerProcess]) -> Callable[[], Awaitable[bool]]:
    """A check: every broker is linked to every other, by exactly one link."""
    names = {b.name for b in brokers}

    async def check() -> bool:
        for b in brokers:
            data = await stat(b, detail=False)
            if set(data["peers"]) != names - {b.name} or len(data["peer_links"]) != len(names) - 1:
                return False
        return True

    return check


async def test_duplicate_dials_leave_one_link_per_pair():
    """Brokers that join at the same moment learn of each other at the same moment and
    dial each other: one fixed rule leaves exactly one link per pair, the same on both ends."""
    for _ in range(3):
        seed = await start_broker()
        joiners = await asyncio.gather(*(start_broker("--seed", seed.address) for _ in range(3)))
        brokers = [seed, *joiners]
        try:
            check = full_mesh(brokers)
            await wait_until(check, "a full mesh with one link per pair")
            # ...and it stays that way (no link flaps closed after the rule ran).
            await asyncio.sleep(0.3)
            assert await check()
        finally:
            await stop_all(brokers)


async def test_a_stat_larger_than_a_frame_comes_in_pages(mesh3):
    """3,000 services are some 100 KB of detail; an operator with 16 KiB frames asks for
    it page by page, and gets every service, sorted, with its link's list and groups."""
    async with (
        await meshbus.connect(mesh3[0].address, server="many") as owner,
        await meshbus.connect(mesh3[0].address, operator=True, max_frame=16 * 1024) as op,
    ):
        services = [await owner.register() for _ in range(3_000)]
        for service in services[:100]:
            await service.join(meshbus.Multicast("paged"))
        data = await op.stat()
        expected = sorted(str(s.address) for s in services)
        assert [a for a in data["service_addresses"] if a.startswith("many:")] == expected
        (link,) = [entry for entry in data["links"] if entry["name"] == "many"]
        assert link["services"] == expected
        assert data["groups"]["multicast:paged"] == sorted(str(s.address) for s in services[:100])
        assert data["name"] == mesh3[0].name
