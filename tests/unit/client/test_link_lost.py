"""A link lost before its WELCOME, with nobody waiting for the answer any more -- a dial
that a failover's deadline cancelled while it connected: nothing is logged as an
exception never retrieved, and one who does wait still gets the error."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from meshbus.client.dial import dial_tcp
from meshbus.client.link import BrokerLink
from meshbus.errors import ConnectionLost
from meshbus.protocol.control import Hello
from meshbus.protocol.handshake import DiallingHandshake

pytestmark = pytest.mark.real_loop


async def lost_before_welcome() -> BrokerLink:
    """A link to a server that closes every connection at once, before any answer."""

    async def hang_up(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    lost = asyncio.Event()
    link = await dial_tcp(
        "127.0.0.1",
        port,
        lambda: BrokerLink(
            f"127.0.0.1:{port}",
            DiallingHandshake(Hello(name="t")),
            max_frame=1 << 20,
            reader=None,  # type: ignore[arg-type]  # no frame reaches it
            full_inboxes=(),
            on_news=lambda *_: None,
            on_lost=lambda *_: lost.set(),
            on_writable=lambda: None,
        ),
    )
    await lost.wait()
    server.close()
    await server.wait_closed()
    return link


async def test_nobody_waiting_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    link = await lost_before_welcome()
    assert link.welcomed.done()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        del link
        gc.collect()
        await asyncio.sleep(0)
    assert [r.getMessage() for r in caplog.records] == []


async def test_one_waiting_still_gets_the_error() -> None:
    link = await lost_before_welcome()
    with pytest.raises(ConnectionLost, match="closed the link during the handshake"):
        await link.welcomed
