"""Request/response through one real broker: reverse routing, NoRoute, Timeout, late responses.

Timing bounds: a request's deadline is enforced by the broker (TIMEOUT frame); the
connector only falls back to its own guard one second after the deadline. So a Timeout
that arrives in [timeout, timeout + 1 s) is the broker's, and NoRoute must come "at
once", far below the request's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

import meshbus
from tests.integration.helpers import IO_TIMEOUT, assert_next_is

Handler = Callable[[meshbus.Message], Awaitable[None]]


@contextlib.asynccontextmanager
async def serving(service: meshbus.Service, handler: Handler | None = None) -> AsyncIterator[None]:
    """Run a responder on ``service`` for the duration of the block.

    The default handler answers ``b"re:" + payload`` and checks the message is a request."""

    async def echo(msg: meshbus.Message) -> None:
        assert msg.is_request
        await msg.reply(b"re:" + msg.payload)

    async def loop() -> None:
        async for msg in service:
            await (handler or echo)(msg)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def pending(conn: meshbus.Connector) -> int:
    counters: dict[str, int] = (await conn.stat())["counters"]
    return counters["pending"]


async def wait_pending_zero(conn: meshbus.Connector) -> None:
    """Poll the broker's pending count (a real condition, bounded) until it is 0.

    Needed when the change happened on another link, whose frames the broker may handle
    after this connector's STAT."""
    last = -1
    for _ in range(int(IO_TIMEOUT / 0.01)):
        last = await pending(conn)
        if last == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"broker still has {last} pending requests")


# -- answered requests --------------------------------------------------------------------


async def test_request_response_unicast(conns):
    requester = await conns[0].register()
    responder = await conns[1].register(instance=1)
    seen: list[meshbus.Message] = []

    async def handler(msg: meshbus.Message) -> None:
        seen.append(msg)
        await msg.reply(b"ok:" + msg.payload)

    async with serving(responder, handler):
        reply = await requester.request(responder.address, b"user=ann", timeout=5)
    assert reply.payload == b"ok:user=ann"
    assert reply.src == responder.address
    assert reply.dst == requester.address
    assert not reply.is_request
    (request,) = seen
    assert request.is_request
    assert request.src == requester.address
    assert request.dst == responder.address
    assert request.payload == b"user=ann"
    assert await pending(conns[0]) == 0


async def test_request_to_service_of_same_connector(conns):
    requester, responder = await conns[0].register(), await conns[0].register()
    async with serving(responder):
        reply = await requester.request(responder.address, b"x", timeout=5)
    assert (reply.payload, reply.src) == (b"re:x", responder.address)


async def test_request_response_anycast_reply_from_responder_unicast(conns):
    pool = meshbus.Anycast("login")
    requester = await conns[0].register()
    responders = [await conns[1].register(), await conns[2].register(), await conns[2].register()]
    for responder in responders:
        await responder.join(pool)

    def handler_for(service: meshbus.Service) -> Handler:
        async def handler(msg: meshbus.Message) -> None:
            assert msg.is_request
            assert msg.dst == pool
            await msg.reply(str(service.address).encode() + b"|" + msg.payload)

        return handler

    async with contextlib.AsyncExitStack() as stack:
        for responder in responders:
            await stack.enter_async_context(serving(responder, handler_for(responder)))
        replies = [await requester.request(pool, b"%d" % i, timeout=5) for i in range(60)]
    answered_by = set()
    for i, reply in enumerate(replies):
        who, _, payload = reply.payload.partition(b"|")
        assert payload == b"%d" % i
        # The response comes from the unicast address of the member that handled it,
        # never from the anycast address.
        assert str(reply.src).encode() == who
        assert reply.src in {r.address for r in responders}
        answered_by.add(reply.src)
    assert len(answered_by) >= 2, "anycast requests all went to one member"
    assert await pending(conns[0]) == 0


async def test_reply_to_plain_message_is_refused(conns):
    a, b = await conns[0].register(), await conns[1].register()
    await a.send(b.address, b"plain")
    msg = await b.recv(timeout=5)
    assert not msg.is_request
    with pytest.raises(meshbus.MeshbusError):
        await msg.reply(b"no")


async def test_request_timeout_must_be_positive(conns):
    a = await conns[0].register()
    with pytest.raises(ValueError, match="timeout"):
        await a.request(a.address, b"x", timeout=0)


# -- NoRoute ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dst",
    [meshbus.Unicast("nobody", 9), meshbus.Anycast("nobody"), meshbus.Multicast("nobody")],
    ids=str,
)
async def test_no_route_at_once(conns, dst):
    requester = await conns[0].register()
    start = time.monotonic()
    with pytest.raises(meshbus.NoRoute) as info:
        await requester.request(dst, b"x", timeout=5)
    elapsed = time.monotonic() - start
    assert elapsed < 0.5, f"NoRoute took {elapsed:.3f} s; it must not wait for the timeout"
    assert str(dst) in str(info.value)
    assert info.value.address == str(dst)
    assert isinstance(info.value, meshbus.RequestError)
    assert await pending(conns[0]) == 0


async def test_no_route_when_requester_is_the_only_anycast_member(conns):
    pool = meshbus.Anycast("self")
    requester = await conns[0].register()
    await requester.join(pool)
    with pytest.raises(meshbus.NoRoute):
        await requester.request(pool, b"x", timeout=5)


async def test_no_route_after_responder_unregisters(conns):
    requester = await conns[0].register()
    responder = await conns[1].register(instance=3)
    async with serving(responder):
        assert (await requester.request(responder.address, b"a", timeout=5)).payload == b"re:a"
    await responder.unregister()
    with pytest.raises(meshbus.NoRoute):
        await requester.request(responder.address, b"b", timeout=5)


# -- Timeout ----------------------------------------------------------------------------


async def test_timeout_after_roughly_the_timeout(conns):
    requester = await conns[0].register()
    silent = await conns[1].register(instance=7)
    timeout = 0.5
    start = time.monotonic()
    with pytest.raises(meshbus.Timeout) as info:
        await requester.request(silent.address, b"x", timeout=timeout)
    elapsed = time.monotonic() - start
    assert elapsed >= timeout
    assert elapsed < timeout + 1.0, f"Timeout after {elapsed:.3f} s for a {timeout} s request"
    assert str(silent.address) in str(info.value)
    # The request did reach the service: the broker routed it and timed it out.
    assert (await silent.recv(timeout=1)).is_request
    counters = (await conns[0].stat())["counters"]
    assert counters["pending"] == 0
    assert counters["timeouts"] >= 1


async def test_timeout_error_carries_the_timeout(conns):
    """errors.py documents Timeout.timeout; it must be set however the Timeout arose."""
    requester = await conns[0].register()
    silent = await conns[1].register()
    with pytest.raises(meshbus.Timeout) as info:
        await requester.request(silent.address, b"x", timeout=0.2)
    assert info.value.timeout == pytest.approx(0.2)


async def test_link_usable_after_timeout(conns):
    requester = await conns[0].register()
    responder = await conns[1].register()
    with pytest.raises(meshbus.Timeout):
        await requester.request(responder.address, b"first", timeout=0.2)
    assert (await responder.recv(timeout=1)).payload == b"first"
    async with serving(responder):
        assert (await requester.request(responder.address, b"2", timeout=5)).payload == b"re:2"


async def test_late_response_is_dropped_and_counted(conns):
    requester = await conns[0].register()
    responder = await conns[1].register()
    before = (await conns[1].stat())["counters"]["late_responses"]

    task = asyncio.create_task(requester.request(responder.address, b"slow", timeout=0.3))
    msg = await responder.recv(timeout=5)
    with pytest.raises(meshbus.Timeout):
        await task
    await msg.reply(b"too late")
    # Stat goes over the responder's link after the reply, so the broker has seen it.
    counters = (await conns[1].stat())["counters"]
    assert counters["late_responses"] == before + 1
    assert counters["pending"] == 0
    # The late response did not reach the requester as a stray message.
    await requester.send(requester.address, b"marker")
    await assert_next_is(requester, b"marker")
    assert conns[0].dropped == 0


async def test_responder_connector_disconnects_before_answering(broker, conns):
    requester = await conns[0].register()
    doomed = await meshbus.connect(broker.address, server="doomed")
    responder = await doomed.register()
    timeout = 0.5
    start = time.monotonic()
    task = asyncio.create_task(requester.request(responder.address, b"x", timeout=timeout))
    assert (await responder.recv(timeout=5)).is_request
    await doomed.close()
    with pytest.raises(meshbus.Timeout):
        await task
    elapsed = time.monotonic() - start
    assert timeout <= elapsed < timeout + 1.0
    await wait_pending_zero(conns[0])


async def test_requester_disconnect_clears_its_pending_entries(broker, conns):
    responder = await conns[1].register()
    leaving = await meshbus.connect(broker.address, server="leaving")
    requester = await leaving.register()
    tasks = [
        asyncio.create_task(requester.request(responder.address, b"%d" % i, timeout=30))
        for i in range(5)
    ]
    for _ in range(5):
        assert (await responder.recv(timeout=5)).is_request
    assert await pending(conns[1]) == 5
    await leaving.close()
    for task in tasks:
        with pytest.raises(meshbus.NotConnected):
            await task
    await wait_pending_zero(conns[1])


# -- many requests ---------------------------------------------------------------------


async def test_200_concurrent_requests_answered_out_of_order(conns):
    requester = await conns[0].register()
    responder = await conns[1].register()
    count = 200
    tasks = [
        asyncio.create_task(requester.request(responder.address, b"q%d" % i, timeout=10))
        for i in range(count)
    ]
    # Take all 200 before answering any, then answer newest first: every response must
    # still find its own request.
    requests = [await responder.recv(timeout=5) for _ in range(count)]
    assert await pending(conns[1]) == count
    for msg in reversed(requests):
        await msg.reply(b"a" + msg.payload[1:])
    replies = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert [r.payload for r in replies] == [b"a%d" % i for i in range(count)]
    assert await pending(conns[0]) == 0


async def test_requests_from_two_connectors_to_one_responder(broker, conns):
    # Same server name on both: the requesters differ only by their dynamic ids, and both
    # connectors number their messages from 1, so the pending table must key by both.
    async with (
        await meshbus.connect(broker.address, server="game01") as c1,
        await meshbus.connect(broker.address, server="game01") as c2,
    ):
        r1, r2 = await c1.register(), await c2.register()
        assert r1.address != r2.address
        responder = await conns[2].register(instance=1)
        async with serving(responder):

            async def run(requester: meshbus.Service, tag: bytes) -> list[bytes]:
                replies = await asyncio.gather(
                    *(
                        requester.request(responder.address, tag + b"%d" % i, timeout=10)
                        for i in range(50)
                    )
                )
                assert all(r.dst == requester.address for r in replies)
                return [r.payload for r in replies]

            got1, got2 = await asyncio.gather(run(r1, b"one-"), run(r2, b"two-"))
        assert got1 == [b"re:one-%d" % i for i in range(50)]
        assert got2 == [b"re:two-%d" % i for i in range(50)]
    assert await pending(conns[2]) == 0
