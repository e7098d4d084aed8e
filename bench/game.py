"""`python -m bench game`: a game back end's real traffic on meshbus and on NATS (issue 25).

The same process layout on both systems, the same machine, the same run (the systems
alternate, ``runs.alternate``):

- G game-server processes (``--game-servers``), each holding P players (``--players``):
  on meshbus one connector with a service per player at a fixed address, on NATS one
  nats.py connection with a subscription per player on its own subject. Every player is
  in one of Z zones (``--zones``; player n in zone n mod Z): a multicast group on
  meshbus, a subject with one subscription per member on NATS. Each player sends 40-byte
  position updates to a random other player (unicast, ``--unicast-rate`` per player per
  second) and to its zone (``--zone-rate``), and each game server sends login requests
  (``--login-rate`` per second) from its players, each timed;
- a login pool process with N responders (``--responders``): services in an anycast
  group on meshbus, subscriptions in a queue group on NATS; 32-byte requests, 48-byte
  replies;
- a match-results producer process sending 64-byte results (``--results-rate``) reliably
  to a results consumer process. meshbus: ``send(..., reliable=True)``, exactly once,
  acked by the receiving connector and resent until then. NATS: a request that the
  consumer answers with an ack, resent when not acked in 2 s -- at least once with an
  ack, the same guarantee short of the dedupe, kept in memory as meshbus keeps it.
  JetStream would add a disk write meshbus's reliable send does not make (streams are
  meshbus's analog of JetStream, measured by `bench stream`).

Rates, not "as fast as possible": a game back end runs at the rate of its players, so
the question is what that rate costs and how fast requests are answered under it (an
open loop at full speed would time requests in a saturated queue). The defaults (2 unicast
and 0.2 zone updates per player per second, 2,000 players, zones of 100: 4,000 unicast and
~39,600 zone deliveries per second, 400 requests/s, 200 results/s) keep both systems below
saturation on the shared 2-core machine of BENCHMARKS.md -- at 0.5 zone updates NATS with
nats.py fell behind (84 % delivered, requests waiting over a second) where meshbus kept up
-- so both deliver what is offered, and the figures that differ are the CPU it costs and
the request latency. "kept up" says when a system did not (then msgs/s differ too): raise
the rates to find where either saturates. A sender that falls more than 0.5 s behind its
schedule skips the excess (counted), so an overloaded system is not buried.

What is counted, per process, inside the measured window only (``--duration`` seconds
after ``--warmup``): deliveries to a player's handler by kind (a zone update reaching its
own sender is not counted: meshbus does not hand it back, NATS does and the handler drops
it), login requests answered (each counts as two delivered messages, request and reply),
and match results received by the consumer. CPU is utime + stime from /proc/PID/stat of
every process of the system -- the server(s) and all the client processes -- read at the
start and the end of the window; "CPU s/M" is CPU seconds per million delivered messages
(the last line also has the server(s)' share alone, ``server_cpu_s_per_m``).

``--brokers 3`` runs a 3-broker meshbus mesh against a 3-node nats-server cluster
(``bench.cluster``), the processes spread over the servers round robin.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

from bench.cluster import Cluster, meshbus_mesh, nats_cluster
from bench.game_worker import WorkerConfig, WorkerResult
from bench.runs import alternate, runs_options
from bench.servers import BenchSetupError, meshbus_broker, nats_server

_READY_TIMEOUT = 60.0
_STOP_TIMEOUT = 10.0
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# Where ``python -m bench.game_worker`` finds the rig, wherever the command was started.
_RIG = str(Path(__file__).resolve().parents[1])


@dataclass
class GameOptions:
    game_servers: int
    players: int
    zones: int
    unicast_rate: float
    zone_rate: float
    login_rate: float
    responders: int
    results_rate: float
    duration: float
    warmup: float


@dataclass
class GameResult:
    system: str
    seconds: float
    cpu_seconds: float  # every process of the system
    server_cpu_seconds: float  # the server(s) alone
    expected_zone: int  # zone deliveries the zone sends of the window should make
    results: list[WorkerResult] = field(default_factory=list)

    def total(self, name: str) -> int:
        return sum(getattr(r, name) for r in self.results)

    def per_s(self, name: str) -> float:
        return self.total(name) / self.seconds

    @property
    def latencies(self) -> list[float]:
        return sorted(x for r in self.results for x in r.latencies_us)

    @property
    def p50_us(self) -> float:
        return statistics.median(self.latencies) if self.latencies else 0.0

    @property
    def p99_us(self) -> float:
        ordered = self.latencies
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] if ordered else 0.0

    @property
    def delivered(self) -> int:
        """Messages delivered: position updates, requests and replies, match results."""
        return (
            self.total("unicast")
            + self.total("zone")
            + 2 * self.total("requests")
            + self.total("reliable")
        )

    @property
    def msgs_per_s(self) -> float:
        return self.delivered / self.seconds

    @property
    def cpu_per_million(self) -> float:
        return self.cpu_seconds / (self.delivered / 1e6) if self.delivered else float("inf")

    @property
    def server_cpu_per_million(self) -> float:
        return self.server_cpu_seconds / (self.delivered / 1e6) if self.delivered else float("inf")

    @property
    def kept_up(self) -> float:
        """Position updates delivered / what the updates sent in the window should make."""
        expected = self.total("unicast_sent") + self.expected_zone
        got = self.total("unicast") + self.total("zone")
        return got / expected if expected else 0.0


# -- the servers -----------------------------------------------------------------------------


@contextlib.contextmanager
def game_system(kind: str, brokers: int, clients: int) -> Iterator[Cluster]:
    """One meshbus broker or nats-server, or a mesh (cluster) of ``brokers``."""
    if brokers == 1:
        single = meshbus_broker() if kind == "meshbus" else nats_server()
        with single as server:
            yield Cluster(kind, [server])
    elif kind == "meshbus":
        with meshbus_mesh(brokers, "--max-connectors", str(max(50, clients + 10))) as mesh:
            yield mesh
    else:
        with nats_cluster(brokers) as cluster:
            yield cluster


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of ``pids`` (all their threads), from /proc/PID/stat."""
    ticks = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            # pid (comm) state ... : comm may hold spaces, so split after it.
            fields = stat.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / _CLK_TCK


# -- the worker processes --------------------------------------------------------------------


def _configs(kind: str, cluster: Cluster, o: GameOptions) -> list[WorkerConfig]:
    """Every process of one run, spread over the cluster's servers round robin."""
    roles = [("game", i) for i in range(o.game_servers)]
    roles += [("login", 0), ("consumer", 0), ("producer", 0)]
    nodes = cluster.nodes
    return [
        WorkerConfig(
            system=kind,
            role=role,
            address=f"{nodes[n % len(nodes)].host}:{nodes[n % len(nodes)].port}",
            index=index,
            game_servers=o.game_servers,
            players=o.players,
            zones=o.zones,
            unicast_rate=o.unicast_rate,
            zone_rate=o.zone_rate,
            login_rate=o.login_rate,
            responders=o.responders,
            results_rate=o.results_rate,
        )
        for n, (role, index) in enumerate(roles)
    ]


class _Lines:
    """The stdout lines of the worker processes, read together (select) with a deadline."""

    def __init__(self, processes: list[subprocess.Popen[bytes]]) -> None:
        self._pipes: dict[int, subprocess.Popen[bytes]] = {}
        for process in processes:
            assert process.stdout is not None
            self._pipes[process.stdout.fileno()] = process
        self._bufs = dict.fromkeys(self._pipes, b"")

    def next(self, what: str, timeout: float) -> list[str]:
        """The next line of every process, in the order given, within ``timeout`` for all."""
        deadline = time.monotonic() + timeout
        while waiting := [fd for fd, buf in self._bufs.items() if b"\n" not in buf]:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchSetupError(f"game workers did not {what} within {timeout:.0f} s")
            readable, _, _ = select.select(waiting, [], [], left)
            for fd in readable:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    code = self._pipes[fd].wait()
                    raise BenchSetupError(
                        f"a game worker exited (code {code}) before it could {what}"
                    )
                self._bufs[fd] += chunk
        lines = []
        for fd, buf in self._bufs.items():
            line, self._bufs[fd] = buf.split(b"\n", 1)
            lines.append(line.decode())
        return lines


def _tell(processes: list[subprocess.Popen[bytes]], line: str) -> None:
    for process in processes:
        assert process.stdin is not None
        process.stdin.write(line.encode() + b"\n")
        process.stdin.flush()


@contextlib.contextmanager
def _workers(configs: list[WorkerConfig]) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The worker processes of ``configs``; told to stop, then killed if they do not."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [_RIG, os.environ.get("PYTHONPATH")])),
    }
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for config in configs:
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "bench.game_worker", json.dumps(asdict(config))],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env=env,
                )
            )
        yield processes
    finally:
        for process in processes:
            with contextlib.suppress(OSError):
                assert process.stdin is not None
                process.stdin.write(b"stop\n")
                process.stdin.close()
        deadline = time.monotonic() + _STOP_TIMEOUT
        for process in processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()


def measure_game(cluster: Cluster, o: GameOptions) -> GameResult:
    """One run on ``cluster``: start every process, wait until all are set up, run the
    traffic, read the CPU times around the window, collect the counts."""
    configs = _configs(cluster.kind, cluster, o)
    with _workers(configs) as processes:
        lines = _Lines(processes)
        lines.next("set up", _READY_TIMEOUT)
        start = time.monotonic() + 0.1
        window_start = start + o.warmup
        window_end = window_start + o.duration
        _tell(processes, f"go {start} {window_start} {window_end}")
        servers = [node.pid for node in cluster.nodes]
        clients = [p.pid for p in processes]
        time.sleep(max(0.0, window_start - time.monotonic()))
        before = cpu_seconds(servers), cpu_seconds(clients)
        time.sleep(max(0.0, window_end - time.monotonic()))
        after = cpu_seconds(servers), cpu_seconds(clients)
        reports = lines.next("report", _READY_TIMEOUT)
    results = [WorkerResult(**json.loads(line)) for line in reports]
    zone_size = o.game_servers * o.players / o.zones
    return GameResult(
        cluster.kind,
        o.duration,
        after[0] - before[0] + after[1] - before[1],
        after[0] - before[0],
        round(sum(r.zone_sent for r in results) * (zone_size - 1)),
        results,
    )


# -- the command -----------------------------------------------------------------------------

_FIGURES: dict[str, tuple[Callable[[GameResult], float], int]] = {
    # last-line name: (figure of a run, digits)
    "msgs": (lambda r: r.msgs_per_s, 0),
    "unicast": (lambda r: r.per_s("unicast"), 0),
    "multicast": (lambda r: r.per_s("zone"), 0),
    "requests": (lambda r: r.per_s("requests"), 0),
    "reliable": (lambda r: r.per_s("reliable"), 0),
    "p50_us": (lambda r: r.p50_us, 0),
    "p99_us": (lambda r: r.p99_us, 0),
    "cpu_s_per_m": (lambda r: r.cpu_per_million, 2),
    "server_cpu_s_per_m": (lambda r: r.server_cpu_per_million, 2),
    "kept_up": (lambda r: r.kept_up, 3),
}
_RATIOS = {
    "ratio": "msgs",
    "p50_ratio": "p50_us",
    "p99_ratio": "p99_us",
    "cpu_ratio": "cpu_s_per_m",
}


def game_line(medians: dict[str, dict[str, float]]) -> str:
    """`meshbus_msgs=.. meshbus_unicast=.. ... [nats_... ratio=.. p50_ratio=.. p99_ratio=..
    cpu_ratio=..]`: the medians per system, and meshbus/nats of those."""
    parts = [
        f"{kind}_{name}={figures[name]:.{digits}f}"
        for kind, figures in medians.items()
        for name, (_, digits) in _FIGURES.items()
    ]
    if "nats" in medians:
        parts += [
            f"{ratio}={medians['meshbus'][name] / medians['nats'][name]:.3f}"
            for ratio, name in _RATIOS.items()
        ]
    return " ".join(parts)


@click.command()
@click.option(
    "--game-servers",
    type=click.IntRange(1, 64),
    default=4,
    show_default=True,
    help="Game-server processes.",
)
@click.option(
    "--players",
    type=click.IntRange(2, 10_000),
    default=500,
    show_default=True,
    help="Players per game server (a service each; a subscription each on NATS).",
)
@click.option(
    "--zones",
    type=click.IntRange(1, 10_000),
    default=20,
    show_default=True,
    help="Zones the players are spread over (a multicast group / subject each).",
)
@click.option(
    "--unicast-rate",
    type=click.FloatRange(0),
    default=2.0,
    show_default=True,
    help="Position updates to a random other player, per player per second.",
)
@click.option(
    "--zone-rate",
    type=click.FloatRange(0),
    default=0.2,
    show_default=True,
    help="Position updates to the player's zone, per player per second.",
)
@click.option(
    "--login-rate",
    type=click.FloatRange(0),
    default=100.0,
    show_default=True,
    help="Login requests per game server per second.",
)
@click.option(
    "--responders",
    type=click.IntRange(1, 1000),
    default=8,
    show_default=True,
    help="Responders in the login pool.",
)
@click.option(
    "--results-rate",
    type=click.FloatRange(0),
    default=200.0,
    show_default=True,
    help="Match results sent reliably per second.",
)
@click.option(
    "--duration",
    type=click.FloatRange(0.5),
    default=10.0,
    show_default=True,
    help="Seconds measured per run.",
)
@click.option(
    "--warmup",
    type=click.FloatRange(0),
    default=2.0,
    show_default=True,
    help="Seconds of traffic before the measured window.",
)
@click.option(
    "--brokers",
    type=click.IntRange(1, 9),
    default=1,
    show_default=True,
    help="Servers: a meshbus mesh against a nats-server cluster of this many.",
)
@runs_options
def game(
    game_servers: int,
    players: int,
    zones: int,
    unicast_rate: float,
    zone_rate: float,
    login_rate: float,
    responders: int,
    results_rate: float,
    duration: float,
    warmup: float,
    brokers: int,
    runs: int,
    vs_nats: bool,
) -> None:
    """A game back end's traffic: players sending position updates (unicast and to their
    zone), login requests to a pool, match results sent reliably. Delivered messages per
    second by kind, request p50/p99, CPU seconds per million delivered messages.

    Last line: `meshbus_msgs=<per s> meshbus_unicast=<per s> meshbus_multicast=<per s>
    meshbus_requests=<per s> meshbus_reliable=<per s> meshbus_p50_us=<us>
    meshbus_p99_us=<us> meshbus_cpu_s_per_m=<s> meshbus_server_cpu_s_per_m=<s>
    meshbus_kept_up=<fraction> [the same for
    nats_, ratio=<msgs meshbus/nats> p50_ratio=<r> p99_ratio=<r> cpu_ratio=<r>]`.
    """
    options = GameOptions(
        game_servers,
        players,
        zones,
        unicast_rate,
        zone_rate,
        login_rate,
        responders,
        results_rate,
        duration,
        warmup,
    )
    clients = game_servers + 3
    kinds = ["meshbus", "nats"] if vs_nats else ["meshbus"]
    results: dict[str, list[GameResult]] = {}

    def measure(cluster: Cluster) -> tuple[float, tuple[str, ...]]:
        result = measure_game(cluster, options)
        results.setdefault(cluster.kind, []).append(result)
        return result.msgs_per_s, (
            f"{result.msgs_per_s:,.0f}",
            f"{result.per_s('unicast'):,.0f}",
            f"{result.per_s('zone'):,.0f}",
            f"{result.per_s('requests'):,.0f}",
            f"{result.per_s('reliable'):,.0f}",
            f"{result.p50_us:,.0f}",
            f"{result.p99_us:,.0f}",
            f"{result.cpu_seconds:.2f} ({result.server_cpu_seconds:.2f})",
            f"{result.cpu_per_million:.2f}",
            f"{result.kept_up:.1%}",
        )

    alternate(
        [game_system(kind, brokers, clients) for kind in kinds],
        runs,
        f"game: {game_servers} game servers x {players} players in {zones} zones, "
        f"{unicast_rate:g} unicast + {zone_rate:g} zone updates/player/s, "
        f"{login_rate:g} logins/server/s to {responders} responders, "
        f"{results_rate:g} reliable results/s; {duration:g} s, "
        f"{brokers} server(s)",
        (
            "msgs/s",
            "unicast/s",
            "multicast/s",
            "req/s",
            "reliable/s",
            "p50 µs",
            "p99 µs",
            "CPU s (server)",
            "CPU s/M",
            "kept up",
        ),
        measure,
    )
    medians = {
        kind: {
            name: statistics.median(figure(r) for r in runs_of)
            for name, (figure, _) in _FIGURES.items()
        }
        for kind, runs_of in results.items()
    }
    click.echo(game_line(medians))
