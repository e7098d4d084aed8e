"""The data source on a Spark standalone cluster: a master and two workers on loopback,
started from the scripts pyspark ships, executors in JVMs of their own -- against a
real broker. ``register()``'s check asks the real workers, and a streaming read and
write keep exactly-once across a restart as in local mode (test_read.py,
test_write.py). The applications' driver is tests/spark/cluster_app.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import venv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyspark
import pytest

import meshbus
from tests.conftest import QUICK_JVM, BrokerProcess
from tests.spark.conftest import publish

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.xdist_group("jvm")]

SPARK_HOME = Path(pyspark.__file__).parent
SPARK_CLASS = SPARK_HOME / "bin" / "spark-class"
# pyspark's own SPARK_HOME, not the tests' (conftest.py), whose Python workers import
# pyspark from this venv: the workers here run a Python without it, from the zip.
WITH_ITS_ZIP = {"SPARK_HOME": str(SPARK_HOME)}
CHECKOUT = Path(__file__).parents[2]
LOOPBACK = ("--host", "127.0.0.1", "--port", "0", "--webui-port", "0")  # ports: any free one


class Daemon:
    """A master or worker JVM, its output in a log file."""

    def __init__(self, log: Path, env: dict[str, str], *args: str) -> None:
        self.log = log
        with log.open("wb") as out:
            # spark-class execs the JVM: this pid is the daemon's own.
            self.process = subprocess.Popen(
                [str(SPARK_CLASS), *args], stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def wait_for(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while (found := re.search(pattern, self.log.read_text())) is None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} in {self.log}:\n{self.log.read_text()}")
            time.sleep(0.1)
        return found

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass(frozen=True)
class Cluster:
    master: str  # spark://127.0.0.1:PORT
    work_dirs: list[Path]  # the workers': executors run in WORK_DIR/APP_ID/EXECUTOR_ID
    daemons: list[Daemon]  # the master, then the workers

    def logs(self) -> str:
        return "\n".join(f"{d.log}:\n{d.log.read_text()[-3000:]}" for d in self.daemons)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A master and two workers (one core, 512 MiB each) on 127.0.0.1, every port
    ephemeral, every directory temporary. The workers may still be registering with
    the master when this yields: an application's executors start as they do, and
    JVMs are slow to start, so the application's driver starts meanwhile."""
    base = tmp_path_factory.mktemp("cluster")
    env = {
        **os.environ,
        **WITH_ITS_ZIP,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOCAL_DIRS": str(base),
        "SPARK_DAEMON_MEMORY": "256m",
        "SPARK_DAEMON_JAVA_OPTS": QUICK_JVM,
        # Off: the master's REST submission server, on a fixed port (6066).
        "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
    }
    # Executors inherit the workers' environment: without this, a PYTHONPATH that
    # points at a checkout would let any Python import meshbus, and the refusal in
    # cluster_app.py could not happen. Each application says what its executors import.
    env.pop("PYTHONPATH", None)
    daemons: list[Daemon] = []
    try:
        master = Daemon(
            base / "master.log", env, "org.apache.spark.deploy.master.Master", *LOOPBACK
        )
        daemons.append(master)
        url = master.wait_for(r"Starting Spark master at (spark://127\.0\.0\.1:\d+)").group(1)
        work_dirs = [base / "worker1", base / "worker2"]
        for work_dir in work_dirs:
            resources = ("--cores", "1", "--memory", "512m", "--work-dir", str(work_dir))
            worker = Daemon(
                work_dir.with_suffix(".log"),
                env,
                "org.apache.spark.deploy.worker.Worker",
                *LOOPBACK,
                *resources,
                url,
            )
            daemons.append(worker)
        yield Cluster(url, work_dirs, daemons)
    finally:
        for daemon in reversed(daemons):
            daemon.stop()


@pytest.mark.timeout(300)
async def test_register_refuses_workers_without_meshbus_and_a_restart_is_exactly_once(
    cluster: Cluster, broker: BrokerProcess, tmp_path: Path
) -> None:
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)  # a Python without meshbus (or pyspark)
    bare_python = str(bare / "bin" / "python")
    await publish(broker.address, "ledger", [b"x%d" % i for i in range(1, 121)])
    result = tmp_path / "result.json"
    async with await meshbus.connect(broker.address, server="board") as conn:
        board = await conn.register()
        await board.join("multicast:board")
        got: list[meshbus.Message] = []
        board.add_listener(got.append)

        log = tmp_path / "driver.log"
        with log.open("wb") as out:
            driver = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.spark.cluster_app",
                cluster.master, broker.address, str(tmp_path), bare_python, QUICK_JVM, str(result),
                cwd=CHECKOUT, env={**os.environ, **WITH_ITS_ZIP},
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
            try:
                # Five JVMs: about a minute on two idle cores, more beside a test suite's others.
                code = await asyncio.wait_for(driver.wait(), 200)
            finally:
                if driver.returncode is None:  # its JVM ends with it (stdin closed)
                    driver.kill()
                    await driver.wait()
        assert code == 0, f"{log.read_text()[-5000:]}\n{cluster.logs()}"
        outcome = json.loads(result.read_text())

        # The refusal names what Python the workers ran, what to set, and to what.
        refused = outcome["refused"]
        message = "cannot import meshbus.spark (ModuleNotFoundError: No module named 'meshbus')"
        assert message in refused
        assert f"they run {bare_python}." in refused
        assert (
            f"set PYSPARK_PYTHON to a Python {sys.version_info.major}.{sys.version_info.minor}"
            in refused
        )
        assert f"such as this driver's {sys.executable}" in refused
        assert f"spark.pyspark.python, {sys.executable}, is not used" in refused

        # Two executors, neither of them the driver; tasks ran in their directories.
        assert outcome["executors"] == ["0", "1"], cluster.logs()
        homes = {str(d / outcome["app"] / e) for d in cluster.work_dirs for e in ("0", "1")}
        assert set(outcome["task_dirs"]) <= homes, outcome["task_dirs"]

        # The restart ran the uncommitted batch again, with the rows it had before.
        first, second = outcome["first"], outcome["second"]
        assert second[0][0] == outcome["replayed"]
        rows = dict(map(tuple, first))
        for batch, count in second:
            assert rows.setdefault(batch, count) == count, f"batch {batch} changed"
        assert sum(rows.values()) == 130  # each message read in exactly one batch
        # Every row reached the board once: a replayed batch's rows carry the same publish
        # ids, and the receiver drops the copies. The driver ended after the last commit,
        # and a write task ends once its rows are acknowledged: everything is here.
        assert sorted(m.payload for m in got) == sorted(b"seen x%d" % i for i in range(1, 131))
