"""Publish/subscribe: topics with JSON payloads and headers, and the batch receive.

    python examples/pubsub.py

A scoreboard subscribes to ``scores``; three game servers publish to it without a
service of their own (``conn.publish``). Every subscriber gets every message once, in
the order each publisher sent them.
"""

from __future__ import annotations

import asyncio

import meshbus

GAMES = 3
ROUNDS = 5


async def main() -> None:
    async with meshbus.connect(server="board") as board:
        scoreboard = await board.register()
        await scoreboard.subscribe("scores")
        totals: dict[str, int] = {}

        async def tally() -> None:
            seen = 0
            async for batch in scoreboard.batches():  # what one read brought, at once
                for msg in batch:
                    score = msg.json()
                    totals[score["player"]] = totals.get(score["player"], 0) + score["points"]
                    seen += 1
                if seen == GAMES * ROUNDS:
                    return

        counting = asyncio.create_task(tally())
        for game in range(1, GAMES + 1):
            async with meshbus.connect(server=f"game{game}") as conn:
                for round_ in range(1, ROUNDS + 1):
                    score = {"player": f"p{game}", "points": round_ * 10}
                    await conn.publish("scores", json=score, headers={"Round": str(round_)})
                await conn.ping()  # the broker has routed all of them
        await asyncio.wait_for(counting, 10)
        for player, points in sorted(totals.items()):
            print(f"{player}: {points} points")


if __name__ == "__main__":
    asyncio.run(main())
