"""`bench client`: the Python API between two processes through one server, vs nats.py.

What a Python service gets from the library, not what the server can do: two worker
processes (spawned once per command, each running one uvloop loop per scenario) talk
through one meshbus broker or one nats-server, with meshbus's client on one side of the
comparison and nats.py on the other, the same code shape on both:

* ``plain``: 16-byte messages one way, ``await svc.send`` -> ``async for msg in svc``
  vs ``await nc.publish`` -> a subscription callback; messages per second at the
  receiver, from the first tenth of the messages (a warm-up) to the last.
* ``fast``: the same with meshbus's batch and callback APIs, ``await svc.send_many``
  (64 messages a call) -> an inline ``svc.add_listener``; nats.py has nothing faster
  than publish -> callback, so its side is the same as in ``plain``.
* ``request``: request/response with ``concurrency`` requests in flight, ``await
  svc.request`` against ``async for msg in svc: await msg.reply(...)`` in the other
  process vs ``await nc.request`` against a subscription callback that
  ``await msg.respond(...)``s; requests per second, and the p50 latency at concurrency 1.

Each scenario alternates the systems run by run (``runs.alternate``); the ratios are
meshbus / nats between the medians of the same command.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import click
import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg as NatsMsg

import meshbus
from bench.nats_py import flushed
from bench.report import key_values
from bench.runs import alternate, request_options, runs_options
from bench.servers import BenchSetupError, Server, meshbus_broker, nats_server

_RECEIVER = ("benchrx", 1)  # the fixed meshbus address of the receiving service
_SUBJECT = "bench.client"  # and the nats subject
_SEND_MANY = 64  # messages per send_many in the fast one-way scenario
# Bounds one scenario in a worker; reached only when messages were lost or a peer hung.
_SCENARIO_TIMEOUT = 120.0


@dataclass(frozen=True)
class Job:
    """What one worker does in one scenario: its ``role`` on ``system`` at host:port."""

    role: str  # "receive", "send", "respond", "request"
    system: str  # "meshbus" or "nats"
    host: str
    port: int
    count: int  # messages or requests
    size: int
    concurrency: int = 1
    fast: bool = False  # meshbus: the batch and callback APIs (nats.py has no other)


# -- the worker processes -----------------------------------------------------------------


def _worker(pipe: Connection) -> None:
    """A worker: runs each ``Job`` it is sent on a fresh uvloop loop until sent None; says
    ("ready",) once it can take traffic, then ("done", figures) or ("error", text)."""
    import uvloop

    while (job := pipe.recv()) is not None:
        try:
            figures = uvloop.run(asyncio.wait_for(_ROLES[job.role](job, pipe), _SCENARIO_TIMEOUT))
        except BaseException:
            pipe.send(("error", traceback.format_exc()))
        else:
            pipe.send(("done", figures))


def _ready(pipe: Connection) -> None:
    pipe.send(("ready",))


async def _connect_meshbus(job: Job, server: str) -> meshbus.Connector:
    return await meshbus.connect(f"{job.host}:{job.port}", server=server)


async def _connect_nats(job: Job) -> NatsClient:
    return await nats.connect(f"nats://{job.host}:{job.port}")


class _Arrivals:
    """Counts arrivals; times the run from the end of the warm-up to the last one."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.warmup = max(1, count // 10)
        self.seen = 0
        self.started = 0.0
        self.ended = asyncio.get_running_loop().create_future()

    def arrived(self, n: int = 1) -> None:
        before = self.seen
        self.seen += n
        if before < self.warmup <= self.seen:
            self.started = time.perf_counter()
        if self.seen >= self.count and not self.ended.done():
            self.ended.set_result(time.perf_counter())

    async def rate(self) -> dict[str, float]:
        ended = await self.ended
        if self.seen != self.count:
            raise AssertionError(f"received {self.seen} messages, {self.count} were sent")
        return {"msgs_per_s": (self.count - self.warmup) / (ended - self.started)}


async def _receive(job: Job, pipe: Connection) -> dict[str, float]:
    arrivals = _Arrivals(job.count)
    if job.system == "meshbus":
        async with await _connect_meshbus(job, _RECEIVER[0]) as conn:
            svc = await conn.register(_RECEIVER[1])
            if job.fast:
                svc.add_listener(lambda _: arrivals.arrived())
                _ready(pipe)
                return await arrivals.rate()
            _ready(pipe)
            async for _ in svc:
                arrivals.arrived()
                if arrivals.ended.done():
                    break
            return await arrivals.rate()
    nc = await _connect_nats(job)
    try:

        async def counted(_: NatsMsg) -> None:
            arrivals.arrived()

        await nc.subscribe(_SUBJECT, cb=counted)
        await flushed(nc)
        _ready(pipe)
        return await arrivals.rate()
    finally:
        await nc.close()


async def _send(job: Job, pipe: Connection) -> dict[str, float]:
    payload = b"x" * job.size
    if job.system == "meshbus":
        async with await _connect_meshbus(job, "benchtx") as conn:
            svc = await conn.register()
            dst = meshbus.Unicast(*_RECEIVER)
            _ready(pipe)
            if job.fast:
                batch = [payload] * _SEND_MANY
                full, rest = divmod(job.count, _SEND_MANY)
                for _ in range(full):
                    await svc.send_many(dst, batch)
                await svc.send_many(dst, batch[:rest])
            else:
                for _ in range(job.count):
                    await svc.send(dst, payload)
            await conn.ping()  # every message is routed before the link closes
        return {}
    nc = await _connect_nats(job)
    try:
        _ready(pipe)
        for _ in range(job.count):
            await nc.publish(_SUBJECT, payload)
        await nc.flush()
    finally:
        await nc.close()
    return {}


async def _respond(job: Job, pipe: Connection) -> dict[str, float]:
    """Answer requests (with their own payload) until the requester says it is done: the
    worker is stopped from outside, by the end of its loop (``Stop``)."""
    if job.system == "meshbus":
        async with await _connect_meshbus(job, _RECEIVER[0]) as conn:
            svc = await conn.register(_RECEIVER[1])
            _ready(pipe)
            await _until_told(pipe, _serve(svc))
        return {}
    nc = await _connect_nats(job)
    try:

        async def answer(msg: NatsMsg) -> None:
            await msg.respond(msg.data)

        await nc.subscribe(_SUBJECT, cb=answer)
        await flushed(nc)
        _ready(pipe)
        await _until_told(pipe, asyncio.get_running_loop().create_future())
    finally:
        await nc.close()
    return {}


async def _serve(svc: meshbus.Service) -> None:
    async for msg in svc:
        await msg.reply(msg.payload)


async def _until_told(pipe: Connection, serving: Awaitable[None]) -> None:
    """Run ``serving`` until the parent sends anything on ``pipe``."""
    task = asyncio.ensure_future(serving)
    loop = asyncio.get_running_loop()
    told = asyncio.Event()
    loop.add_reader(pipe.fileno(), told.set)
    try:
        await told.wait()
    finally:
        loop.remove_reader(pipe.fileno())
        os.set_blocking(pipe.fileno(), True)  # the loop made it non-blocking; recv expects not
        task.cancel()
    pipe.recv()


async def _request(job: Job, pipe: Connection) -> dict[str, float]:
    payload = b"x" * job.size
    warmup = max(1, job.count // 10)
    latencies: list[float] = []
    ask: Callable[[], Awaitable[object]]
    if job.system == "meshbus":
        conn = await _connect_meshbus(job, "benchreq")
        svc = await conn.register()
        dst = meshbus.Unicast(*_RECEIVER)

        def ask() -> Awaitable[object]:
            return svc.request(dst, payload, timeout=30)

        close: Callable[[], Awaitable[None]] = conn.close
    else:
        nc = await _connect_nats(job)

        def ask() -> Awaitable[object]:
            return nc.request(_SUBJECT, payload, timeout=30)

        close = nc.close
    try:
        _ready(pipe)
        left = job.count + warmup
        started = 0.0

        async def requester() -> None:
            nonlocal left, started
            while left > 0:
                left -= 1
                sent = time.perf_counter()
                await ask()
                done = time.perf_counter()
                if left < job.count:
                    latencies.append(done - sent)
                elif not started:
                    started = done  # the warm-up ends with this response

        await asyncio.gather(*(requester() for _ in range(job.concurrency)))
        elapsed = time.perf_counter() - started
    finally:
        await close()
    return {
        "requests_per_s": len(latencies) / elapsed,
        "p50_us": statistics.median(latencies) * 1e6,
    }


_ROLES: dict[str, Callable[[Job, Connection], Awaitable[dict[str, float]]]] = {
    "receive": _receive,
    "send": _send,
    "respond": _respond,
    "request": _request,
}


# -- the parent: two workers, the scenarios -----------------------------------------------


class Workers:
    """Two worker processes: ``serving`` (receiver, responder) and ``driving`` (sender,
    requester)."""

    def __init__(self, serving: Connection, driving: Connection) -> None:
        self._serving = serving
        self._driving = driving

    def run(self, serve: Job, drive: Job, *, stop_serving: bool) -> dict[str, float]:
        """``serve`` started and ready, then ``drive``: the figures of whichever reports
        them (``stop_serving``: the serving side runs until told, after the driving side
        is done)."""
        self._serving.send(serve)
        _expect(self._serving, "ready")
        self._driving.send(drive)
        _expect(self._driving, "ready")
        driven = _expect(self._driving, "done")[1]
        if stop_serving:
            self._serving.send("stop")
        served = _expect(self._serving, "done")[1]
        return {**served, **driven}


def _expect(pipe: Connection, what: str) -> tuple[Any, ...]:
    if not pipe.poll(_SCENARIO_TIMEOUT + 10):
        raise BenchSetupError(f"a bench client worker did not say {what!r} in time")
    message: tuple[Any, ...] = pipe.recv()
    if message[0] == "error":
        raise BenchSetupError(f"a bench client worker failed:\n{message[1]}")
    if message[0] != what:
        raise BenchSetupError(f"a bench client worker said {message[0]!r}, not {what!r}")
    return message


@contextmanager
def workers() -> Iterator[Workers]:
    """Two spawned workers (a fresh interpreter each: no state of this process), stopped
    and joined on exit -- killed if they do not stop."""
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe() for _ in range(2)]
    processes = [
        context.Process(target=_worker, args=(child,), name=f"bench client {i}", daemon=True)
        for i, (_, child) in enumerate(pipes)
    ]
    for process in processes:
        process.start()
    try:
        yield Workers(pipes[0][0], pipes[1][0])
    finally:
        for parent, _ in pipes:
            try:
                parent.send(None)
            except OSError:
                pass
        for process in processes:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()


def _servers(vs_nats: bool) -> list[AbstractContextManager[Server]]:
    servers: list[AbstractContextManager[Server]] = [meshbus_broker()]
    if vs_nats:
        servers.append(nats_server())
    return servers


@click.command()
@click.option(
    "--count",
    type=click.IntRange(100),
    default=200_000,
    show_default=True,
    help="Messages per run of the one-way scenarios.",
)
@request_options(20_000)
@runs_options
def client(
    count: int, requests: int, size: int, concurrency: int, runs: int, vs_nats: bool
) -> None:
    """The Python API between two processes through one server, vs nats.py.

    Last line: `meshbus_msgs=<msgs/s> [nats_msgs=<msgs/s> ratio_msgs=<r>]
    meshbus_fast_msgs=<msgs/s> [nats_fast_msgs=<msgs/s> ratio_fast_msgs=<r>]
    meshbus_rps=<req/s> [nats_rps=<req/s> ratio_rps=<r>] meshbus_p50_us=<us>
    [nats_p50_us=<us> ratio_p50=<r>]`: the ratios are meshbus/nats (for p50 lower is better).
    """
    figures: dict[str, str] = {}
    with workers() as pool:

        def one_way(fast: bool) -> Callable[[Server], tuple[float, tuple[str, ...]]]:
            def measure(server: Server) -> tuple[float, tuple[str, ...]]:
                job = Job("receive", server.kind, server.host, server.port, count, size, fast=fast)
                done = pool.run(job, _as(job, "send"), stop_serving=False)
                return done["msgs_per_s"], (f"{done['msgs_per_s']:,.0f}",)

            return measure

        def requests_at(concurrency: int) -> Callable[[Server], tuple[float, tuple[str, ...]]]:
            def measure(server: Server) -> tuple[float, tuple[str, ...]]:
                job = Job("respond", server.kind, server.host, server.port, requests, size)
                done = pool.run(
                    job, _as(job, "request", concurrency=concurrency), stop_serving=True
                )
                rps, p50 = done["requests_per_s"], done["p50_us"]
                figure = rps if concurrency > 1 else p50
                return figure, (f"{rps:,.0f}", f"{p50:.0f}")

            return measure

        plain = alternate(
            _servers(vs_nats),
            runs,
            f"one way: {count:,} x {size} B, await send -> async for "
            "(nats.py: publish -> callback)",
            ("msgs/s",),
            one_way(fast=False),
        )
        ratio_figures(figures, "msgs", plain, 0)
        fast = alternate(
            _servers(vs_nats),
            runs,
            f"one way: {count:,} x {size} B, send_many -> inline listener "
            "(nats.py: publish -> callback)",
            ("msgs/s",),
            one_way(fast=True),
        )
        ratio_figures(figures, "fast_msgs", fast, 0)
        rps = alternate(
            _servers(vs_nats),
            runs,
            f"request/response: {requests:,} x {size} B, concurrency {concurrency}",
            ("req/s", "p50 µs"),
            requests_at(concurrency),
        )
        ratio_figures(figures, "rps", rps, 0)
        p50 = alternate(
            _servers(vs_nats),
            runs,
            f"request/response: {requests:,} x {size} B, concurrency 1",
            ("req/s", "p50 µs"),
            requests_at(1),
        )
        ratio_figures(figures, "p50_us", p50, 1)
    click.echo(key_values(**figures))


def _as(job: Job, role: str, *, concurrency: int = 1) -> Job:
    return Job(role, job.system, job.host, job.port, job.count, job.size, concurrency, job.fast)


def ratio_figures(into: dict[str, str], name: str, medians: dict[str, float], digits: int) -> None:
    """``meshbus_<name>`` and, when nats ran, ``nats_<name>`` and ``ratio_<name>``
    (``ratio_p50`` for the latency) into the last line."""
    into[f"meshbus_{name}"] = f"{medians['meshbus']:.{digits}f}"
    if "nats" in medians:
        into[f"nats_{name}"] = f"{medians['nats']:.{digits}f}"
        into[f"ratio_{name.removesuffix('_us')}"] = f"{medians['meshbus'] / medians['nats']:.3f}"
