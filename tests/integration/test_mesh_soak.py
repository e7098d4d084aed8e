"""A short soak: brokers are killed, drained and restarted while requests keep flowing.

At the end the mesh must have healed completely: every broker linked to every
other, every routing table the same, every service answering from every broker,
and no connector missing a service. (Requests in flight at a kill -9 may fail;
that is what failover promises, and they are not counted against the mesh.)
"""

from __future__ import annotations

import asyncio
import random
import signal

import pytest

import meshbus
from meshbus.broker.process import spawn_broker
from tests.conftest import BrokerProcess, stop_all
from tests.integration.helpers import stat

ROUNDS = 8


async def broker_at(listen: str, name: str, *seed: str) -> BrokerProcess:
    """A broker on a given address (a restart comes back where it was)."""
    seeds = [arg for address in seed for arg in ("--seed", address)]
    process, ready_name, address, _ = await spawn_broker("--name", name, *seeds, listen=listen)
    return BrokerProcess(process, ready_name, address)


async def echo(service: meshbus.Service) -> None:
    async for msg in service:
        if msg.is_request:
            await msg.reply(msg.payload)


@pytest.mark.slow
async def test_the_mesh_heals_after_kills_drains_and_restarts() -> None:
    rng = random.Random(20261123)
    first = await broker_at("127.0.0.1:0", "s0")
    brokers = {"s0": first}
    for name in ("s1", "s2"):
        brokers[name] = await broker_at("127.0.0.1:0", name, first.address)
    addresses = {name: b.address for name, b in brokers.items()}
    every = ",".join(addresses.values())
    conns = [await meshbus.connect(every, server=f"soak{i}") for i in range(10)]
    services = [await c.register(instance=i) for c in conns for i in (None, 7)]
    echoes = [asyncio.create_task(echo(s)) for s in services]
    asker_conn = await meshbus.connect(every, server="asker")
    asker = await asker_conn.register()
    answered = 0
    wanted = 0
    flowing = asyncio.Event()  # set once ``wanted`` requests have been answered
    stop = asyncio.Event()

    async def ask() -> None:
        nonlocal answered
        while not stop.is_set():
            try:
                await asker.request(rng.choice(services).address, b"?", timeout=1.0)
                answered += 1
                if answered >= wanted:
                    flowing.set()
            except meshbus.MeshbusError:
                await asyncio.sleep(0.01)

    asking = asyncio.create_task(ask())
    try:
        for _ in range(ROUNDS):
            name = rng.choice(sorted(brokers))
            victim = brokers[name]
            if rng.random() < 0.5:
                victim.process.kill()
            else:
                victim.process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(victim.process.wait(), 30)
            seed = next(b.address for n, b in brokers.items() if n != name)
            brokers[name] = await broker_at(addresses[name], name, seed)
            # Requests flow again before the next round.
            wanted = answered + 50
            flowing.clear()
            await asyncio.wait_for(flowing.wait(), 30)
        stop.set()
        await asking

        names = set(brokers)
        views = []
        for name, broker in brokers.items():
            data = await stat(broker)
            assert set(data["peers"]) == names - {name}, "the mesh is whole again"
            views.append(sorted(a for a in data["service_addresses"] if not a.startswith("stat:")))
        assert all(view == views[0] for view in views), "every table the same"
        for broker in brokers.values():
            async with await meshbus.connect(broker.address, server="check", failover=False) as c:
                probe = await c.register()
                for service in services:
                    await probe.request(service.address, b"still there?", timeout=5)
        assert all(len(c.services) == 2 for c in conns), "no connector lost a service"
    finally:
        stop.set()
        asking.cancel()
        for task in echoes:
            task.cancel()
        for conn in (*conns, asker_conn):
            await conn.close()
        await stop_all(list(brokers.values()))
