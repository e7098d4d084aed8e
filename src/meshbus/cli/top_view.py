"""What ``meshbus top`` shows: one row per broker from its ``conn.stat(detail=False)``
answers, a total row for the mesh, and which of those lines fit a terminal.

Apart from the command (``cli_top``) because it is presentation only -- no click, no
connection, no curses -- so every figure on the screen comes from a pure function of
two stat answers, and the tests check them without a terminal.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any, Literal

from meshbus.errors import MeshbusError

# How a line is drawn: the live view gives each its own attribute (cli_top._Screen).
Style = Literal["title", "header", "row", "down", "total", "note"]

UNREACHABLE = "unreachable"
_GAP = "  "
# Columns right-aligned: figures, so their digits line up.
_NUMERIC_FROM = 3
HEADER = ("BROKER", "ADDRESS", "STATE", "CONN", "SVCS", "NATS", "IN/S", "OUT/S", "PEND", "DROPS")
LAG_HEADER = ("LAG", "P99", "OWN")
# Without it the table of a three-broker mesh fits an 80-column terminal: the first
# column to give up, as it never changes while the view runs.
_ADDRESS = 1


class StatUnusable(MeshbusError):
    """A stat answer without a figure top shows: a broker of an older meshbus."""


@dataclass(frozen=True)
class Line:
    text: str
    style: Style


@dataclass(frozen=True)
class Sample:
    """What top keeps of one stat answer: the figures of the moment, and the counters
    a rate is taken from (with the broker's uptime, so a rate is measured on the
    broker's clock, whatever the answer's round trip took). Messages in and out are its
    links' data frames and its NATS clients' messages."""

    uptime_s: float
    state: str
    connectors: int
    services: int
    nats_clients: int
    msgs_in: int
    msgs_out: int
    pending: int
    drops: int
    lag_max_ms: float
    lag_p99_ms: float
    lag_own_ms: float

    @classmethod
    def from_stat(cls, data: dict[str, Any]) -> Sample:
        """StatUnusable when a figure is missing (an older broker's answer)."""
        try:
            counters: dict[str, Any] = data["counters"]
            lag: dict[str, Any] = data["loop_lag_ms"]
            # Every reason a broker counts (dropped_no_route, dropped_too_large, ...: the
            # monitor's meshbus_dropped_total) and the frames its streams would not store.
            drops = sum(v for k, v in counters.items() if k.startswith("dropped_"))
            drops += data.get("streams", {}).get("dropped", 0)
            # A broker of a meshbus before NATS clients has none.
            nats: dict[str, Any] = data.get("nats") or {"clients": 0, "msgs_in": 0, "msgs_out": 0}
            return cls(
                uptime_s=float(data["uptime_s"]),
                state=broker_state(data),
                connectors=int(data["connectors"]),
                services=int(data["services"]),
                nats_clients=int(nats["clients"]),
                msgs_in=int(counters["msgs_in"]) + int(nats["msgs_in"]),
                msgs_out=int(counters["msgs_out"]) + int(nats["msgs_out"]),
                pending=int(counters["pending"]),
                drops=int(drops),
                lag_max_ms=float(lag["max"]),
                lag_p99_ms=float(lag["p99"]),
                lag_own_ms=float(lag["max_own"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StatUnusable(
                f"its stat has no usable {exc}: does it run an older meshbus than this command?"
            ) from exc


def broker_state(data: dict[str, Any]) -> str:
    """running (takes connectors), joining (not yet part of the mesh) or draining."""
    if data.get("draining"):
        return "draining"
    return "running" if data.get("ready") else "joining"


def rates(before: Sample | None, after: Sample) -> tuple[float, float] | None:
    """Messages per second in and out between two samples of one broker; None when
    there is no earlier sample, or the broker restarted in between (its uptime or a
    counter went back), since a difference across a restart means nothing."""
    if before is None:
        return None
    elapsed = after.uptime_s - before.uptime_s
    msgs_in = after.msgs_in - before.msgs_in
    msgs_out = after.msgs_out - before.msgs_out
    if elapsed <= 0 or msgs_in < 0 or msgs_out < 0:
        return None
    return msgs_in / elapsed, msgs_out / elapsed


@dataclass(frozen=True)
class Row:
    """One broker: ``sample`` None while it does not answer (``error`` says why)."""

    name: str
    address: str
    sample: Sample | None
    rates: tuple[float, float] | None = None
    error: str = ""


def figure(value: float) -> str:
    """A count or a rate in at most 6 characters: 0.4, 12, 98765, 123.4k, 12.3M, 1.2G;
    whole numbers below 100,000 exactly."""
    if value < 10 and value != int(value):
        return f"{value:.1f}"
    if value < 100_000:
        return f"{value:.0f}"
    for scale, unit in ((1e3, "k"), (1e6, "M")):
        if value < scale * 1000:
            return f"{value / scale:.1f}{unit}"
    return f"{value / 1e9:.1f}G"


def _lag(ms: float) -> str:
    return f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def _rate_cells(rate: tuple[float, float] | None) -> list[str]:
    return ["-", "-"] if rate is None else [figure(rate[0]), figure(rate[1])]


def row_cells(row: Row) -> list[str]:
    """The cells of one broker's row, in the order of ``HEADER`` and ``LAG_HEADER``."""
    s = row.sample
    if s is None:
        return [row.name, row.address, UNREACHABLE] + ["-"] * (len(HEADER) + len(LAG_HEADER) - 3)
    return [
        row.name,
        row.address,
        s.state,
        figure(s.connectors),
        figure(s.services),
        figure(s.nats_clients),
        *_rate_cells(row.rates),
        figure(s.pending),
        figure(s.drops),
        *map(_lag, (s.lag_max_ms, s.lag_p99_ms, s.lag_own_ms)),
    ]


def total_cells(rows: list[Row]) -> list[str]:
    """The mesh's row: sums over the brokers that answer, the largest lags. A message
    is counted at every broker it crosses, so a message between connectors of two
    brokers adds to both brokers' in and out."""
    up = [row.sample for row in rows if row.sample is not None]
    measured = [row.rates for row in rows if row.sample is not None and row.rates is not None]
    total_rate = None
    if measured:
        total_rate = (sum(r[0] for r in measured), sum(r[1] for r in measured))

    def most(values: list[float]) -> str:
        return _lag(max(values)) if values else "-"

    return [
        "total",
        f"{len(rows)} brokers",
        "",
        figure(sum(s.connectors for s in up)),
        figure(sum(s.services for s in up)),
        figure(sum(s.nats_clients for s in up)),
        *_rate_cells(total_rate),
        figure(sum(s.pending for s in up)),
        figure(sum(s.drops for s in up)),
        most([s.lag_max_ms for s in up]),
        most([s.lag_p99_ms for s in up]),
        most([s.lag_own_ms for s in up]),
    ]


@dataclass(frozen=True)
class Table:
    """The header, the brokers' rows, the total row and the notes (why a broker does not
    answer), each a line of text; ``width`` is that of the widest table line."""

    header: Line
    rows: list[Line]
    total: Line
    notes: list[Line]
    width: int

    def lines(self) -> list[Line]:
        return [self.header, *self.rows, self.total, *self.notes]


def table(rows: list[Row], *, address: bool = True) -> Table:
    """``rows`` in name order as aligned columns; without ``address`` the address
    column is left out (for a narrow terminal)."""
    rows = sorted(rows, key=lambda row: row.name)
    grid = [[*HEADER, *LAG_HEADER], *(row_cells(row) for row in rows), total_cells(rows)]
    if not address:
        grid = [cells[:_ADDRESS] + cells[_ADDRESS + 1 :] for cells in grid]
    numeric_from = _NUMERIC_FROM - (0 if address else 1)
    widths = [max(len(cells[i]) for cells in grid) for i in range(len(grid[0]))]

    def text(cells: list[str]) -> str:
        return _GAP.join(
            cell.rjust(width) if i >= numeric_from else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    header, *body, total = (text(cells) for cells in grid)
    return Table(
        header=Line(header, "header"),
        rows=[
            Line(line, "row" if row.sample is not None else "down")
            for line, row in zip(body, rows, strict=True)
        ],
        total=Line(total, "total"),
        notes=[Line(f"{row.name}: {row.error}", "note") for row in rows if row.error],
        width=sum(widths) + len(_GAP) * (len(widths) - 1),
    )


def fit(title: str, rows: list[Row], width: int, height: int) -> list[Line]:
    """The lines for a terminal of ``width`` x ``height``: the title and the table, with
    its address column left out if that makes it fit; the notes, then broker rows, left
    out (and said so) when the terminal is too short; else a message that the
    terminal is too small and how much it needs."""
    full = table(rows)
    narrow = table(rows, address=False)
    shown = full if full.width <= width else narrow
    # The title, the header, one broker, a line saying how many more, the total.
    least = 5 if len(shown.rows) > 1 else 4
    if shown.width > width or height < least:
        return too_small(narrow.width, least, width, height)
    head = [Line(title[:width], "title"), shown.header]
    notes = [Line(note.text[:width], note.style) for note in shown.notes]
    for lines in ([*head, *shown.rows, shown.total, *notes], [*head, *shown.rows, shown.total]):
        if len(lines) <= height:
            return lines
    kept = height - 4
    hidden = len(shown.rows) - kept
    more = Line(f"... {hidden} more brokers: make the terminal taller"[:width], "note")
    return [*head, *shown.rows[:kept], more, shown.total]


def too_small(need_width: int, need_height: int, width: int, height: int) -> list[Line]:
    """Says so, wrapped to ``width``, as much of it as ``height`` holds."""
    message = (
        f"The terminal is too small for meshbus top: it needs {need_width}x{need_height}, "
        f"this one is {width}x{height}. Make it larger, or press q to quit."
    )
    return [Line(text, "note") for text in textwrap.wrap(message, max(width, 1))[:height]]
