"""Each limit flag of ``meshbus broker`` is taken by the real broker, and a client sees
what the limit says (the limits themselves are tested in tests/unit/broker/core/test_limits.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

import meshbus
from meshbus.errors import NoRoute, RegistrationError, Timeout
from meshbus.protocol import ControlFrame, ControlType, ErrorCode, encode_control
from meshbus.protocol.control import ROLE_OPERATOR, AddressBody, Error, Hello, Membership, Register
from tests.conftest import BrokerProcess, start_broker
from tests.integration.helpers import RawLink, stat, wait_until


@asynccontextmanager
async def running(*args: str) -> AsyncIterator[BrokerProcess]:
    broker = await start_broker(*args)
    try:
        yield broker
    finally:
        assert await broker.stop() == 0


async def only_error(link: RawLink) -> Error:
    """The one ERROR frame the broker sends before it closes ``link``."""
    (frame,) = await link.read_until_closed()
    assert isinstance(frame, ControlFrame)
    assert frame.type == ControlType.ERROR, frame
    assert isinstance(frame.body, Error)
    return frame.body


async def joins_until_refused(service: meshbus.Service, flag: str) -> int:
    """Join new groups until the broker refuses one; returns how many were joined. (The
    connector may have joined a group of its own too, so the count is at most the limit.)"""
    refused: RegistrationError | None = None
    joined = 0
    while refused is None and joined < 50:
        try:
            await service.join(meshbus.Multicast(f"g{joined}"))
            joined += 1
        except RegistrationError as exc:
            refused = exc
    assert refused is not None, "never refused"
    assert refused.code == ErrorCode.LIMIT_EXCEEDED
    assert flag in str(refused)
    return joined


async def test_max_services_flag() -> None:
    async with (
        running("--max-services", "2") as broker,
        await meshbus.connect(broker.address, server="svc") as conn,
    ):
        first = await conn.register()
        await conn.register()
        with pytest.raises(RegistrationError, match="--max-services") as caught:
            await conn.register()
        assert caught.value.code == ErrorCode.LIMIT_EXCEEDED
        await first.join(meshbus.Multicast("still.usable"))


async def test_max_groups_per_service_flag() -> None:
    async with (
        running("--max-groups-per-service", "3") as broker,
        await meshbus.connect(broker.address, server="svc") as conn,
    ):
        svc = await conn.register()
        assert 2 <= await joins_until_refused(svc, "--max-groups-per-service") <= 3
        other = await conn.register()
        await other.join(meshbus.Multicast("g40"))


async def test_max_groups_flag() -> None:
    async with (
        running("--max-groups", "4") as broker,
        await meshbus.connect(broker.address, server="svc") as conn,
    ):
        one, two = await conn.register(), await conn.register()
        await one.join(meshbus.Multicast("a"))
        assert 2 <= await joins_until_refused(two, "--max-groups)") <= 3
        with pytest.raises(RegistrationError, match="--max-groups\\)"):
            await one.join(meshbus.Multicast("b"))


async def test_max_requests_flag() -> None:
    async with (
        running("--max-requests", "1") as broker,
        await meshbus.connect(broker.address, server="svc") as conn,
    ):
        silent = await conn.register(instance=1)  # never answers
        asker = await conn.register()
        waiting = asyncio.create_task(asker.request(silent.address, b"1", timeout=1.0))

        async def first_is_pending() -> bool:
            return bool((await stat(broker, detail=False))["counters"]["pending"] == 1)

        await wait_until(first_is_pending, "the first request pending at the broker")
        with pytest.raises(NoRoute, match="--max-requests"):
            await asker.request(silent.address, b"2", timeout=5.0)
        with pytest.raises(Timeout):
            await waiting


async def test_max_request_timeout_flag() -> None:
    async with (
        running("--max-request-timeout", "0.3") as broker,
        await meshbus.connect(broker.address, server="svc") as conn,
    ):
        silent = await conn.register(instance=1)
        asker = await conn.register()
        started = time.monotonic()
        with pytest.raises(Timeout):
            await asker.request(silent.address, b"?", timeout=30.0)
        assert time.monotonic() - started < 5.0, "the broker's TIMEOUT came at 0.3 s"


async def test_handshake_timeout_flag() -> None:
    async with running("--handshake-timeout", "0.3", "--heartbeat-interval", "0.1") as broker:
        link = await RawLink.open(broker.address)
        try:
            error = await only_error(link)
        finally:
            await link.close()
        assert error.code == ErrorCode.NOT_HANDSHAKEN
        assert "--handshake-timeout" in error.message


async def test_max_handshaking_flag() -> None:
    async with running("--max-handshaking", "1") as broker:
        waiting = await RawLink.open(broker.address)
        turned_away = await RawLink.open(broker.address)
        try:
            error = await only_error(turned_away)
            assert error.code == ErrorCode.LIMIT_EXCEEDED
            assert "--max-handshaking" in error.message
            await waiting.hello()
            await waiting.ping()
        finally:
            await turned_away.close()
            await waiting.close()


async def test_max_operators_flag() -> None:
    async with running("--max-operators", "1") as broker:
        first, second = await RawLink.open(broker.address), await RawLink.open(broker.address)
        try:
            for link in (first, second):
                await link.send(
                    encode_control(ControlType.HELLO, Hello(role=ROLE_OPERATOR, name="op"), 1)
                )
            assert (await first.read_control()).type == ControlType.WELCOME
            error = await only_error(second)
            assert error.code == ErrorCode.LIMIT_EXCEEDED
            assert "--max-operators" in error.message
            await first.ping()
        finally:
            await first.close()
            await second.close()


# -- memory comes back ------------------------------------------------------------------------

ABUSE_SERVICES = 200_000
ABUSE_GROUPS = 100_000
GROUPS_PER_MEMBER = 1_000


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def settled_rss_kib(pid: int, timeout: float = 10.0) -> int:
    """The RSS once it has stopped falling: the last slices of a withdrawal and the
    allocator's giving back may still be under way when the routes read 0."""
    deadline = asyncio.get_running_loop().time() + timeout
    last = rss_kib(pid)
    while asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.25)
        now = rss_kib(pid)
        if now > last - 256:
            return min(now, last)
        last = now
    return last


async def answers(link: RawLink, count: int, expected: ControlType) -> list[ControlFrame]:
    frames = []
    for _ in range(count):
        frame = await link.read_control(timeout=60)
        assert frame.type == expected, frame
        frames.append(frame)
    return frames


async def abuse(address: str) -> tuple[RawLink, int]:
    """A connector that registers ABUSE_SERVICES services and joins ABUSE_GROUPS groups
    (pipelined, in batches), left open; and how many routes it made."""
    link = await RawLink.open(address)
    try:
        await link.hello("abuser")
        members: list[bytes] = []
        batch = 5_000
        for start in range(0, ABUSE_SERVICES, batch):
            await link.send(
                b"".join(
                    encode_control(ControlType.REGISTER, Register(server=f"s{i % 50}"), i + 1)
                    for i in range(start, start + batch)
                )
            )
            for frame in await answers(link, batch, ControlType.REGISTERED):
                assert isinstance(frame.body, AddressBody)
                members.append(frame.body.address)
        for start in range(0, ABUSE_GROUPS, batch):
            await link.send(
                b"".join(
                    encode_control(
                        ControlType.JOIN,
                        Membership(
                            member=members[i // GROUPS_PER_MEMBER],
                            group=meshbus.Multicast(f"g{i}").to_bytes(),
                        ),
                        i + 1,
                    )
                    for i in range(start, start + batch)
                )
            )
            await answers(link, batch, ControlType.OK)
    except BaseException:
        await link.close()  # not left for a later test to collect
        raise
    return link, len(members)


@pytest.mark.slow
@pytest.mark.parametrize("allocator", ["pymalloc", "malloc"])
async def test_memory_comes_back_after_an_abusive_connector_leaves(
    allocator: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broker's RSS after a connector with 200,000 services in 100,000 groups has left is
    back near where it was (docs/architecture.md, the limits: what is kept), and after a
    second such connector too. On Python's allocator (the default) objects that outlive
    the abuser pin some of pymalloc's arenas, so the promise is 50 % above the baseline at
    most, and a second abuser adds at most a tenth of what the first took (a leak of the
    tables would add all of it); on the C allocator (PYTHONMALLOC=malloc) 20 %."""
    monkeypatch.setenv("PYTHONMALLOC", allocator)
    limits = ("--max-services", "1000000", "--max-groups", "1000000")
    async with running(*limits) as broker:
        pid = broker.process.pid
        # A connector that comes and goes first: the baseline is a broker that has served.
        warm = await RawLink.open(broker.address)
        await warm.hello("warm")
        await warm.register("warm")
        await warm.close()
        await asyncio.sleep(0.5)
        baseline = rss_kib(pid)
        figures = []
        for _ in range(2):
            link, services = await abuse(broker.address)
            during = rss_kib(pid)
            await link.close()
            assert services == ABUSE_SERVICES

            # Withdrawn in slices (well under 2 s on an idle machine), the memory given back
            # after the last.
            async def withdrawn() -> bool:
                return (await stat(broker, detail=False))["routes"] == 0

            await wait_until(withdrawn, "every route of the abuser withdrawn", timeout=30)
            figures.append((during, await settled_rss_kib(pid)))
        lag = (await stat(broker, detail=False))["loop_lag_ms"]
        print(f"{allocator} VmRSS KiB: baseline {baseline}, (during, after) x2: {figures}")
        print(f"{allocator} loop lag through the abuse and its withdrawal: {lag}")
        (during, after), (_, after_again) = figures
        assert during > baseline + 50 * 1024, "the abuse took memory"
        # pymalloc: measured 1.09-1.20x after one abuser, 1.16-1.33x after each of up to six
        # on an idle machine, 1.37x after the second on one under heavy load (load average
        # 9 on 2 cores: more of the loop's short-lived objects settle in the abuser's
        # arenas); 1.5-1.85x before the broker emptied the free lists and kept its tables
        # out of the collector's sight. The pinned arenas vary by a few MiB from one abuser
        # to the next, up or down, so the step is held to a tenth of the abuse, not to 0.
        bound = 1.2 if allocator == "malloc" else 1.5
        assert max(after, after_again) <= baseline * bound, (baseline, figures)
        assert after_again - after <= (during - baseline) / 10, (baseline, figures)
