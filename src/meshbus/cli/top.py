"""``meshbus top``: every broker of a mesh on one screen, refreshed in place.

From one broker (--broker) it learns the others -- the ``mesh`` list of a broker's
stat: itself and the brokers it is linked to -- and opens an operator's link to
each, which the broker does not count as a connector and never moves. Every
--interval seconds it asks all of them for their brief stat at once; the figures
are ``cli_top_view``'s. A broker once seen stays on the screen, unreachable while it
does not answer, and is asked again at every refresh.

The terminal is driven with the standard library's curses: keys read as they are
typed without echo, a resize followed, the terminal put back as it was on the way
out. Rich, which the other commands print with, draws but reads no keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import curses
import io
import locale
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from meshbus.cli.common import DEFAULT_SERVER, Access, access_options, broker_option, run
from meshbus.cli.top_view import Line, Row, Sample, Style, fit, rates, table
from meshbus.errors import MeshbusError

if TYPE_CHECKING:
    from meshbus.client.connector import Connector

# How long a broker has to take a link or answer a stat before it counts as
# unreachable for that refresh; a refresh waits that long at most.
ANSWER_TIMEOUT = 2.0
# Connecting to --broker: as long as the other commands give it.
_FIRST_TIMEOUT = 5.0
_QUIT_KEYS = (ord("q"), ord("Q"))

_EPILOG = f"""\b
Columns (docs/operations.md, "meshbus top"):
  STATE        running, joining (not yet in the mesh), draining,
               or unreachable (no answer within {ANSWER_TIMEOUT:g} s)
  CONN, SVCS   connectors linked to it, services they registered
  NATS         NATS clients connected to it (--nats-listen)
  IN/S, OUT/S  messages read from / written to its links and its NATS
               clients per second (a message counts at every broker it
               crosses)
  PEND         requests waiting for their response
  DROPS        messages it did not deliver since it started, every reason
  LAG P99 OWN  event-loop lag in ms since it started: the largest, the
               99th percentile, the largest its own work explains

\b
Exit codes: 0 quit (q, Ctrl-C) or table printed, 1 error (no broker
answers), 2 bad arguments or not a terminal (use --once)."""


@click.command(epilog=_EPILOG)
@broker_option(
    "--broker",
    "broker_address",
    help_text="Any broker of the mesh: HOST:PORT, or several as HOST:PORT,HOST:PORT "
    "(the first that answers); the others are learned from it.",
)
@click.option(
    "--interval",
    type=click.FloatRange(0.1),
    default=1.0,
    show_default=True,
    help="Seconds between refreshes; the rates are measured over one.",
)
@click.option(
    "--once",
    is_flag=True,
    help="Print one plain-text table, after measuring the rates over one --interval, "
    "and exit (for scripts; needs no terminal).",
)
@access_options
def top(broker_address: str, interval: float, once: bool, access: Access) -> None:
    """A live view of every broker of the mesh, refreshed in place.

    Per broker its name, address, state, connectors, services, NATS clients,
    messages per second in and out, pending requests, drops and event-loop lag, and a
    total line for the mesh. A broker that stops answering stays listed as
    unreachable. Press q or Ctrl-C to quit.
    """
    if not once and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise click.UsageError(
            "meshbus top draws on a terminal and reads its keys, and stdin or stdout is not "
            "one: use --once for a plain-text table"
        )
    run(_top(broker_address, access, interval, once), interruptible=True)


async def _top(broker_address: str, access: Access, interval: float, once: bool) -> None:
    watch = MeshWatch(access)
    try:
        # Before the screen: a broker that does not answer fails as one line.
        await watch.start(broker_address)
        if once:
            await watch.refresh()
            await asyncio.sleep(interval)
            await watch.refresh()
            for line in table(watch.rows()).lines():
                click.echo(line.text)
        else:
            await _live(watch, interval)
    finally:
        await watch.close()


@dataclass
class _Broker:
    """One broker as top follows it: the operator's link to it (None while there is
    none), its last sample (None while it does not answer), and why it does not."""

    name: str
    address: str
    conn: Connector | None = None
    sample: Sample | None = None
    rates: tuple[float, float] | None = None
    error: str = ""


class MeshWatch:
    """The brokers of one mesh, each asked for its stat over a link of its own."""

    def __init__(self, access: Access) -> None:
        self._access = access
        self._brokers: dict[str, _Broker] = {}

    async def start(self, seeds: str) -> None:
        """Link to the first of ``seeds`` that answers; a MeshbusError if none does."""
        conn = await self._connect(seeds, _FIRST_TIMEOUT)
        self._brokers[conn.broker_name] = _Broker(conn.broker_name, conn.broker_address, conn)

    async def refresh(self) -> None:
        """Ask every broker for its stat, all at once; then the brokers those answers
        name for the first time, until none is new."""
        asking = list(self._brokers.values())
        while asking:
            answers = await asyncio.gather(*(self._ask(broker) for broker in asking))
            asking = []
            for mesh in answers:
                for info in mesh:
                    known = self._brokers.get(info["name"])
                    if known is None:
                        known = self._brokers[info["name"]] = _Broker(info["name"], info["address"])
                        asking.append(known)
                    elif known.conn is None:  # it may be back at another address
                        known.address = info["address"]

    def rows(self) -> list[Row]:
        return [Row(b.name, b.address, b.sample, b.rates, b.error) for b in self._brokers.values()]

    async def close(self) -> None:
        # At once: closing a TLS link waits for the broker's goodbye (up to a second).
        await asyncio.gather(*(self._unlink(broker) for broker in self._brokers.values()))

    async def _ask(self, broker: _Broker) -> list[dict[str, Any]]:
        """The broker's stat into ``broker``, and its mesh list; [] when it does not
        answer, its link closed so that the next refresh opens a new one."""
        try:
            if broker.conn is None:
                broker.conn = await self._connect(broker.address, ANSWER_TIMEOUT)
            data = await broker.conn.stat(detail=False)
            sample = Sample.from_stat(data)
        except MeshbusError as exc:
            await self._unlink(broker)
            # Its last sample goes too: a rate across the outage would be no rate of now.
            broker.sample, broker.rates, broker.error = None, None, str(exc) or type(exc).__name__
            return []
        broker.rates = rates(broker.sample, sample)
        broker.sample, broker.error = sample, ""
        return list(data.get("mesh", []))

    async def _connect(self, address: str, timeout: float) -> Connector:
        return await self._access.connect(
            address,
            server=DEFAULT_SERVER,
            operator=True,
            timeout=timeout,
            request_timeout=ANSWER_TIMEOUT,
        )

    @staticmethod
    async def _unlink(broker: _Broker) -> None:
        if broker.conn is not None:
            conn, broker.conn = broker.conn, None
            await conn.close()


async def _live(watch: MeshWatch, interval: float) -> None:
    """Refresh and draw until q, Ctrl-C or SIGTERM; the terminal is put back however
    this ends."""
    loop = asyncio.get_running_loop()
    with _logs_held(), _Screen() as screen:

        def redraw() -> None:
            rows = watch.rows()
            down = sum(row.sample is None for row in rows)
            title = (
                f"meshbus top  {len(rows)} brokers, {down} unreachable  every {interval:g} s  "
                f"lag in ms  {time.strftime('%H:%M:%S')}  q quits"
            )
            screen.draw(fit(title, rows, *screen.size()))

        refreshing = asyncio.create_task(_refresh_forever(watch, interval, redraw))

        def on_keys() -> None:
            if any(key in _QUIT_KEYS for key in screen.typed()):
                refreshing.cancel()

        def on_resize() -> None:
            screen.resized()
            redraw()

        stdin = sys.stdin.fileno()
        loop.add_reader(stdin, on_keys)
        quits = (signal.SIGINT, signal.SIGTERM)
        for signum in quits:
            loop.add_signal_handler(signum, refreshing.cancel)
        loop.add_signal_handler(signal.SIGWINCH, on_resize)
        try:
            # Quitting cancels the refresher; asyncio.wait raises neither that nor a failure.
            await asyncio.wait([refreshing])
        finally:
            refreshing.cancel()
            loop.remove_reader(stdin)
            for signum in (*quits, signal.SIGWINCH):
                loop.remove_signal_handler(signum)
    if not refreshing.cancelled():
        refreshing.result()  # it ended by failing: raise that


async def _refresh_forever(watch: MeshWatch, interval: float, redraw: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        await watch.refresh()
        redraw()
        await asyncio.sleep(max(0.0, started + interval - loop.time()))


@contextlib.contextmanager
def _logs_held() -> Iterator[None]:
    """Log lines on stderr (-v, or a client's warning) would land in the middle of the
    screen: they are kept while it is up and written after."""
    held = io.StringIO()
    handlers = [
        handler
        for handler in logging.getLogger().handlers
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr
    ]
    for handler in handlers:
        handler.setStream(held)
    try:
        yield
    finally:
        for handler in handlers:
            handler.setStream(sys.stderr)
        sys.stderr.write(held.getvalue())


class _Screen:
    """The terminal under curses while the view runs: keys one at a time without echo,
    no cursor, one attribute per kind of line. ``with`` puts it back as it was."""

    def __enter__(self) -> _Screen:
        with contextlib.suppress(locale.Error):  # so a broker's UTF-8 name is drawn as such
            locale.setlocale(locale.LC_ALL, "")
        try:
            self._window = curses.initscr()
        except curses.error as exc:
            raise click.ClickException(
                f"cannot draw on this terminal ({exc}): set TERM to its type, or use --once"
            ) from exc
        try:
            curses.noecho()
            curses.cbreak()
            self._window.keypad(True)
            self._window.nodelay(True)
            with contextlib.suppress(curses.error):  # a terminal that cannot hide it shows it
                curses.curs_set(0)
            self._styles = _styles()
            # curses believes LINES and COLUMNS when a parent exported them: the terminal
            # itself knows better.
            self.resized()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._restore()

    def _restore(self) -> None:
        self._window.keypad(False)
        curses.echo()
        curses.nocbreak()
        curses.endwin()

    def size(self) -> tuple[int, int]:
        """Width and height, in characters."""
        height, width = self._window.getmaxyx()
        return width, height

    def resized(self) -> None:
        """Take the terminal's size from the terminal (at the start, and after SIGWINCH,
        which this process handles)."""
        size = os.get_terminal_size(sys.stdout.fileno())
        curses.resizeterm(size.lines, size.columns)

    def typed(self) -> list[int]:
        """The keys typed since the last call."""
        typed = []
        while (key := self._window.getch()) != -1:
            typed.append(key)
        return typed

    def draw(self, lines: list[Line]) -> None:
        width, height = self.size()
        self._window.erase()
        for y, line in enumerate(lines[:height]):
            text = line.text.ljust(width) if line.style == "header" else line.text
            # Writing the bottom-right cell succeeds but then fails to move the cursor past it.
            with contextlib.suppress(curses.error):
                self._window.addnstr(y, 0, text, width, self._styles[line.style])
        self._window.refresh()


def _styles() -> dict[Style, int]:
    down = curses.A_BOLD
    if curses.has_colors():
        curses.start_color()
        background = curses.COLOR_BLACK
        with contextlib.suppress(curses.error):
            curses.use_default_colors()
            background = -1  # the terminal's own background
        curses.init_pair(1, curses.COLOR_RED, background)
        down |= curses.color_pair(1)
    return {
        "title": curses.A_BOLD,
        "header": curses.A_REVERSE,
        "row": curses.A_NORMAL,
        "down": down,
        "total": curses.A_BOLD,
        "note": curses.A_DIM,
    }
