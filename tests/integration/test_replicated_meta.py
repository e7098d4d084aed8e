"""The meta group on real broker processes (docs/raft.md, "The meta group"): replicated
streams' adds decided once for the whole mesh, their replicas spread over --zone, and
an add cut short by the death of the meta leader either done or refused, never a group
founded on some of its replicas only."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import meshbus
from meshbus.client.streams import StreamInfo
from meshbus.errors import StreamError, StreamExists
from tests.conftest import BrokerProcess, start_broker, stop_all
from tests.integration.helpers import stat, wait_until
from tests.integration.test_replicated_streams import Replicas, led

ZONES = {"z0": "a", "z1": "a", "z2": "b", "z3": "c"}


async def ready_everywhere(brokers: list[BrokerProcess]) -> None:
    """Until every broker is linked to every other: each sees the same ready brokers."""

    async def linked() -> bool:
        for broker in brokers:
            shown = await stat(broker)
            if not shown["ready"] or len(shown["peers"]) != len(brokers) - 1:
                return False
        return True

    await wait_until(linked, "a whole mesh", timeout=20)


async def raft(broker: BrokerProcess) -> dict[str, Any]:
    """What stat shows of its Raft groups: the streams it holds a replica of, the meta
    group's voters and leader as it knows them."""
    raft: dict[str, Any] = (await stat(broker))["streams"]["raft"]
    return raft


async def meta_leader(brokers: list[BrokerProcess]) -> BrokerProcess:
    """The broker that leads the meta group, as the brokers agree."""
    leader: list[BrokerProcess] = []

    async def agreed() -> bool:
        said = {(await raft(b))["meta"]["leader"] for b in brokers}
        leader[:] = [b for b in brokers if {b.name} == said]
        return bool(leader)

    await wait_until(agreed, "a meta leader every broker knows", timeout=20)
    return leader[0]


@contextlib.asynccontextmanager
async def four(root: Path) -> AsyncIterator[Replicas]:
    replicas = await Replicas.start(root, 4)
    try:
        await ready_everywhere(list(replicas.brokers.values()))
        yield replicas
    finally:
        await replicas.close()


async def test_two_adds_of_one_name_at_once_make_one_stream(tmp_path: Path) -> None:
    async with four(tmp_path) as replicas:
        names = replicas.names
        brokers = list(replicas.brokers.values())
        async with (
            await meshbus.connect(replicas[names[1]].address, server="op1") as one,
            await meshbus.connect(replicas[names[3]].address, server="op3") as other,
        ):
            # The mesh's first replicated stream: each broker asked founds the meta
            # group (on the same three), then its leader takes one add and refuses the
            # other.
            results = await asyncio.gather(
                one.streams.add("ledger", "multicast:ledger", replicas=3),
                other.streams.add("ledger", "multicast:elsewhere", replicas=3),
                return_exceptions=True,
            )
            added = [r for r in results if isinstance(r, StreamInfo)]
            refused = [r for r in results if isinstance(r, BaseException)]
            assert len(added) == 1, results
            assert len(refused) == 1
            assert isinstance(refused[0], StreamExists), refused
            assert "exists already" in str(refused[0])
            with pytest.raises(StreamExists):  # and later, from any broker
                await other.streams.add("ledger", "multicast:ledger", replicas=5)
            # The stream that won, asked for again from either broker, is there already
            # (as an identical add of an R=1 stream is).
            won = (
                "multicast:ledger" if isinstance(results[0], StreamInfo) else "multicast:elsewhere"
            )
            for asker in (one, other):
                again = await asker.streams.add("ledger", won, replicas=3)
                assert sorted(again.replicas) == sorted(added[0].replicas)
            info = await led(one, "ledger")
        assert sorted(info.replicas) == sorted(added[0].replicas)
        assert len(info.replicas) == 3
        meta = {b.name: (await raft(b))["meta"] for b in brokers}
        voters = sorted(names)[:3]  # the first three by name
        assert {n: m["voters"] for n, m in meta.items()} == dict.fromkeys(names, voters)
        for name, m in meta.items():  # a voter's copy holds the record
            assert m["streams"] == (["ledger"] if name in voters else None), name
        # the group on the placed replicas only, one group
        for broker in brokers:
            held = "ledger" in (await raft(broker))["streams"]
            assert held == (broker.name in info.replicas), broker.name
            async with await meshbus.connect(broker.address, server="lister") as conn:
                listed = [s for s in await conn.streams.list() if s["name"] == "ledger"]
                assert len(listed) == 1, broker.name
                assert (await conn.streams.info("ledger")).captures == added[0].captures


async def test_replicas_are_spread_over_zones(tmp_path: Path) -> None:
    brokers: list[BrokerProcess] = []
    try:
        for name, zone in ZONES.items():
            seed = ("--seed", brokers[0].address) if brokers else ()
            args = ("--name", name, "--data-dir", str(tmp_path / name), "--zone", zone)
            brokers.append(await start_broker(*args, *seed, "--drain-grace", "0.5"))
        await ready_everywhere(brokers)
        async with await meshbus.connect(brokers[0].address, server="op") as op:
            for i in range(6):
                info = await op.streams.add(f"s{i}", f"multicast:s{i}", replicas=3)
                # one replica in each zone: so z2 and z3, the only ones of theirs
                assert sorted(ZONES[b] for b in info.replicas) == ["a", "b", "c"], info
                assert {"z2", "z3"} <= set(info.replicas)
    finally:
        await stop_all(brokers)


@pytest.mark.parametrize("after", [0.0, 0.01])
async def test_an_add_while_the_meta_leader_is_killed_is_done_or_refused(
    tmp_path: Path, after: float
) -> None:
    """Killed as the add is relayed to it, or just after. Seen in runs of this test:
    the add refused ("left the mesh before it answered; try again") and not committed;
    refused so though committed, then founded by the next leader; done and answered."""
    async with four(tmp_path) as replicas:
        brokers = list(replicas.brokers.values())
        async with await meshbus.connect(brokers[0].address, server="op") as op:
            await op.streams.add("first", "multicast:first", replicas=3)
        leader = await meta_leader(brokers)
        asker = next(b for b in brokers if b is not leader)
        async with await meshbus.connect(asker.address, server="op") as op:
            adding = asyncio.create_task(op.streams.add("ledger", "multicast:ledger", replicas=3))
            await asyncio.sleep(after)  # relayed to the leader, maybe committed
            await replicas.kill(leader.name)
            (outcome,) = await asyncio.gather(adding, return_exceptions=True)
            if not isinstance(outcome, StreamInfo):
                # a clear answer: what happened and what to do
                assert isinstance(outcome, StreamError), outcome
                assert "again" in str(outcome), outcome
            alive = [b for b in brokers if b is not leader]
            new = await meta_leader(alive)
            # Its answer to another add comes once it applied every entry before it.
            await op.streams.add("probe", "multicast:probe", replicas=3)
            recorded = "ledger" in (await raft(new))["meta"]["streams"]
            if recorded:  # done: founded on every replica up, by the add or the new leader
                info = await led(op, "ledger")

                async def founded() -> bool:
                    held = [b.name for b in alive if "ledger" in (await raft(b))["streams"]]
                    return sorted(held) == sorted(n for n in info.replicas if n != leader.name)

                await wait_until(founded, "the stream on every replica that is up")
                # Asked again, as a client whose answer was lost does: it is there.
                again = await op.streams.add("ledger", "multicast:ledger", replicas=3)
                assert sorted(again.replicas) == sorted(info.replicas)
                with pytest.raises(StreamExists):  # another stream of that name is not
                    await op.streams.add("ledger", "multicast:other", replicas=3)
            else:  # refused: no replica founded it, and it can be added again
                assert not isinstance(outcome, StreamInfo)
                for broker in alive:
                    assert "ledger" not in (await raft(broker))["streams"], broker.name
                await op.streams.add("ledger", "multicast:ledger", replicas=3)
                info = await led(op, "ledger")
            assert len(info.replicas) == 3
