"""``make demo``: the whole product in one command (docs in the package docstring)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from collections import Counter
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

import meshbus
from meshbus.cli.common import Access
from meshbus.demo import leaderboard, mmo, secure
from meshbus.demo.mesh import DemoMesh, StepFailed, check

# Into the play: kill -9 of mesh-2 at this share of it, mesh-4 joins at that one.
KILL_AT = 0.25
JOIN_AT = 0.5
SETTLE_TIMEOUT = 60.0
WARM_UP = 10.0  # seconds after the first leaderboard update

console = Console(highlight=False)


def say(started: float, text: str) -> None:
    console.print(f"[dim]{time.monotonic() - started:6.1f}s[/] {text}")


async def run(play_seconds: float, report_path: str) -> int:
    started = time.monotonic()
    root = tempfile.mkdtemp(prefix="meshbus-demo-")
    security = secure.prepare(root, [f"mesh-{n}" for n in range(1, 5)])
    mesh = DemoMesh(root, security)
    mmo_access, spark_access = security.access("mmo"), security.access("spark")
    loop = asyncio.get_running_loop()
    console.rule("[bold]meshbus demo[/]: an MMO back end, a Spark pipeline, a crash and a join")
    spark_ready = loop.run_in_executor(None, leaderboard.start_session, root)
    spark: Any = None
    query: Any = None
    failed = ""
    world: mmo.World | None = None
    admin: meshbus.Connector | None = None
    try:
        m1 = await mesh.start("mesh-1")
        m2, m3 = await asyncio.gather(mesh.start("mesh-2", m1), mesh.start("mesh-3", m1))
        say(started, escape(f"3 brokers: {mesh.addresses}, telemetry every 1 s"))
        say(started, escape(f"work dir {root}"))
        await refused_without_credentials(m1.address, security)
        say(started, f"TLS and sign-in on: every link TLS (a throwaway CA for {secure.HOST}), "
            f"clients sign in as users {' and '.join(secure.USERS)} (key pairs; one without "
            "was refused), brokers prove themselves with keys of their own")  # fmt: skip
        admin = await mmo_access.connect(m1.address, server="admin", failover=False)
        await admin.streams.add(mmo.RESULTS_STREAM, mmo.RESULTS)
        captured = escape(str(mmo.RESULTS))
        say(started, f"durable stream [bold]results[/] on mesh-1 captures {captured}")
        homes = {
            "login01": m1.address, "login02": m2.address, "game01": m1.address,
            "game02": m3.address, "master": m2.address, "matches": m3.address,
            "lobby": m1.address,
        }  # fmt: skip
        world = await mmo.build(mesh.addresses, homes, mmo_access)
        say(started, escape("MMO back end up: " + ", ".join(
            f"{name} on {conn.broker_name}" for name, conn in world.connectors.items()
        )))  # fmt: skip
        await mmo.log_in_everyone(world)
        await mmo.place_in_zones(world)
        say(started, f"{mmo.PLAYERS} players logged in (anycast requests), placed in zones")
        with console.status("starting Spark (local[2])..."):
            spark = await spark_ready
        query = await asyncio.to_thread(
            leaderboard.start_leaderboard, spark, mesh.addresses,
            spark_access.data_source_options(), mmo.RESULTS_STREAM,
            str(mmo.LEADERBOARD), os.path.join(root, "checkpoint"),
        )  # fmt: skip
        board = escape(str(mmo.LEADERBOARD))
        say(started, f"Spark job: stream results -> wins per player -> {board}")
        failover = await play(world, mesh, started, play_seconds)
        await settle(world, started)
        await stop_between_batches(query)
        query = None
        await summary(world, admin, failover)
        with console.status("writing the telemetry report (a Spark job over the brokers' streams)"):
            await write_report(spark, mesh.addresses, spark_access, report_path)
        say(started, f"wrote [bold]{escape(str(report_path))}[/] (open it in a browser)")
    except* (StepFailed, meshbus.MeshbusError, AssertionError) as group:
        failed = "; ".join(map(str, group.exceptions))
    finally:
        if world is not None:
            await world.close()
        if admin is not None:
            await admin.close()
        if query is not None:
            await asyncio.to_thread(query.stop)
        if spark is not None or not spark_ready.done():
            spark = spark or await spark_ready
            await asyncio.to_thread(spark.stop)
        codes = await mesh.stop()
        mesh.kill_all()
        shutil.rmtree(root, ignore_errors=True)
    stopped = ", ".join(_exit(name, code) for name, code in sorted(codes.items()))
    say(started, escape(f"brokers stopped: {stopped}"))
    if failed:
        console.print(f"[bold red]demo FAILED[/]: {escape(failed)}")
        return 1
    console.print(f"[bold green]demo passed[/] in {time.monotonic() - started:.1f} s")
    return 0


def _exit(name: str, code: int) -> str:
    """How a broker ended, in words: ``mesh-1 exit 0``, ``mesh-2 killed (signal 9)``."""
    return f"{name} killed (signal {-code})" if code < 0 else f"{name} exit {code}"


async def refused_without_credentials(address: str, security: secure.DemoSecurity) -> None:
    """The mesh is really closed: a TLS connector without credentials is refused."""
    try:
        conn = await meshbus.connect(
            address, server="nobody", tls=security.certificates.ca, failover=False
        )
    except meshbus.AuthenticationFailed:
        return
    await conn.close()
    raise StepFailed(f"broker {address} let in a connector without credentials")


async def play(world: mmo.World, mesh: DemoMesh, started: float, seconds: float) -> float:
    """Play, killing mesh-2 and adding mesh-4 on the way; returns the failover time."""
    events: dict[str, asyncio.Task[Any]] = {}

    def on_tick(elapsed: float) -> None:
        if elapsed >= KILL_AT * seconds and "kill" not in events:
            mesh.kill("mesh-2")
            say(started, "[bold red]kill -9 mesh-2[/] (login02 and master were on it)")
            events["kill"] = asyncio.create_task(failed_over(world, time.monotonic()))
        if elapsed >= JOIN_AT * seconds and "join" not in events:
            say(started, "starting [bold]mesh-4[/]: it joins and takes connectors")
            events["join"] = asyncio.create_task(mesh.start("mesh-4", mesh.brokers["mesh-1"]))

    with console.status("playing") as status:

        def ticking(elapsed: float) -> None:
            on_tick(elapsed)
            status.update(
                f"playing {elapsed:4.1f}/{seconds:.0f} s: {sum(world.sent.values()):,} sent, "
                f"{len(world.results_sent)} matches, leaderboard updates {world.boards[0].updates}"
            )

        await mmo.traffic(world, seconds, ticking)
    failover = await events["kill"]
    await events["join"]
    on_mesh4 = [n for n, c in world.connectors.items() if c.broker_name == "mesh-4"]
    say(started, escape(f"mesh-4 took {', '.join(on_mesh4) or 'no connector yet'}"))
    return float(failover)


async def stop_between_batches(query: Any) -> None:
    """Stop the query while no micro-batch runs: a stop in the middle of one
    interrupts its foreachBatch call, and py4j prints that as an error."""
    for _ in range(500):  # at most 10 s: a batch takes well under one
        if not query.status["isTriggerActive"]:
            break
        await asyncio.sleep(0.02)
    await asyncio.to_thread(query.stop)


async def failed_over(world: mmo.World, killed_at: float) -> float:
    """Seconds from the kill until the moved connectors answer again (login02's pool
    service through the mesh, and the master's connector on another broker)."""
    login02 = world.logins[1]
    asker = world.players[mmo.player_name(0)]
    while True:
        moved = all(world.connectors[n].broker_name != "mesh-2" for n in ("login02", "master"))
        if moved:
            try:
                await asker.request(login02.address, b"probe", timeout=0.5)
                break
            except meshbus.MeshbusError:
                pass
        await asyncio.sleep(0.02)
    took = time.monotonic() - killed_at
    console.print(f"        failover done in [bold]{took * 1000:.0f} ms[/]")
    return took


async def settle(world: mmo.World, started: float) -> None:
    """Every reliable send acknowledged, and the leaderboard caught up with the truth."""
    await world.connectors["matches"].wait_acked(SETTLE_TIMEOUT)
    truth = dict(world.true_wins)
    deadline = time.monotonic() + SETTLE_TIMEOUT
    with console.status("waiting for the last leaderboard updates"):
        while any(board.wins != truth for board in world.boards):
            check(time.monotonic() < deadline, "the leaderboard did not catch up within 60 s")
            await asyncio.sleep(0.2)
    say(started, "every reliable send acknowledged; the leaderboard matches every result")


async def write_report(spark: Any, brokers: str, access: Access, path: str) -> None:
    """``meshbus report`` on the demo's own Spark session. The killed broker's
    telemetry went with it (streams are not replicated): the report lists it as
    unreachable, with what the others saw of it."""
    from meshbus.report.job import discover, report_data
    from meshbus.report.plots import plots
    from meshbus.report.render import render_html

    found = await discover(brokers, None, access)

    def render() -> None:
        spark._jvm.org.apache.spark.sql.SparkSession.setActiveSession(spark._jsparkSession)
        data = report_data(spark, brokers, found, access=access.data_source_options())
        with open(path, "w", encoding="utf-8") as file:
            file.write(render_html(data, plots(data)))

    await asyncio.to_thread(render)


async def summary(world: mmo.World, admin: meshbus.Connector, failover: float) -> None:
    stored: list[dict[str, Any]] = []
    while page := await admin.streams.fetch(mmo.RESULTS_STREAM, len(stored) + 1, 1000):
        stored += [json.loads(m.payload) for m in page]
    sent = set(world.results_sent)
    stored_ids = Counter(r["match"] for r in stored)
    results_lost = len(sent - set(stored_ids))
    results_dup = sum(n - 1 for n in stored_ids.values())
    rewards_lost = len(sent - set(world.rewards))
    rewards_dup = sum(n - 1 for n in world.rewards.values())

    table = Table(title="summary")
    table.add_column("what")
    table.add_column("figure", justify="right")
    for cast, count in sorted(world.sent.items()):
        table.add_row(escape(f"sent: {cast}"), f"{count:,}")
    for kind, count in sorted(world.received.items()):
        table.add_row(escape(f"received: {kind}"), f"{count:,}")
    table.add_row("reliable match results: lost / duplicated", f"{results_lost} / {results_dup}")
    table.add_row("reliable rewards: lost / duplicated", f"{rewards_lost} / {rewards_dup}")
    table.add_row("failover (kill -9 to answering again)", f"{failover * 1000:.0f} ms")
    # The first updates wait for Spark's first micro-batches (its Python workers and
    # state store start): shown apart from the steady state.
    latencies = world.boards[0].latencies
    steady = [took for at, took in latencies if at > latencies[0][0] + WARM_UP] if latencies else []
    for label, sample in (
        ("all", [took for _, took in latencies]),
        (f"after {WARM_UP:g} s", steady),
    ):
        if len(sample) >= 2:
            q = statistics.quantiles(sample, n=100)
            table.add_row(
                f"result -> leaderboard p50 / p99, {label} (trigger {leaderboard.TRIGGER})",
                f"{q[49] * 1000:.0f} / {q[98] * 1000:.0f} ms",
            )
    top = world.boards[0].top()
    table.add_row("leaderboard top 5", escape(", ".join(f"{p} {w}" for p, w in top)))
    console.print(table)
    check(results_lost == results_dup == rewards_lost == rewards_dup == 0,
          "reliable traffic was lost or duplicated")  # fmt: skip
    truth_top = sorted(world.true_wins.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
    check(top == truth_top, f"leaderboard top 5 {top} is not {truth_top}")
