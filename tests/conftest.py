"""Shared fixtures: real broker processes on loopback, started on port 0."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib.util
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings

from meshbus.broker.process import spawn_broker
from tests import forkserver

# No time limit per example: the suite runs on 2 busy cores, where an example of a
# property test took over hypothesis's default 200 ms and failed a correct decoder.
# How fast the codec is is the benchmarks' to say, never a unit test's.
settings.register_profile("meshbus", deadline=None)
settings.load_profile("meshbus")

# The tests' JVMs (Spark's driver and executors, a standalone cluster's daemons, the
# demo's and the Spark bench's) live for seconds to minutes and move little data: C1's
# code and the serial collector are enough for them, at about a third less CPU than the
# defaults (the Spark and report tests' JVM: 112 CPU-s against 165 on a 2-core machine).
# Every JVM the tests start, themselves or through a child, takes them from the java
# launcher's own variable (it then prints a "NOTE: Picked up" line); one already set wins.
QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
os.environ.setdefault("JDK_JAVA_OPTIONS", QUICK_JVM)


def spark_home_without_its_zip(pyspark_dir: Path, into: Path) -> Path:
    """A SPARK_HOME that is pyspark's own, linked entry by entry, but for
    python/lib/pyspark.zip.

    Spark puts that zip first on its Python workers' path, and a zip keeps no bytecode:
    every worker it starts (a daemon per job's executor, a streaming source's runner)
    compiled pyspark again, 1.0-1.3 s of CPU against 0.2-0.3 s importing the installed
    package, whose bytecode is kept. Without the zip, the workers -- this venv's
    Python -- import the same pyspark from site-packages."""
    (into / "python" / "lib").mkdir(parents=True)
    for folder, kept_apart in (("", "python"), ("python", "lib"), ("python/lib", "pyspark.zip")):
        for entry in (pyspark_dir / folder).iterdir():
            if entry.name != kept_apart:
                (into / folder / entry.name).symlink_to(entry)
    return into


_pyspark = importlib.util.find_spec("pyspark")
if "SPARK_HOME" not in os.environ and _pyspark is not None and _pyspark.origin is not None:
    _home = Path(tempfile.mkdtemp(prefix="meshbus-tests-spark-home-"))
    atexit.register(shutil.rmtree, _home, ignore_errors=True)
    os.environ["SPARK_HOME"] = str(spark_home_without_its_zip(Path(_pyspark.origin).parent, _home))


@dataclass
class BrokerProcess:
    process: asyncio.subprocess.Process
    name: str
    address: str
    nats_address: str = ""  # with --nats-listen

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    async def stop(self) -> int:
        # os.kill, not Process.send_signal: on Python 3.11 that polls the child first
        # (waitpid), and a poll that reaps a broker which has just exited takes it from
        # asyncio's child watcher, whose wait then reports 255 ("Unknown child process").
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGTERM)
        return await asyncio.wait_for(self.process.wait(), 10)


async def start_broker(*args: str) -> BrokerProcess:
    """Start `meshbus broker --listen 127.0.0.1:0 ARGS` and wait for its ready line.
    (Forked from the worker's fork server: tests/forkserver.py.)"""
    process, name, address, nats_address = await spawn_broker(*args, launch=forkserver.launch)
    return BrokerProcess(process, name, address, nats_address)


async def start_mesh(count: int, *args: str) -> list[BrokerProcess]:
    """``count`` brokers in one mesh: the first founds it, the others join through it
    (concurrently). Each has joined -- linked to all, tables copied -- when this returns."""
    first = await start_broker(*args)
    rest = await asyncio.gather(
        *(start_broker("--seed", first.address, *args) for _ in range(count - 1))
    )
    return [first, *rest]


async def stop_all(brokers: list[BrokerProcess]) -> list[int]:
    """SIGTERM every broker still running (they drain, then exit); their exit codes."""
    return list(await asyncio.gather(*(b.stop() for b in brokers)))


@pytest.fixture
async def mesh2() -> AsyncIterator[list[BrokerProcess]]:
    """Two brokers in one mesh, streams in memory; both must drain and exit 0."""
    brokers = await start_mesh(2)
    try:
        yield brokers
    finally:
        assert await stop_all(brokers) == [0, 0]


@pytest.fixture
async def mesh3() -> AsyncIterator[list[BrokerProcess]]:
    """Three brokers in one mesh."""
    brokers = await start_mesh(3)
    try:
        yield brokers
    finally:
        codes = await stop_all(brokers)
        assert all(code in (0, -9) for code in codes), f"broker exit codes {codes}"


@pytest.fixture
async def broker() -> AsyncIterator[BrokerProcess]:
    proc = await start_broker()
    try:
        yield proc
    finally:
        code = await proc.stop()
        assert code == 0, f"broker exited with {code} on SIGTERM"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Under pytest-xdist (make test runs a worker per core), every test that uses the
    # session's SparkSession runs on one worker: one JVM of it, started once, as in a
    # serial run. Of the tests that run Spark in processes of their own, the Spark bench
    # and the standalone cluster share a worker too (group "jvm", marked in their
    # modules): with three workers on two cores, they and the demo all started at once
    # and the cluster's driver ran past its 90 s. The demo goes wherever there is room.
    # (tryfirst: before xdist's worker reads the marks in its own
    # pytest_collection_modifyitems.)
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("spark"))
    # And under xdist, the slow tests outside that group (the demo, the Spark bench and
    # cluster, the fault and memory tests: 10-65 s each) are handed out first, while one
    # worker runs the Spark group, and the quick ones fill in behind them: in file order
    # the bench and the cluster test came last, one after the other on one worker, while
    # the other had run out of tests (~70 s of the run's wall time). The same order in
    # every worker, as xdist requires; a run without xdist keeps the file order.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: not _slow_outside_the_spark_group(item))


def _slow_outside_the_spark_group(item: pytest.Item) -> bool:
    group = item.get_closest_marker("xdist_group")
    return item.get_closest_marker("slow") is not None and (
        group is None or group.args[:1] != ("spark",)
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """``--dist loadgroup`` groups tests by an ``@GROUP`` suffix that xdist's worker adds
    to each marked test's node id by assigning ``item._nodeid``; since pytest 9.2 the
    node id is ``item._id`` and that assignment does nothing (pytest-xdist issue 1386),
    so no test was grouped: the Spark tests were spread over both workers, each starting
    a JVM and building a module's DataFrames again every time it came back to the
    module. Until xdist does it again, the suffix is added here, before the worker sends
    its collection (xdist's pytest_collection_finish) to the scheduler."""
    if not getattr(session.config.option, "loadgroup", False):  # set in xdist's workers
        return
    for item in session.items:
        groups = sorted(
            {
                str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                for mark in item.iter_markers("xdist_group")
            }
        )
        suffix = "@" + "_".join(groups)
        if not groups or item.nodeid.endswith(suffix):
            continue
        node_id = getattr(item, "_id", None)
        parse = getattr(node_id, "parse", None)
        if parse is None:  # not pytest's structured node id: leave it to xdist
            continue
        item._id = parse(item.nodeid + suffix)  # type: ignore[attr-defined]
