"""--monitor of `bench unicast`: a broker with `--monitor`, scraped every second the
way Prometheus does (docs/operations.md), beside one without -- what collecting the
metrics costs the data path.

The scraper is a process of its own, so its work shares the machine's cores as a real
Prometheus would but not the bench's interpreter (a thread in the bench would take the
producer's and consumer's GIL). It also times each scrape's answer: an upper bound on
how long building `/metrics` keeps the broker's loop.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import click

from bench.servers import BenchSetupError, Server, free_port, meshbus_broker

MONITOR_KIND = "meshbus_monitor"  # the broker with --monitor, beside one without
MONITOR_CHOICES = ("off", "on", "both")
SCRAPE_INTERVAL = 1.0

F = TypeVar("F", bound=Callable[..., Any])

# GET URL at once and every SCRAPE_INTERVAL until stdin closes; then print {"scrapes", "failed",
# "ms"} (each answer's time) as one JSON line.
_SCRAPER = """
import json, sys, threading, time, urllib.request
url, interval = sys.argv[1], float(sys.argv[2])
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
times, failed = [], 0
while True:
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            answer.read()
        times.append((time.perf_counter() - start) * 1000)
    except OSError:
        failed += 1
    if done.wait(interval):
        break
print(json.dumps({"scrapes": len(times), "failed": failed, "ms": times}))
"""


def monitor_option(command: F) -> F:
    """--monitor and --scrape-interval."""
    command = click.option(
        "--scrape-interval",
        type=click.FloatRange(0.01),
        default=SCRAPE_INTERVAL,
        show_default=True,
        help="Seconds between two scrapes of --monitor's /metrics (a run should last "
        "longer, or no scrape falls inside it: about 2 s at --count 10000000).",
    )(command)
    return click.option(
        "--monitor",
        type=click.Choice(MONITOR_CHOICES),
        default="off",
        show_default=True,
        help="The meshbus broker with --monitor, its /metrics fetched every second by a "
        "scraper process: off, on, or both (brokers without and with alternating; the last "
        "line adds meshbus_monitor and monitor_ratio = with / without).",
    )(command)


@contextlib.contextmanager
def monitored_broker(
    *extra: str, kind: str = MONITOR_KIND, interval: float = SCRAPE_INTERVAL
) -> Iterator[Server]:
    """A `meshbus broker --monitor` subprocess and a scraper of its /metrics, both
    stopped on exit; the scrapes' count and answer times go to stderr."""
    monitor = f"127.0.0.1:{free_port()}"
    with meshbus_broker(*extra, "--monitor", monitor, kind=kind) as server:
        scraper = subprocess.Popen(
            [sys.executable, "-c", _SCRAPER, f"http://{monitor}/metrics", str(interval)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            yield server
        finally:
            out, _ = scraper.communicate(b"", timeout=10)
        report = json.loads(out)
        times = sorted(report["ms"])
        if not times or report["failed"]:
            raise BenchSetupError(
                f"the scraper of {monitor} got {len(times)} answers and {report['failed']} "
                "failures: the monitor did not serve /metrics"
            )
        click.echo(
            f"monitor {monitor}: {len(times)} scrapes, answer p50 {times[len(times) // 2]:.2f} "
            f"ms, max {times[-1]:.2f} ms",
            err=True,
        )


def monitor_servers(
    monitor: str, args: tuple[str, ...], interval: float = SCRAPE_INTERVAL
) -> list[AbstractContextManager[Server]]:
    """The meshbus systems of ``--monitor``: one broker (off / on), or one without the
    monitor then one with it (both), scraped every ``interval`` seconds."""
    if monitor == "off":
        return [meshbus_broker(*args)]
    if monitor == "on":
        return [monitored_broker(*args, kind="meshbus", interval=interval)]
    return [meshbus_broker(*args), monitored_broker(*args, interval=interval)]
