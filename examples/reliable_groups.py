"""Reliable sends and ordered message groups: every match's events to one worker, in order.

    python examples/reliable_groups.py

Two workers serve ``anycast:matches``. The events of one match form a message group:
all go to the same worker, in the order sent, exactly once, each acknowledged; the
last one says ``final=True`` and ends the group. ``send_reliable`` returns once the
worker's connector has acknowledged the message.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import meshbus

MATCHES = 4
EVENTS = 20


async def main() -> None:
    async with meshbus.connect(server="workers") as workers, meshbus.connect(server="game") as game:
        seen: dict[str, list[int]] = defaultdict(list)
        worker_of: dict[str, set[str]] = defaultdict(set)
        finished = asyncio.Event()

        async def worker(instance: int) -> None:
            service = await workers.register(instance=instance)
            await service.join(meshbus.Anycast("matches"))

            def handle(msg: meshbus.Message) -> None:
                if msg.group is None:  # the lone reliable send at the end
                    return
                seen[msg.group].append(msg.json()["event"])
                worker_of[msg.group].add(str(service.address))
                if sum(map(len, seen.values())) == MATCHES * EVENTS:
                    finished.set()

            service.add_listener(handle)

        await worker(1)
        await worker(2)
        sender = await game.register()
        for event in range(EVENTS):
            for match in range(MATCHES):
                await sender.send(
                    meshbus.Anycast("matches"),
                    json={"event": event},
                    group=f"match-{match}",
                    final=event == EVENTS - 1,
                )
        await game.wait_acked(10)  # every one acknowledged, or wait_acked raises Timeout
        await asyncio.wait_for(finished.wait(), 10)
        for group in sorted(seen):
            in_order = seen[group] == list(range(EVENTS))
            print(f"{group}: {len(seen[group])} events, in order: {in_order}, "
                  f"worker: {', '.join(sorted(worker_of[group]))}")  # fmt: skip
        await sender.send_reliable(meshbus.Anycast("matches"), json={"event": -1})
        print("a lone reliable send: acknowledged")


if __name__ == "__main__":
    asyncio.run(main())
