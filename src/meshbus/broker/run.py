"""Running a broker as a process: its signals (SIGINT and SIGTERM drain, SIGHUP reloads
the users), the ready line scripts wait for, and the monitoring endpoint of
``--monitor`` (broker/observe/monitor.py). ``Broker`` (broker/server.py) is the broker itself."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from meshbus.broker.config import BrokerConfig
from meshbus.broker.mesh.membership import Mesh, MeshJoinError
from meshbus.broker.process import ready_line
from meshbus.broker.security.users import UserTable
from meshbus.broker.server import Broker
from meshbus.errors import InvalidArgument
from meshbus.storage.data_dir import DataDirLocked
from meshbus.storage.errors import StoreError

if TYPE_CHECKING:
    from meshbus.broker.observe.monitor import MonitorServer

__all__ = ["START_ERRORS", "serve"]

# What ``serve`` raises for a broker that cannot start, each with a message its operator can
# act on: no seed to join through, a --data-dir another broker holds, a damaged stream store or
# one of another version, a broker key that does not fit its name (meshbus.broker.security.trust).
START_ERRORS: tuple[type[Exception], ...] = (
    MeshJoinError,
    DataDirLocked,
    StoreError,
    InvalidArgument,
)

log = logging.getLogger("meshbus.broker")


async def serve(
    config: BrokerConfig,
    reread_users: Callable[[], UserTable] | None = None,
    *,
    announce: Callable[[str, str], None] | None = None,
) -> None:
    """Run a broker until SIGINT, SIGTERM or a DRAIN request; print the ready line once it
    takes connectors (or, given ``announce``, call it with the broker's address and its
    NATS listener's, '' without one: ``meshbus nats-server`` writes nats-server's lines).
    SIGTERM and DRAIN drain first (connectors move to other brokers); a second signal
    stops at once. SIGHUP reloads the users with ``reread_users`` (``SignIn.reload``)."""
    raise_open_files_limit(config)
    broker = Broker(config, reread_users=reread_users)
    # Before the join, so /healthz answers 503 "joining" while it lasts; and before the
    # freeze below, so the monitor's modules are frozen with the rest.
    monitor = await start_monitor(broker)
    try:
        await _run(broker, config, announce)
    finally:
        if monitor is not None:
            await monitor.stop()


# File descriptors a broker keeps besides its links: the listening sockets, the stream
# store's files, the monitor, the loop's own.
_SPARE_FILES = 64


def raise_open_files_limit(config: BrokerConfig) -> None:
    """Raise the soft limit on open files to the hard one, and say so: each link is a
    file descriptor, and the common soft default (1,024) is below ``--max-handshaking``
    alone. A warning when even the hard limit is below what the broker's bounds may
    hold open at once."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:  # an unlimited hard limit, say
            log.warning(
                "cannot raise the limit on open files",
                extra={"soft": soft, "hard": hard, "error": str(exc)},
            )
        else:
            log.info("open files limit raised to the hard limit", extra={"was": soft, "now": hard})
            soft = hard
    else:
        log.info("open files limit is the hard limit", extra={"now": soft})
    needed = config.max_handshaking + config.max_connectors + config.max_operators + _SPARE_FILES
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning(
            "the limit on open files is below what the broker's bounds may hold open; "
            "raise the hard limit (ulimit -Hn, LimitNOFILE=)",
            extra={"limit": soft, "bounds": needed},
        )


async def _run(
    broker: Broker, config: BrokerConfig, announce: Callable[[str, str], None] | None
) -> None:
    import signal
    import sys

    # What exists now -- the interpreter's modules, classes and functions, the broker's
    # parts -- lives as long as the process: out of the collector's sight (the permanent
    # generation), so each full collection walks only what the broker made since (on
    # bench bursts at 50,000 services the peers' worst lag went from 45-80 to 44-50 ms).
    gc.collect()
    gc.freeze()
    loop = asyncio.get_running_loop()
    # Handlers first: a script may signal the broker the moment it reads the ready line.
    stop_now = asyncio.Event()

    def on_signal() -> None:
        if broker.drain_requested.is_set():
            stop_now.set()
        broker.request_drain(None)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    loop.add_signal_handler(signal.SIGHUP, broker.sign_in.reload)
    starting = asyncio.create_task(broker.start())
    signalled = asyncio.create_task(broker.drain_requested.wait())
    try:
        await asyncio.wait({starting, signalled}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            # A signal while joining the mesh (up to --join-timeout): nothing to drain yet.
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            log.info("stopped while joining the mesh", extra={"broker": config.name})
            await broker.stop()
            return
        starting.result()
    except BaseException:
        await broker.stop()
        raise
    finally:
        signalled.cancel()
    # The one line scripts and tests wait for; it carries the real port when --listen used 0.
    if announce is not None:
        announce(broker.address, broker.nats.address if broker.nats is not None else "")
    else:
        nats_address = broker.nats.address if broker.nats is not None else ""
        sys.stdout.write(ready_line(config.name, broker.address, nats_address) + "\n")
        sys.stdout.flush()
    await broker.drain_requested.wait()
    log.info("draining", extra={"broker": config.name})
    drain = asyncio.create_task(broker.drain())
    interrupted = asyncio.create_task(stop_now.wait())
    await asyncio.wait({drain, interrupted}, return_when=asyncio.FIRST_COMPLETED)
    if drain.done() and not drain.cancelled() and (failed := drain.exception()) is not None:
        log.error("the drain failed; stopping", exc_info=failed)
    drain.cancel()
    interrupted.cancel()
    log.info("stopping", extra={"broker": config.name})
    await broker.stop()


def broker_state(mesh: Mesh) -> str:
    """What /healthz says: "ready" (200), else "draining" or "joining" (503)."""
    if mesh.draining:
        return "draining"
    return "ready" if mesh.ready else "joining"


async def start_monitor(broker: Broker) -> MonitorServer | None:
    """The HTTP endpoint of ``--monitor`` (broker/observe/monitor.py), listening; None without
    one. Built from the parts it reads: the stat view, the link registry's byte counts,
    the loop-lag probe, the stream store."""
    config = broker.config
    where = config.check_monitor()
    if where is None:
        return None
    # Only with --monitor: a broker without one does not load prometheus_client.
    from meshbus.broker.observe.monitor import (
        BrokerCollector,
        MonitorServer,
        StreamReading,
        monitor_registry,
    )

    streams = broker.streams

    def stream_readings() -> list[StreamReading]:
        readings = []
        for name in streams.names():
            info = streams.store.info(name)
            readings.append(StreamReading(name, info.messages, info.bytes))
        return readings

    collector = BrokerCollector(
        stat=broker.stat.brief,
        traffic_bytes=broker.links.traffic_bytes,
        lag=broker.lag,
        streams=stream_readings,
    )
    monitor = MonitorServer(
        registry=monitor_registry(collector),
        health=functools.partial(broker_state, broker.mesh),
        varz=broker.stat.brief,
        token=config.monitor_token_hash,
    )
    try:
        await monitor.start(*where)
    except OSError as exc:
        raise InvalidArgument(
            f"cannot serve --monitor on {config.monitor}: {exc.strerror or exc}; "
            "choose another HOST:PORT"
        ) from None
    log.info("monitor listening", extra={"broker": config.name, "address": monitor.address})
    return monitor
