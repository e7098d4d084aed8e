"""The secure mesh's client: TLS and a user's key, from the environment.

    MESHBUS_BROKER=127.0.0.1:7401,127.0.0.1:7402 MESHBUS_TLS_CA=.../tls/ca.pem \
    MESHBUS_CREDS=.../game.creds python examples/secure_mesh/client.py

(setup.sh prints the exact command.) The user "game" may register game* services, join
and send to multicast:scores -- and nothing else: joining another topic is refused with
PermissionDenied, and the link stays usable.
"""

from __future__ import annotations

import asyncio

import meshbus


async def main() -> None:
    async with meshbus.connect(server="game1") as conn:  # TLS and sign-in from the env
        print(f"signed in over TLS to broker {conn.broker_name}")
        board = await conn.register()
        await board.subscribe("scores")
        await conn.publish("scores", json={"player": "ann", "score": 7})
        print(f"received {(await board.recv(timeout=5)).json()}")
        try:
            await board.subscribe("admin")
        except meshbus.PermissionDenied as exc:
            print(f"refused: {exc}")
        await conn.publish("scores", json={"player": "bob", "score": 9})
        print(f"received {(await board.recv(timeout=5)).json()}")


if __name__ == "__main__":
    asyncio.run(main())
