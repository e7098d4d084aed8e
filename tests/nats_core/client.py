"""nats-core against a NATS server: python client.py CHECK URL, run by
tests/integration/test_nats_core.py with the interpreter of tests/nats_core/.venv (nats-core
needs Python >= 3.13; see venv.py). Prints "ok CHECK" and exits 0, or fails with the
traceback.

nats-core's package is ``nats.client``, beside nats.py's ``nats`` in name only: it runs
in a venv of its own, never with meshbus's interpreter.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable

from nats.client import Client, connect
from nats.client.errors import NoRespondersError

TIMEOUT = 5.0


async def wildcards(nc: Client) -> None:
    """One copy per matching subscription: ``*``, ``>`` and an exact subject."""
    star = await nc.subscribe("core.wild.*")
    rest = await nc.subscribe("core.>")
    exact = await nc.subscribe("core.wild.a")
    await nc.flush()
    await nc.publish("core.wild.a", b"one")
    await nc.publish("core.other.b.c", b"two")
    assert (await star.next(TIMEOUT)).subject == "core.wild.a"
    assert [(await rest.next(TIMEOUT)).data for _ in range(2)] == [b"one", b"two"]
    assert (await exact.next(TIMEOUT)).data == b"one"


async def queues(nc: Client) -> None:
    """A queue group gets each message once, spread over its members."""
    counts = [0, 0]
    all_came = asyncio.Event()

    def counted(member: int) -> None:
        counts[member] += 1
        if sum(counts) == 100:
            all_came.set()

    for member in range(2):
        sub = await nc.subscribe("core.work", queue="workers")
        sub.add_callback(lambda _, member=member: counted(member))
    await nc.flush()
    for _ in range(100):
        await nc.publish("core.work", b"")
    await asyncio.wait_for(all_came.wait(), TIMEOUT)
    await nc.flush()  # a copy too many would have come by now
    assert sum(counts) == 100, counts
    assert min(counts) > 0, counts


async def headers(nc: Client) -> None:
    """Headers arrive as sent, a key with many values too."""
    sub = await nc.subscribe("core.headers")
    await nc.flush()
    await nc.publish("core.headers", b"body", headers={"X-Trace": "abc", "X-Multi": ["1", "2"]})
    message = await sub.next(TIMEOUT)
    assert message.headers is not None
    assert message.headers.get("X-Trace") == "abc"
    assert message.headers.get_all("X-Multi") == ["1", "2"]
    assert message.data == b"body"


async def requests(nc: Client) -> None:
    """Request/reply through the client's own inbox, and through an explicit one."""
    service = await nc.subscribe("core.svc")

    async def answer() -> None:
        async for message in service:
            assert message.reply is not None
            await nc.publish(message.reply, b"re:" + message.data)

    answering = asyncio.create_task(answer())
    await nc.flush()
    assert (await nc.request("core.svc", b"q", timeout=TIMEOUT)).data == b"re:q"
    inbox = nc.new_inbox()
    answers = await nc.subscribe(inbox)
    await nc.publish("core.svc", b"again", reply=inbox)
    assert (await answers.next(TIMEOUT)).data == b"re:again"
    answering.cancel()


async def no_responders(nc: Client) -> None:
    """A request nobody subscribes to: the 503 status, raised as NoRespondersError."""
    try:
        await nc.request("core.nobody.home", b"", timeout=TIMEOUT)
    except NoRespondersError:
        return
    raise AssertionError("a request to no subscriber was answered")


CHECKS: dict[str, Callable[[Client], Awaitable[None]]] = {
    check.__name__: check for check in (wildcards, queues, headers, requests, no_responders)
}


async def main(check: str, url: str) -> None:
    nc = await connect(url, timeout=TIMEOUT, allow_reconnect=False)
    try:
        await CHECKS[check](nc)
    finally:
        await nc.close()
    print(f"ok {check}")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
