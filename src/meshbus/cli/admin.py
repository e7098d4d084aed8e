"""The operator's commands besides ``broker`` (meshbus.cli.broker): ``mesh up``,
``drain`` and ``stat``.

Like the rest of the CLI a thin layer: ``mesh up`` starts broker processes and
stops them, ``drain`` and ``stat`` are one control request each through a
connector.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from meshbus.cli.common import (
    DEFAULT_SERVER,
    Access,
    access_options,
    broker_option,
    connection_options,
    plain_row,
    run,
)
from meshbus.cli.stat_view import stat_renderables
from meshbus.util import parse_hostport

# -- mesh up ------------------------------------------------------------------------------


@click.group()
def mesh() -> None:
    """Run a local mesh of brokers (to try meshbus on one machine)."""


@mesh.command()
@click.option(
    "-n",
    "count",
    type=click.IntRange(1, 64),
    default=3,
    show_default=True,
    help="Number of brokers.",
)
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address the brokers listen on."
)
@click.option(
    "--base-port",
    type=click.IntRange(0, 65535),
    default=7400,
    show_default=True,
    help="Port of the first broker; the others take the next ones. 0: free ports.",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Each broker keeps its durable data in DATA_DIR/NAME.",
)
@click.option(
    "--max-connectors",
    type=click.IntRange(1),
    default=50,
    show_default=True,
    help="Connectors per broker.",
)
@click.option(
    "--config",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A broker config file (meshbus broker --config) every broker starts with: e.g. "
    "allow-anonymous = true for --host 0.0.0.0, or [[users]] for -n 1 (more brokers "
    "with users need [[brokers]] and a key each: start them with meshbus broker).",
)
def up(
    count: int,
    host: str,
    base_port: int,
    data_dir: str | None,
    max_connectors: int,
    config: str | None,
) -> None:
    """Start N brokers (-n) as one mesh, in the foreground; Ctrl-C drains and stops them.

    The first broker starts the mesh and the others join it through the first.
    Prints each broker's name and address; connect with
    `--broker ADDRESS[,ADDRESS...]`.
    """
    if base_port and base_port + count - 1 > 65535:
        raise click.BadParameter(
            f"ports {base_port}..{base_port + count - 1} do not fit", param_hint="'--base-port'"
        )
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from meshbus.broker.process import broker_argv, parse_ready_line

    console = Console(stderr=True)
    brokers: list[tuple[subprocess.Popen[bytes], str, str]] = []

    def start(index: int, seed: str | None) -> subprocess.Popen[bytes]:
        port = base_port + index if base_port else 0
        name = f"mesh-{index + 1}"
        args = ["--listen", f"{host}:{port}", "--name", name]
        args += ["--max-connectors", str(max_connectors)]
        if seed:
            args += ["--seed", seed]
        if data_dir:
            args += ["--data-dir", os.path.join(data_dir, name)]
        if config:
            args += ["--config", config]
        # A session of its own: Ctrl-C reaches `mesh up`, which drains them in order.
        return subprocess.Popen(
            broker_argv(*args),
            stdout=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_terminated_with_this_process(),
        )

    def wait_ready(process: subprocess.Popen[bytes]) -> tuple[str, str]:
        assert process.stdout is not None
        line = process.stdout.readline().decode()
        ready = parse_ready_line(line)
        if ready is None:
            process.wait()
            raise click.ClickException(
                f"a broker did not start (exit {process.returncode}); its output is above"
            )
        return ready

    stop = _StopFlag()
    try:
        with console.status(f"starting {count} brokers"):
            first = start(0, None)
            brokers.append((first, *wait_ready(first)))
            rest = [start(i, brokers[0][2]) for i in range(1, count)]
            for process in rest:
                brokers.append((process, *wait_ready(process)))
        table = Table(title=f"meshbus mesh of {count}")
        table.add_column("name")
        table.add_column("address")
        table.add_column("pid", justify="right")
        for process, name, address in brokers:
            plain_row(table, name, address, process.pid)
        console.print(table)
        addresses = ",".join(address for _, _, address in brokers)
        click.echo(addresses)  # stdout: the one line a script needs
        console.print(
            escape(f"connect with --broker {addresses}; Ctrl-C drains and stops the mesh")
        )
        while not stop.set and brokers:
            for entry in brokers:
                if entry[0].poll() is not None:
                    click.echo(f"broker {entry[1]} exited with {entry[0].returncode}", err=True)
                    brokers.remove(entry)
                    break
            time.sleep(0.2)
    finally:
        stop.restore()
        _stop_in_order(brokers, console)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _terminated_with_this_process() -> Callable[[], None] | None:
    """A ``preexec_fn`` after which the child gets SIGTERM (a broker drains and exits)
    when this process dies, even of kill -9, which leaves no chance to stop it: Linux's
    PR_SET_PDEATHSIG. None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    # Looked up here: the child, between fork and exec, only makes the call.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # it died before the call: no signal will come
            os._exit(1)

    return set_death_signal


class _StopFlag:
    """Ctrl-C and SIGTERM set a flag instead of raising, from the moment ``mesh up`` starts:
    the brokers are always drained in order, whenever the signal comes."""

    def __init__(self) -> None:
        self.set = False
        self._previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }

    def _on_signal(self, signum: int, frame: object) -> None:
        self.set = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _stop_in_order(brokers: list[tuple[subprocess.Popen[bytes], str, str]], console: Any) -> None:
    """Drain the brokers one at a time, the last first, so connectors always have a
    broker to move to; kill any that does not stop in time. No child is left behind."""
    from rich.markup import escape

    from meshbus.broker.process import stop_process

    for process, name, _ in reversed(brokers):
        if process.poll() is None:
            with console.status(escape(f"draining {name}")):
                stop_process(process, timeout=30)
            console.print(escape(f"{name} stopped (exit {process.returncode})"))


# -- drain -------------------------------------------------------------------------------


@click.command()
@broker_option("--broker", "broker_address", one=True, help_text="The broker to drain.")
@click.option(
    "--grace",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help="Seconds to wait for connectors to move (default: the broker's --drain-grace).",
)
@click.option(
    "--wait/--no-wait",
    default=True,
    show_default=True,
    help="Wait until the broker has stopped.",
)
@access_options
def drain(broker_address: str, grace: float | None, wait: bool, access: Access) -> None:
    """Drain a broker: it takes no new connectors, moves its connectors to the other
    brokers of the mesh, waits up to its grace period, and exits."""
    run(_drain(broker_address, grace or 0.0, wait, access))


async def _drain(broker_address: str, grace: float, wait: bool, access: Access) -> None:
    import asyncio

    async with await access.connect(broker_address, server=DEFAULT_SERVER, operator=True) as conn:
        name = conn.broker_name
        await conn.drain_broker(grace)
    click.echo(f"broker {name} at {broker_address} is draining", err=True)
    if not wait:
        return
    host, port = parse_hostport(broker_address)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (grace or 60.0) + 10.0
    while loop.time() < deadline:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            click.echo(f"broker {name} stopped", err=True)
            return
        writer.close()
        await asyncio.sleep(0.1)
    raise click.ClickException(f"broker {name} was still running after the grace period")


# -- stat ----------------------------------------------------------------------------------


@click.command()
@connection_options
@click.option("--json", "as_json", is_flag=True, help="Print the broker's raw answer as JSON.")
@click.option(
    "--brief",
    is_flag=True,
    help="A few lines: this broker, the mesh and its totals, without the tables of links, "
    "services, groups and counters (for large brokers; takes only the operator right "
    "'stat').",
)
def stat(broker_address: str, server: str, access: Access, as_json: bool, brief: bool) -> None:
    """Show the broker's view: the mesh, its links, services, groups and counters.

    --json prints one object with at least: name, connectors, services
    (registered through this broker), routes (entries in its routing table),
    peers (names of the brokers it is linked to) and capacity.
    The command's own link is an operator's link: listed among the links (role
    operator), but not counted as a connector, and never redirected -- a full or
    draining broker shows its own state.

    The full view takes the operator right 'stat-detail'; a user with only
    'stat' gets the brief view, with a note on stderr.
    """
    answer = run(_stat(broker_address, server, access, not brief))
    assert answer is not None
    data, refused = answer
    if refused:
        click.echo(f"{refused}; showing the brief view (meshbus stat --brief)", err=True)
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    from rich.console import Console

    console = Console()
    for renderable in stat_renderables(data, brief=brief or bool(refused)):
        console.print(renderable)


async def _stat(
    broker_address: str, server: str, access: Access, detail: bool
) -> tuple[dict[str, Any], str]:
    """The broker's answer, and why it is the brief one when ``detail`` was asked for
    ("": it is not): a user without the right 'stat-detail' may still have 'stat'."""
    from meshbus.errors import PermissionDenied

    async with await access.connect(broker_address, server=server, operator=True) as conn:
        if not detail:
            return await conn.stat(detail=False), ""
        try:
            return await conn.stat(), ""
        except PermissionDenied as exc:
            refused = str(exc)
        return await conn.stat(detail=False), refused
