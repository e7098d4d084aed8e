"""A soak of a replicated stream (issue 27, "Done when": long soaks under a ``slow`` mark,
run by a documented command): three replicas under a producer on each broker, a
reader and a durable consumer that takes and acknowledges, through a seeded random
schedule of faults -- kill -9 then restart, SIGSTOP then SIGCONT, a cut from the others
then healed, a graceful restart (a drain) -- on a minority of the brokers at a time, and
now and then on a majority.

Each round: while only a minority is faulted, appends are acknowledged within a few
election timeouts (a short blip is sometimes healed before); while a majority is,
nothing is acknowledged and a send is given up with "no acknowledgement". After each
heal, appends resume within a few election timeouts. At the end, the checks of
``check_copies``: no acknowledged value lost, none stored twice, the order kept, every
copy the same, what each reader read a prefix of it; and the durable consumer's
(``check_deliveries``): every message delivered, none again once its ack was answered,
its state the same on every replica.

``make test`` runs it for a few seconds; the long soak is
``MESHBUS_SOAK_SECONDS=600 pytest -m slow tests/integration/test_replicated_soak.py``
(``MESHBUS_SOAK_SEED`` picks the schedule, each round prints its seed and faults;
``MESHBUS_SOAK_REPLICAS=5`` runs it on five, faulting one or two at a time, or three)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from dataclasses import dataclass, field

import pytest

from meshbus.errors import MeshbusError
from tests.conftest import BrokerProcess
from tests.integration.helpers import wait_until
from tests.integration.test_replicated_consumers import Taker, check_deliveries, same_everywhere
from tests.integration.test_replicated_faults import (
    ELECTION,
    FAST,
    RESUME_WITHIN,
    RETRY,
    refused_meanwhile,
)
from tests.integration.test_replicated_streams import (
    STREAM,
    Consumer,
    Producer,
    Replicas,
    check_copies,
    replicated_stream,
)

SOAK_SECONDS = float(os.environ.get("MESHBUS_SOAK_SECONDS", "10"))
SOAK_SEED = int(os.environ.get("MESHBUS_SOAK_SEED", "27"))
SOAK_REPLICAS = int(os.environ.get("MESHBUS_SOAK_REPLICAS", "3"))  # or 5
MAJORITY_ODDS = 0.25  # of a round faulting a majority
BLIP_ODDS = 0.3  # of a minority's fault healed at once, before appends are checked
MINORITY_FAULTS = ("kill", "pause", "cut", "restart")
MAJORITY_FAULTS = ("kill", "pause", "cut")  # a restart is over before it counts


@dataclass
class Soak:
    """The brokers, a producer on each (a new one, with a prefix of its own, after its
    broker was killed or restarted), a reader and a taker of the durable consumer; every
    producer, reader and taker ever started, for the checks at the end."""

    replicas: Replicas
    rng: random.Random
    producers: dict[str, Producer] = field(default_factory=dict)
    every_producer: list[Producer] = field(default_factory=list)
    readers: list[Consumer] = field(default_factory=list)
    takers: list[Taker] = field(default_factory=list)
    homes: dict[str, BrokerProcess] = field(default_factory=dict)  # each producer's broker
    reader_home: BrokerProcess | None = None
    taker_home: BrokerProcess | None = None
    started: int = 0

    async def staff(self) -> None:
        """A producer on every broker that has none since it last started (one on a broker
        killed or restarted is stopped: its link died or moved), and a reader and a taker
        on a broker if the last one's broker started since."""
        for name in self.replicas.names:
            broker = self.replicas[name]
            if self.homes.get(name) is broker:
                producer = self.producers[name]
                assert not producer.ended, f"{name}'s producer ended: {producer.failed[-1:]}"
                continue
            if name in self.producers:
                await self.producers[name].stop()
            self.started += 1
            producer = await Producer.on(broker, f"{name}g{self.started}x", RETRY)
            self.producers[name], self.homes[name] = producer, broker
            self.every_producer.append(producer)
        if self.reader_home not in self.replicas.brokers.values():
            if self.readers:
                await self.readers[-1].stop()
            self.reader_home = self.replicas[self.rng.choice(self.replicas.names)]
            self.readers.append(await Consumer.on(self.reader_home))
        if self.taker_home not in self.replicas.brokers.values():
            if self.takers:
                await self.takers[-1].stop()
            self.taker_home = self.replicas[self.rng.choice(self.replicas.names)]
            self.takers.append(await taker_on(self.taker_home))

    async def all_acked(self, last: int) -> None:
        """Until the durable consumer's committed state (the leader's) has seqs 1..``last``
        acknowledged and none pending: an ack a taker sent before it was stopped may have
        been committed without its answer, so the takers' records may lack it. It may be
        far behind the producers (each batch taken or acknowledged is a commit), so what
        is waited for is that it goes on, its ack floor rising every few seconds."""
        consumer = self.takers[-1].conn.streams.bind_consumer(STREAM, "work")
        floor = -1
        state: dict[str, int] = {}

        async def goes_on() -> bool:
            try:
                state.update(await consumer.info(current=True))
            except MeshbusError:
                return False  # no leader for a moment
            return state["ack_floor"] > floor or done()

        def done() -> bool:
            return (state.get("ack_floor"), state.get("pending")) == (last, 0)

        while not done():
            await wait_until(
                goes_on,
                f"the consumer going on to {last} (at {state}; its taker's last errors"
                f" {self.takers[-1].errors[-3:]})",
                timeout=15,
            )
            floor = state["ack_floor"]

    def acked_since(self, names: list[str], since: float) -> int:
        return sum(self.producers[n].acked_since(since) for n in names)

    async def resumed(self, names: list[str], since: float, what: str) -> None:
        """Until the producers on ``names`` had 5 values acknowledged after ``since``,
        within a few election timeouts (with a client's resend on top)."""

        async def enough() -> bool:
            return self.acked_since(names, since) >= 5

        await wait_until(enough, what, timeout=4 * RESUME_WITHIN)
        first = min(at for n in names for at in self.producers[n].acked_at if at > since)
        assert first - since < RESUME_WITHIN, f"{what}: {first - since:.1f} s"

    async def fault(self, name: str, kind: str) -> None:
        replicas = self.replicas
        if kind == "kill":
            await replicas.kill(name)
        elif kind == "pause":
            replicas.pause(name)
        elif kind == "cut":
            replicas.cut_off(name)
        else:  # a graceful restart: it drains, hands its leaderships over, comes back
            replicas[name].process.send_signal(signal.SIGTERM)
            assert await replicas[name].process.wait() == 0
            await replicas.restart(name)

    async def heal(self, faults: dict[str, str]) -> None:
        """Paused ones going again and cut ones back first: a killed one restarts through
        a broker that answers."""
        for name, kind in faults.items():
            if kind == "pause":
                self.replicas.resume(name)
            elif kind == "cut":
                self.replicas.reconnect(name)
        for name, kind in faults.items():
            if kind == "kill":
                await self.replicas.restart(name)

    async def round(self, number: int) -> None:
        rng = self.rng
        names = self.replicas.names
        majority = rng.random() < MAJORITY_ODDS
        minority = rng.randint(1, (len(names) - 1) // 2)
        victims = rng.sample(names, len(names) // 2 + 1 if majority else minority)
        kinds = MAJORITY_FAULTS if majority else MINORITY_FAULTS
        faults = {name: rng.choice(kinds) for name in victims}
        blip = not majority and rng.random() < BLIP_ODDS
        what = f"seed {SOAK_SEED} round {number}: {faults}{' (a blip)' if blip else ''}"
        print(what)
        others = [n for n in names if n not in victims]
        fault_at = time.monotonic()
        for name, kind in faults.items():
            await self.fault(name, kind)
        if majority:
            # Once an election timeout is over, what was committed before is answered.
            await refused_meanwhile(self.producers[others[0]], since=fault_at + ELECTION)
            for name, producer in self.producers.items():
                assert producer.acked_since(fault_at + ELECTION) == 0, f"{what}: {name} acked"
        elif blip:
            await asyncio.sleep(rng.uniform(0, 2 * ELECTION))  # shorter than an election, or not
        else:
            await self.resumed(others, fault_at, f"{what}: the majority going on")
        await self.heal(faults)
        await self.staff()
        healed_at = time.monotonic()
        await self.resumed(names, healed_at, f"{what}: appends after the heal")


async def taker_on(broker: BrokerProcess) -> Taker:
    """The durable consumer "work" taking and acknowledging through ``broker``, once its
    leader answers (after a heal, the stream may have none for a moment)."""
    taker: list[Taker] = []

    async def bound() -> bool:
        try:
            taker.append(await Taker.on([broker.address]))
        except MeshbusError:
            return False
        return True

    await wait_until(bound, f"the consumer bound through {broker.name}", timeout=20)
    return taker[0]


@pytest.mark.slow
@pytest.mark.timeout(SOAK_SECONDS + 120)
async def test_a_random_schedule_of_faults_loses_nothing(tmp_path) -> None:
    async with replicated_stream(tmp_path, *FAST, count=SOAK_REPLICAS) as (replicas, _):
        soak = Soak(replicas, random.Random(SOAK_SEED))
        await soak.staff()
        for producer in soak.producers.values():
            await producer.wait_acked(5)
        deadline = time.monotonic() + SOAK_SECONDS
        number = 0
        while time.monotonic() < deadline:
            number += 1
            await soak.round(number)
        for producer in soak.every_producer:
            await producer.stop()
        stored = await check_copies(replicas, soak.every_producer)
        for reader in soak.readers:
            read = [(m.seq, m.payload) for m in reader.read]
            assert read == [(m.seq, m.payload) for m in stored[: len(read)]], "a read rewritten"
        await soak.readers[-1].stop()
        last = stored[-1].seq

        await soak.all_acked(last)
        await soak.takers[-1].stop()
        check_deliveries(soak.takers, stored)
        await same_everywhere(replicas, "work", (last + 1, last, 0))
        print(f"{number} rounds, {len(stored)} messages stored")
