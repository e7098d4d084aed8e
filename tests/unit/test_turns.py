"""``Turns``: one at a time per key, first come first served -- what keeps a message
group's sends in the order they were called while one of them waits for the broker."""

from __future__ import annotations

import asyncio

from meshbus.util import Turns


async def test_turns_of_one_key_go_in_the_order_they_came_and_other_keys_do_not_wait() -> None:
    turns: Turns[str] = Turns()
    order: list[str] = []
    first_in = asyncio.Event()
    release = asyncio.Event()

    async def take(key: str, name: str, hold: bool = False) -> None:
        async with turns.turn(key):
            order.append(name)
            if hold:
                first_in.set()
                await release.wait()

    first = asyncio.create_task(take("g", "g1", hold=True))
    await first_in.wait()
    waiting = [asyncio.create_task(take("g", f"g{i}")) for i in range(2, 6)]
    await take("h", "h1")  # another key: its turn is free while g1 holds g's
    assert order == ["g1", "h1"]
    assert "g" in turns
    assert "h" not in turns, "h's turn is forgotten once it is over"
    release.set()
    await asyncio.gather(first, *waiting)
    assert order == ["g1", "h1", "g2", "g3", "g4", "g5"]
    assert len(turns) == 0


async def test_a_turn_given_up_while_waiting_leaves_the_others_in_order() -> None:
    turns: Turns[str] = Turns()
    order: list[str] = []
    release = asyncio.Event()

    async def take(name: str) -> None:
        async with turns.turn("g"):
            order.append(name)
            await release.wait()

    holder = asyncio.create_task(take("a"))
    await asyncio.sleep(0)
    quitter = asyncio.create_task(take("b"))
    last = asyncio.create_task(take("c"))
    await asyncio.sleep(0)
    quitter.cancel()  # as a send whose deadline passed while it waited for its turn
    release.set()
    await asyncio.gather(holder, last)
    assert quitter.cancelled()
    assert order == ["a", "c"]
    assert len(turns) == 0
