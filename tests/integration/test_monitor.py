"""Monitoring over HTTP (``meshbus broker --monitor``) with real parts: broker processes
scraped by a real Prometheus server, queried through its HTTP API."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import meshbus
from meshbus.auth import TokenHash
from tests.conftest import BrokerProcess, start_broker, stop_all
from tests.integration.helpers import (
    RawLink,
    recv_n,
    start_broker_process,
    wait_routes,
    wait_until,
)

TOKEN = "monitor-test-token"
N = 250


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_get(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture
def prometheus_bin() -> str:
    found = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None
    )
    if found is None:
        pytest.skip("the prometheus binary is missing: `make prometheus` installs it (Debian)")
    return found


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict[str, object]]:
        """The instant vector of ``expr`` now: each {"metric": labels, "value": [t, "v"]}."""
        status, body = http_get(
            f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        )
        assert status == 200, body
        result: list[dict[str, object]] = json.loads(body)["data"]["result"]
        return result

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        if not result:
            return None
        assert len(result) == 1, result
        sample = result[0]["value"]
        assert isinstance(sample, list)
        return float(sample[1])

    async def scraped_after(self, job_instance: str, moment: float) -> None:
        """Until Prometheus has scraped ``job_instance`` at a time after ``moment``."""

        async def later() -> bool:
            seen = await asyncio.to_thread(
                self.value, f'timestamp(up{{instance="{job_instance}"}})'
            )
            return seen is not None and seen > moment

        await wait_until(later, f"a scrape of {job_instance} after {moment}", timeout=15)


@pytest.fixture
def prometheus_factory(
    prometheus_bin: str, tmp_path: Path
) -> Iterator[list[subprocess.Popen[bytes]]]:
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def spawn_prometheus(
    binary: str, tmp_path: Path, targets: list[str], processes: list[subprocess.Popen[bytes]]
) -> Prometheus:
    """Prometheus scraping ``targets`` every second with the test's bearer token, its data
    in ``tmp_path``; not yet ready."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: meshbus\n"
        f"    authorization:\n      type: Bearer\n      credentials_file: {token_file}\n"
        f"    static_configs:\n      - targets: {json.dumps(targets)}\n"
    )
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 -- the child writes it
    processes.append(
        subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=log,
        )
    )
    log.close()
    return Prometheus(f"http://127.0.0.1:{port}")


async def start_prometheus(
    binary: str, tmp_path: Path, targets: list[str], processes: list[subprocess.Popen[bytes]]
) -> Prometheus:
    prometheus = await asyncio.to_thread(spawn_prometheus, binary, tmp_path, targets, processes)

    async def ready() -> bool:
        try:
            status, _ = await asyncio.to_thread(http_get, f"{prometheus.url}/-/ready")
        except OSError:
            return False
        return status == 200

    await wait_until(ready, "prometheus ready", timeout=30)
    return prometheus


@pytest.fixture
async def monitored_mesh3() -> AsyncIterator[tuple[list[BrokerProcess], list[str]]]:
    """Three brokers in one mesh, each with --monitor and the test's token."""
    token_hash = str(TokenHash.of(TOKEN))
    monitors = [f"127.0.0.1:{free_port()}" for _ in range(3)]

    def args(i: int) -> list[str]:
        return ["--monitor", monitors[i], "--monitor-token-hash", token_hash]

    first = await start_broker(*args(0))
    rest = await asyncio.gather(*(start_broker("--seed", first.address, *args(i)) for i in (1, 2)))
    brokers = [first, *rest]
    try:
        yield brokers, monitors
    finally:
        codes = await stop_all(brokers)
        assert all(code in (0, -9) for code in codes), f"broker exit codes {codes}"


async def test_prometheus_counts_exactly_the_messages_sent_and_sees_a_killed_broker_down(
    monitored_mesh3: tuple[list[BrokerProcess], list[str]],
    prometheus_bin: str,
    prometheus_factory: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    brokers, monitors = monitored_mesh3
    prometheus = await start_prometheus(prometheus_bin, tmp_path, monitors, prometheus_factory)

    async def all_up() -> bool:
        result = await asyncio.to_thread(prometheus.query, 'up{job="meshbus"} == 1')
        return len(result) == 3

    await wait_until(all_up, "prometheus scraping all three brokers", timeout=20)

    async with (
        await meshbus.connect(brokers[0].address, server="tx", failover=False) as tx_conn,
        await meshbus.connect(brokers[1].address, server="rx", failover=False) as rx_conn,
    ):
        sender = await tx_conn.register()
        receiver = await rx_conn.register()
        await wait_routes(brokers, receiver.address)
        # The counters as scraped after the setup, before the first message.
        start = time.time()
        for monitor in monitors[:2]:
            await prometheus.scraped_after(monitor, start)
        sender_in = f'meshbus_messages_in_total{{broker="{brokers[0].name}"}}'
        receiver_in = f'meshbus_messages_in_total{{broker="{brokers[1].name}"}}'
        # The same messages on the two connectors' own links.
        tx_link = (
            f'meshbus_link_messages_in_total{{broker="{brokers[0].name}",kind="connector",'
            'name="tx"}'
        )
        rx_link = (
            f'meshbus_link_messages_out_total{{broker="{brokers[1].name}",kind="connector",'
            'name="rx"}'
        )
        queries = (sender_in, receiver_in, tx_link, rx_link)
        before = [await asyncio.to_thread(prometheus.value, q) for q in queries]
        for i in range(N):
            await sender.send(receiver.address, b"%d" % i)
        assert len(await recv_n(receiver, N)) == N
        sent = time.time()
        for monitor in monitors[:2]:
            await prometheus.scraped_after(monitor, sent)
        after = [await asyncio.to_thread(prometheus.value, q) for q in queries]
    # In from the sender's connector on broker 0, and in from the peer link on broker 1;
    # in on the sender's link, out on the receiver's.
    assert None not in before
    assert None not in after
    moved = [a - b for a, b in zip(after, before, strict=True)]  # type: ignore[operator]
    assert moved == [N, N, N, N]
    # Every heartbeat times the round trip to each peer: on loopback, well under a second.
    rtt = f'meshbus_peer_rtt_seconds{{broker="{brokers[0].name}",peer="{brokers[1].name}"}}'
    seconds = await asyncio.to_thread(prometheus.value, rtt)
    assert seconds is not None
    assert 0 < seconds < 1, seconds

    brokers[2].process.send_signal(signal.SIGKILL)
    await brokers[2].process.wait()

    async def down() -> bool:
        value = await asyncio.to_thread(prometheus.value, f'up{{instance="{monitors[2]}"}}')
        return value == 0

    await wait_until(down, f"up == 0 for the killed broker at {monitors[2]}", timeout=15)
    for monitor in monitors[:2]:
        assert prometheus.value(f'up{{instance="{monitor}"}}') == 1


async def test_healthz_is_503_draining_while_a_broker_drains() -> None:
    monitor = f"127.0.0.1:{free_port()}"
    other = await start_broker()
    broker = await start_broker("--seed", other.address, "--monitor", monitor, "--drain-grace", "4")
    url = f"http://{monitor}/healthz"
    try:
        assert await asyncio.to_thread(http_get, url) == (200, b"ok\n")
        # A connector that ignores MOVE: the drain lasts its grace period.
        stays = await RawLink.open(broker.address)
        await stays.hello("stays")
        broker.process.send_signal(signal.SIGTERM)

        async def draining() -> bool:
            return await asyncio.to_thread(http_get, url) == (503, b"draining\n")

        await wait_until(draining, "/healthz 503 draining", timeout=3)
        # /metrics says so too (no token: a loopback monitor needs none).
        status, body = await asyncio.to_thread(http_get, f"http://{monitor}/metrics")
        assert status == 200
        assert f'meshbus_draining{{broker="{broker.name}"}} 1.0'.encode() in body
        await stays.close()
    finally:
        assert await stop_all([broker, other]) == [0, 0]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ("--monitor", "0.0.0.0:0"),
            "Error: refusing to serve --monitor on 0.0.0.0:0 without a token",
        ),
        (
            ("--monitor", "127.0.0.1:0", "--monitor-token-hash", "nope"),
            "Error: Invalid value for '--monitor-token-hash': a token hash is written",
        ),
        (("--monitor", "nohost"), "Error: Invalid value for '--monitor': 'nohost' is not"),
    ],
    ids=["beyond-loopback-without-token", "bad-token-hash", "bad-address"],
)
async def test_a_monitor_it_cannot_serve_safely_is_refused_in_one_line(
    args: tuple[str, ...], says: str
) -> None:
    process = await start_broker_process("--listen", "127.0.0.1:0", *args)
    out, err = await asyncio.wait_for(process.communicate(), 20)
    stderr = err.decode()
    assert process.returncode in (1, 2), stderr
    assert out == b""
    # A bad flag value comes after click's usage lines; the error itself is one line.
    error = stderr.splitlines()[-1]
    assert error.startswith(says), stderr
    assert error.count("Error:") == stderr.count("Error:") == 1, stderr


async def test_a_monitor_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = await start_broker_process("--monitor", f"127.0.0.1:{port}")
        _, err = await asyncio.wait_for(process.communicate(), 20)
    stderr = err.decode()
    assert process.returncode == 1, stderr
    assert stderr.startswith(f"Error: cannot serve --monitor on 127.0.0.1:{port}: "), stderr
    assert stderr.count("\n") == 1, stderr


async def test_the_config_file_keys_turn_the_monitor_on_with_its_token(tmp_path: Path) -> None:
    monitor = f"127.0.0.1:{free_port()}"
    config = tmp_path / "broker.toml"
    config.write_text(f'monitor = "{monitor}"\nmonitor-token-hash = "{TokenHash.of(TOKEN)}"\n')
    broker = await start_broker("--config", str(config))
    try:
        metrics = f"http://{monitor}/metrics"
        assert (await asyncio.to_thread(http_get, metrics))[0] == 401
        status, body = await asyncio.to_thread(http_get, metrics, TOKEN)
        assert status == 200
        assert f'meshbus_ready{{broker="{broker.name}"}} 1.0'.encode() in body
        status, body = await asyncio.to_thread(http_get, f"http://{monitor}/varz", TOKEN)
        assert status == 200
        assert json.loads(body)["name"] == broker.name
    finally:
        assert await broker.stop() == 0
