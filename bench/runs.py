"""Runs of one benchmark on meshbus and, with --vs-nats, on nats-server in the same command.

The caller says what is measured: a single server (``servers``) or a cluster
(``cluster``), one context manager per system, meshbus first. ``alternate``
starts them, runs the measurement on each in turn, so both systems see the same
machine noise, and reports the median per system; the ratio in the last line is
taken between those medians.

Shared by ``bench.cli`` and the multi-server commands; it imports neither, so the
commands can be registered on the ``python -m bench`` group without an import cycle.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import click

from bench.report import new_table, print_tables
from bench.servers import BenchSetupError

F = TypeVar("F", bound=Callable[..., Any])


class System(Protocol):
    """Something measured: a server or a cluster, "meshbus" or "nats"."""

    kind: str


S = TypeVar("S", bound=System)


def alternate(
    systems: Sequence[AbstractContextManager[S]],
    runs: int,
    title: str,
    columns: tuple[str, ...],
    measure: Callable[[S], tuple[float, tuple[str, ...]]],
) -> dict[str, float]:
    """Start ``systems``, run ``measure`` ``runs`` times on each, the systems alternating,
    stop them, print the per-run table on stderr and return the median figure per kind.

    ``measure`` returns the figure to take the median of and the table cells of the run.
    A system that cannot be started or set up (BenchSetupError) becomes a click error.
    """
    table = new_table(title, ("run", "system", *columns))
    figures: dict[str, list[float]] = {}
    try:
        with contextlib.ExitStack() as stack:
            started = [stack.enter_context(system) for system in systems]
            for run in range(1, runs + 1):
                for system in started:
                    figure, cells = measure(system)
                    figures.setdefault(system.kind, []).append(figure)
                    table.add_row(str(run), system.kind, *cells)
    except BenchSetupError as exc:
        raise click.ClickException(str(exc)) from exc
    print_tables(table)
    return {kind: statistics.median(values) for kind, values in figures.items()}


def last_line(medians: dict[str, float], suffix: str, digits: int) -> str:
    """`meshbus<suffix>=<v> [meshbus_auth<suffix>=<v> auth_ratio=<with/without users>]
    [nats<suffix>=<v> ratio=<meshbus/nats>]`, machine-readable."""
    line = f"meshbus{suffix}={medians['meshbus']:.{digits}f}"
    if "meshbus_auth" in medians:  # --auth both
        auth = medians["meshbus_auth"]
        line += (
            f" meshbus_auth{suffix}={auth:.{digits}f} auth_ratio={auth / medians['meshbus']:.3f}"
        )
    if "meshbus_monitor" in medians:  # unicast --monitor both
        monitored = medians["meshbus_monitor"]
        line += (
            f" meshbus_monitor{suffix}={monitored:.{digits}f}"
            f" monitor_ratio={monitored / medians['meshbus']:.3f}"
        )
    if "nats" in medians:
        ratio = medians["meshbus"] / medians["nats"]
        line += f" nats{suffix}={medians['nats']:.{digits}f} ratio={ratio:.3f}"
    return line


def runs_options(command: F) -> F:
    """--runs and --vs-nats, the same for every benchmark."""
    command = click.option(
        "--vs-nats", is_flag=True, help="Also measure nats-server (Debian package)."
    )(command)
    return click.option(
        "--runs",
        type=click.IntRange(1),
        default=3,
        show_default=True,
        help="Runs per system, meshbus and nats-server alternating; medians are reported.",
    )(command)


def size_option(
    text: str = "Payload bytes per message.", default: int = 16, smallest: int = 0
) -> Callable[[F], F]:
    """--size of the benchmarks, with their own help ``text``, default and smallest size."""

    def decorate(command: F) -> F:
        return click.option(
            "--size",
            type=click.IntRange(smallest, 1_000_000),
            default=default,
            show_default=True,
            help=text,
        )(command)

    return decorate


def request_options(requests: int) -> Callable[[F], F]:
    """--requests (timed, with ``requests`` by default), --size and --concurrency of the
    client benchmarks' request scenarios."""

    def decorate(command: F) -> F:
        command = click.option(
            "--concurrency",
            type=click.IntRange(1, 10_000),
            default=16,
            show_default=True,
            help="Requests in flight in the requests/s scenario (the p50 one runs at 1).",
        )(command)
        command = size_option("Payload bytes per message, request and response.")(command)
        return click.option(
            "--requests",
            type=click.IntRange(100),
            default=requests,
            show_default=True,
            help="Timed requests per run (a warm-up of 10% more is not timed).",
        )(command)

    return decorate


def count_option(default: int, text: str = "Messages per run.") -> Callable[[F], F]:
    """--count of the message benchmarks, with their own default (and help ``text``)."""

    def decorate(command: F) -> F:
        return click.option(
            "--count", type=click.IntRange(1), default=default, show_default=True, help=text
        )(command)

    return decorate
