"""What every nats.py user of the rig and the tests needs and nats.py lacks."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # nats.py is imported by the NATS side only, when it runs
    from nats.aio.client import Client


async def flushed(*clients: Client) -> None:
    """Everything the clients sent so far (SUBs, PUBs) has reached their servers: the
    PONG of a PING comes once the server applied what came before it (on a meshbus
    mesh, a SUB once every broker knows it). One ``flush`` is not enough with nats.py
    2.16: it writes the PING straight to the socket (``Client._send_ping``), ahead of
    commands still queued for its flusher task, so the PONG can come before the server
    saw a SUB, and a message published then is not delivered (seen on nats-server
    itself). After that first PONG the flusher has run, so a second flush's PING
    follows everything sent before the call."""
    for nc in clients:
        await nc.flush()
        await nc.flush()
