"""The report's plots: matplotlib figures as PNG data URIs.

Takes the dict ``job.analyse`` made (the ``--json`` file). Uses ``Figure`` with the
Agg canvas directly: no pyplot, no display, no global state, safe in any thread.
Broker names are drawn literally (a ``$`` starts no mathtext). The mesh's events
(joins, drains, leaves, crashes) are vertical lines across every time plot.
"""

from __future__ import annotations

import base64
import io
import math
import textwrap
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from matplotlib import dates as mdates
from matplotlib import ticker
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from meshbus.report.analysis import (
    ALL_PATHS,
    CRASH,
    CROSS_BROKER,
    DRAIN,
    JOIN,
    LEAVE,
    SAME_BROKER,
    UNKNOWN_PATH,
)

PLOTS = ("throughput", "latency", "connectors", "errors")
PATH_ORDER = (SAME_BROKER, CROSS_BROKER, UNKNOWN_PATH, ALL_PATHS)
EVENT_COLORS = {JOIN: "tab:green", DRAIN: "tab:orange", LEAVE: "tab:gray", CRASH: "tab:red"}
# Events closer than this share of the time axis share one line and one label: the
# labels of a mesh's start (every broker joins within a second) would overlap.
_EVENT_MERGE = 0.02


def _png(figure: Figure) -> str:
    """``figure`` as a data URI (PNG, base64)."""
    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _colors(names: Iterable[str]) -> dict[str, Any]:
    """One color per broker, the same in every plot."""
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    return {name: palette(i % palette.N) for i, name in enumerate(sorted(set(names)))}


def _time_axis(axes: Axes) -> None:
    locator = mdates.AutoDateLocator(tz=UTC)  # type: ignore[no-untyped-call]
    axes.xaxis.set_major_locator(locator)
    formatter = mdates.ConciseDateFormatter(locator, tz=UTC)  # type: ignore[no-untyped-call]
    axes.xaxis.set_major_formatter(formatter)
    axes.grid(True, alpha=0.3)


def _times(points: Sequence[dict[str, Any]]) -> Any:
    """The points' times as matplotlib date numbers (UTC)."""
    stamps = [datetime.fromtimestamp(p["at"], UTC) for p in points]
    return mdates.date2num(stamps)  # type: ignore[no-untyped-call]


def _by_broker(points: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = {}
    for point in points:
        grouped.setdefault(point["broker"], []).append(point)
    return grouped


def _label(text: str) -> str:
    """``text`` as matplotlib shows it literally: no mathtext between two ``$``."""
    return text.replace("$", r"\$")


def _clock(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%H:%M:%S")


def coverage(data: dict[str, Any]) -> str:
    """Which brokers the mesh's connector totals add up: those with telemetry of their
    own, and those only their peers saw -- with when they went, if they did -- and the
    ones asked for that nothing was seen of (not counted)."""
    own = sorted(b["broker"] for b in data["brokers"])
    seen = sorted({p["broker"] for p in data["connectors"]["peer_views"]})
    gone = {u["broker"]: u for u in data["unreachable"]}
    notes = []
    for name in seen:
        note = f"{name}: as its peers saw it"
        if name in gone:
            went = gone[name]
            state = "left" if went["how"] == LEAVE else "unreachable"
            since = went["lost_at"] or went["last_seen"]
            note += f", {state} since {_clock(since)} UTC" if since else f", {state}"
        notes.append(note)
    notes += [
        f"{u['broker'] or u['address']}: unreachable, not counted"
        for u in data["unreachable"]
        if u["broker"] not in seen
    ]
    return ", ".join(own + seen) + (f" ({'; '.join(notes)})" if notes else "")


def _panels(count: int) -> tuple[Figure, list[Axes]]:
    """A figure of ``count`` panels, one above the other, sharing the time axis."""
    figure = Figure(figsize=(10, 2.6 * count + 0.8), layout="constrained")
    axes_list = list(figure.subplots(count, 1, sharex=True, squeeze=False)[:, 0])
    axes_list[-1].set_xlabel("time (UTC)")
    return figure, axes_list


def _style(axes: Axes, title: str, label: str, *, counts: bool = False) -> None:
    axes.set_title(title, loc="left", fontsize=11)
    axes.set_ylabel(label)
    axes.set_ylim(bottom=0)
    axes.margins(y=0.08)
    if counts:  # whole numbers on the y axis, up to 1 at least (all zero: no 0.054)
        axes.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        axes.set_ylim(top=max(axes.get_ylim()[1], 1.0))
    _time_axis(axes)


def _broker_lines(
    axes: Axes,
    points: Sequence[dict[str, Any]],
    key: str,
    colors: dict[str, Any],
    *,
    step: bool = False,
    dashed: bool = False,
) -> None:
    """A line per broker of ``points[key]`` over time."""
    style = "--" if dashed else "-"
    for broker, series in sorted(_by_broker(points).items()):
        ys = [p[key] for p in series]
        if step:
            axes.step(_times(series), ys, where="post", color=colors[broker], ls=style)
        else:
            marker = "." if len(series) <= 60 else ""
            axes.plot(_times(series), ys, marker=marker, color=colors[broker], ls=style)


def _legend(figure: Figure, colors: dict[str, Any], dashed: Iterable[str] = ()) -> None:
    """The brokers' colors, above the panels; ``dashed``, the brokers drawn as their
    peers saw them."""
    from matplotlib.lines import Line2D

    dashed = sorted(dashed)
    solid = [broker for broker in colors if broker not in dashed]
    handles = [Line2D([], [], color=colors[broker]) for broker in solid]
    labels = [_label(broker) for broker in solid]
    for broker in dashed:
        handles.append(Line2D([], [], color=colors[broker], ls="--"))
        labels.append(_label(f"{broker}, as its peers saw it"))
    figure.legend(
        handles, labels, loc="outside upper left", ncols=min(len(labels), 6), frameon=False
    )


def _mark_events(axes_list: Sequence[Axes], events: Sequence[dict[str, Any]]) -> None:
    """A vertical line per event across every panel, labelled in the top one; events
    closer than ``_EVENT_MERGE`` of the time axis share a line, colored by the first."""
    ordered = sorted(events, key=lambda e: e["at"])
    if not ordered:
        return
    low, high = axes_list[0].get_xlim()
    near = (high - low) * _EVENT_MERGE
    groups: list[tuple[float, list[dict[str, Any]]]] = []
    last = -math.inf
    for x, event in zip(_times(ordered), ordered, strict=True):
        if x - last >= near:
            groups.append((x, []))
        groups[-1][1].append(event)
        last = x
    for x, group in groups:
        color = EVENT_COLORS.get(group[0]["kind"], "black")
        for axes in axes_list:
            axes.axvline(x, color=color, ls="--", lw=1, alpha=0.8)
        label = ", ".join(f"{e['kind']} {e['broker']}" for e in group)
        top = axes_list[0]
        top.text(
            x,
            0.98,
            " " + _label(label),
            transform=top.get_xaxis_transform(),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color=color,
        )


def plot_throughput(data: dict[str, Any], colors: dict[str, Any]) -> Figure | None:
    points = data["throughput"]["series"]
    if not points:
        return None
    figure, (into, out) = _panels(2)
    _broker_lines(into, points, "msgs_in_per_s", colors)
    _style(into, "messages in (from connectors and peers)", "msgs/s")
    _broker_lines(out, points, "msgs_out_per_s", colors)
    _style(out, "messages out (to connectors and peers)", "msgs/s")
    restarts = [p for p in points if p.get("restart")]
    for axes in (into, out):  # a dotted line where a broker restarted
        for at, point in zip(_times(restarts), restarts, strict=True):
            axes.axvline(at, color=colors[point["broker"]], ls=":", lw=1)
    _mark_events((into, out), data["events"])
    _legend(figure, colors)
    return figure


def plot_connectors(data: dict[str, Any], colors: dict[str, Any]) -> Figure | None:
    points = data["connectors"]["series"]
    if not points:
        return None
    totals = data["connectors"]["totals"]
    views = data["connectors"]["peer_views"]
    mesh = len(colors) > 1 and bool(totals)
    figure, panels = _panels(2 if mesh else 1)
    _broker_lines(panels[0], points, "connectors", colors, step=True)
    _broker_lines(panels[0], views, "connectors", colors, step=True, dashed=True)
    _style(panels[0], "connectors per broker", "connectors", counts=True)
    if mesh:  # where a failover is a dip and a rebalance is not
        ys = [t["connectors"] for t in totals]
        panels[1].step(_times(totals), ys, where="post", color="black")
        title = textwrap.fill(f"connectors of the whole mesh: {coverage(data)}", 110)
        _style(panels[1], _label(title), "connectors", counts=True)
    _mark_events(panels, data["events"])
    _legend(figure, colors, dashed={p["broker"] for p in views})
    return figure


def plot_errors(data: dict[str, Any], colors: dict[str, Any]) -> Figure | None:
    points = data["errors"]["series"]
    if not points:
        return None
    figure, (drops, timeouts) = _panels(2)
    _broker_lines(drops, points, "drops", colors)
    _style(drops, "dropped: no route, too large, bad hop", "per interval", counts=True)
    _broker_lines(timeouts, points, "timeouts", colors)
    _style(timeouts, "request timeouts", "per interval", counts=True)
    _mark_events((drops, timeouts), data["events"])
    _legend(figure, colors)
    return figure


def plot_latency(data: dict[str, Any]) -> Figure | None:
    cdf: dict[str, list[list[float]]] = data["latency"]["cdf"]
    paths = [p for p in PATH_ORDER if p in cdf and p != ALL_PATHS] or [
        p for p in cdf if p != ALL_PATHS
    ]
    if not paths:
        return None
    figure = Figure(figsize=(10, 4), layout="constrained")
    axes = figure.subplots()
    lowest = min((ms for path in paths for _, ms in cdf[path] if ms is not None), default=0.0)
    for path in paths:
        xs, ys = [ms for _, ms in cdf[path]], [f for f, _ in cdf[path]]
        axes.plot(xs, ys, label=path, lw=1.5)
    if lowest > 0:
        axes.set_xscale("log")
        plain = ticker.FuncFormatter(lambda value, _: f"{value:g}")
        axes.xaxis.set_major_formatter(plain)
        axes.xaxis.set_minor_formatter(ticker.NullFormatter())
    axes.set_xlabel("latency, sent to received (ms)" + (", log scale" if lowest > 0 else ""))
    axes.set_ylabel("fraction of deliveries")
    axes.set_ylim(0, 1.01)
    axes.set_title("latency CDF per path", loc="left", fontsize=11)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right", fontsize=9)
    return figure


def plots(data: dict[str, Any]) -> dict[str, str | None]:
    """Every plot of the report as a PNG data URI; None where there is nothing to draw."""
    series = (
        data["throughput"]["series"],
        data["connectors"]["series"],
        data["connectors"]["peer_views"],
        data["brokers"],
    )
    colors = _colors(p["broker"] for points in series for p in points)
    # Only the connectors plot has the brokers without telemetry here (as their peers
    # saw them): the others' legends leave them out.
    own = {b["broker"] for b in data["brokers"]}
    with_telemetry = {name: color for name, color in colors.items() if name in own}
    figures = {
        "throughput": plot_throughput(data, with_telemetry),
        "latency": plot_latency(data),
        "connectors": plot_connectors(data, colors),
        "errors": plot_errors(data, with_telemetry),
    }
    return {name: None if fig is None else _png(fig) for name, fig in figures.items()}
