"""The report's plots: matplotlib figures as PNG data URIs.

Takes the dict ``job.analyse`` made (the ``--json`` file). Uses ``Figure`` with the
Agg canvas directly: no pyplot, no display, no global state, safe in any thread.
Broker names are drawn literally (a ``$`` starts no mathtext).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from matplotlib import dates as mdates
from matplotlib import ticker
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from meshbus.report.analysis import ALL_PATHS, CROSS_BROKER, SAME_BROKER, UNKNOWN_PATH

PLOTS = ("throughput", "latency", "connectors", "errors")
PATH_ORDER = (SAME_BROKER, CROSS_BROKER, UNKNOWN_PATH, ALL_PATHS)


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
) -> None:
    """A line per broker of ``points[key]`` over time."""
    for broker, series in sorted(_by_broker(points).items()):
        ys = [p[key] for p in series]
        if step:
            axes.step(_times(series), ys, where="post", color=colors[broker])
        else:
            marker = "." if len(series) <= 60 else ""
            axes.plot(_times(series), ys, marker=marker, color=colors[broker])


def _legend(figure: Figure, colors: dict[str, Any]) -> None:
    """The brokers' colors, above the panels."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=color) for color in colors.values()]
    labels = [_label(broker) for broker in colors]
    figure.legend(
        handles, labels, loc="outside upper left", ncols=min(len(labels), 6), frameon=False
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
    _legend(figure, colors)
    return figure


def plot_connectors(data: dict[str, Any], colors: dict[str, Any]) -> Figure | None:
    points = data["connectors"]["series"]
    if not points:
        return None
    totals = data["connectors"]["totals"]
    mesh = len(colors) > 1 and bool(totals)
    figure, panels = _panels(2 if mesh else 1)
    _broker_lines(panels[0], points, "connectors", colors, step=True)
    _style(panels[0], "connectors per broker", "connectors", counts=True)
    if mesh:  # where a failover is a dip and a rebalance is not
        ys = [t["connectors"] for t in totals]
        panels[1].step(_times(totals), ys, where="post", color="black")
        _style(panels[1], "connectors of the whole mesh", "connectors", counts=True)
    _legend(figure, colors)
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
    series = (data["throughput"]["series"], data["connectors"]["series"], data["brokers"])
    colors = _colors(p["broker"] for points in series for p in points)
    figures = {
        "throughput": plot_throughput(data, colors),
        "latency": plot_latency(data),
        "connectors": plot_connectors(data, colors),
        "errors": plot_errors(data, colors),
    }
    return {name: None if fig is None else _png(fig) for name, fig in figures.items()}
