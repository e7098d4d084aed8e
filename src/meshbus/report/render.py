"""The report as one self-contained HTML file: tables, and the plots as PNG data URIs.

Takes the dict ``job.analyse`` made (the ``--json`` file) and nothing else, so a
report can be drawn again from its JSON. Every text that came from the bus -- broker
names, addresses -- is HTML-escaped. No external resources: no scripts, fonts, style
sheets or images from anywhere else.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from string import Template
from typing import Any

from meshbus.report.analysis import CRASH, LEAVE, STALE_BUCKETS
from meshbus.report.plots import PATH_ORDER, coverage, plots

MAX_CHANGE_ROWS = 50

_PAGE = Template(
    """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>$title</title>
<style>
body { font: 15px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.8em 0; }
th, td { padding: 0.25em 0.8em; border-bottom: 1px solid #e4e4e4; text-align: right; }
th { background: #f4f4f4; }
th:first-child, td:first-child { text-align: left; }
tr.total td { font-weight: bold; }
img { max-width: 100%; display: block; margin: 0.8em 0; }
.meta, .note { color: #555; }
</style>
</head>
<body>
<h1>$title</h1>
<p class="meta">$meta</p>
$body
</body>
</html>
"""
)


# -- formatting ---------------------------------------------------------------------------


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def when(at: float | None) -> str:
    """A Unix time as UTC, to the millisecond."""
    if at is None:
        return "-"
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _ms(value: float | None) -> str:
    """Milliseconds: three decimals below 10 ms, one from there on."""
    if value is None:
        return "-"
    if abs(round(value, 3)) < 10:
        return f"{value:.3f}"
    return f"{value:,.1f}"


def _table(
    headers: Sequence[str], body: Iterable[Sequence[str]], total: Sequence[str] | None = None
) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    lines = ["<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in row) + "</tr>" for row in body]
    if total is not None:
        lines.append('<tr class="total">' + "".join(f"<td>{_esc(c)}</td>" for c in total) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(lines)}</tbody></table>"


def _note(text: str) -> str:
    return f'<p class="note">{_esc(text)}</p>'


def _img(uri: str, alt: str) -> str:
    return f'<img src="{_esc(uri)}" alt="{_esc(alt)}">'


# -- sections ---------------------------------------------------------------------------


def _streams_section(data: dict[str, Any]) -> str:
    body = [
        (s["name"], s["kind"], s["host"], f"{s['first_seq']}..{s['last_seq']}")
        for s in data["streams"]
    ]
    return "<h2>Streams read</h2>" + _table(("stream", "kind", "host broker", "seqs"), body)


def _brokers_section(data: dict[str, Any]) -> str:
    body = [
        (
            b["broker"],
            _count(b["samples"]),
            when(b["first_at"]),
            when(b["last_at"]),
            _count(b["restarts"]),
            _count(b["connectors"]),
            f"{_count(b['min_connectors'])}..{_count(b['max_connectors'])}",
        )
        for b in data["brokers"]
    ]
    headers = ("broker", "samples", "first", "last", "restarts", "connectors", "range")
    parts = ["<h2>Brokers</h2>", _table(headers, body)]
    if not data["unreachable"]:
        parts.append(_note("Every broker the others had as a peer is still in the mesh."))
    return "".join(parts)


def _gone_how(row: dict[str, Any]) -> str:
    if row["how"] is None:
        return "-"
    what = {CRASH: "crashed", LEAVE: "left"}.get(row["how"], row["how"])
    return f"{what} ({row['reason']})" if row["reason"] else what


def _unreachable_section(data: dict[str, Any]) -> str:
    gone = data["unreachable"]
    if not gone:
        return ""
    body = [
        (
            u["broker"] or "?",
            u["address"] or "-",
            when(u["last_seen"]),
            when(u["lost_at"]),
            _gone_how(u),
            ", ".join(u["seen_by"]) or "-",
            u["no_answer"] or "-",
        )
        for u in gone
    ]
    headers = ("broker", "address", "last seen", "lost", "how", "seen by", "report's connection")
    return (
        "<h2>Unreachable brokers</h2>"
        + _table(headers, body)
        + _note(
            "Brokers gone from the mesh: the others had them as a peer (or recorded an "
            "event of them), no broker has them as a peer any more, and their own "
            "telemetry went with them. Last seen: the last time a broker had it as a "
            "peer, or heard from it before its link closed. Lost: when its link closed "
            "(a crash: without a goodbye). An address given in --brokers that did not "
            "answer is listed with the error."
        )
    )


def _events_section(data: dict[str, Any]) -> str:
    events = data["events"]
    parts = ["<h2>Mesh events</h2>"]
    if not events:
        parts.append(_note("No broker recorded a join, drain, leave or crash in the window."))
        return "".join(parts)
    body = [
        (
            when(e["at"]),
            e["kind"],
            e["broker"],
            ", ".join(e["seen_by"]),
            e["reason"] or "-",
            when(e["last_heard"]),
        )
        for e in events
    ]
    parts.append(_table(("time", "event", "broker", "seen by", "reason", "last heard"), body))
    parts.append(
        _note(
            "From the brokers' telemetry: each records the joins, drains, leaves (with a "
            "goodbye) and crashes (without) it sees, its own and its peers'. An event "
            "recorded by several brokers is listed once, at the first record. Dashed "
            "lines mark them on the time plots."
        )
    )
    return "".join(parts)


def _throughput_section(data: dict[str, Any], image: str | None) -> str:
    summary = data["throughput"]["summary"]
    body = [
        (
            s["broker"],
            _rate(s["mean_msgs_in_per_s"]),
            _rate(s["peak_msgs_in_per_s"]),
            _rate(s["mean_msgs_out_per_s"]),
            _rate(s["peak_msgs_out_per_s"]),
            _rate(s["mean_requests_per_s"]),
        )
        for s in summary
    ]
    headers = ("broker", "in msgs/s", "peak in", "out msgs/s", "peak out", "requests/s")
    resolution = data["throughput"]["resolution"]
    parts = ["<h2>Throughput</h2>"]
    parts.append(_img(image, "throughput per broker") if image else _note("Only one sample."))
    if resolution:
        parts.append(_note(f"Plotted in buckets of {resolution:.3g} s."))
    parts.append(_table(headers, body))
    parts.append(
        _note(
            "Rates are differences of the brokers' cumulative counters. A broker "
            "that restarted counts from 0 again: its rate there covers one telemetry "
            "interval, and a dotted line marks it."
        )
    )
    return "".join(parts)


def _latency_section(data: dict[str, Any], image: str | None) -> str:
    latency = data["latency"]
    parts = ["<h2>Latency</h2>"]
    stats = sorted(
        latency["percentiles"],
        key=lambda s: PATH_ORDER.index(s["path"]) if s["path"] in PATH_ORDER else 0,
    )
    if not stats:
        parts.append(
            _note(
                "No sampled message was received in the window: no latencies. "
                "Traces come from the traces.<broker> streams."
            )
        )
    else:
        parts.append(_img(image, "latency CDF per path") if image else "")
        body = [
            (
                s["path"],
                _count(s["count"]),
                *(_ms(s[k]) for k in ("mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms")),
            )
            for s in stats
        ]
        headers = ("path", "deliveries", "mean ms", "p50 ms", "p90 ms", "p99 ms", "max ms")
        parts.append(_table(headers, body))
        parts.append(
            _note(
                "From sent (the sending connector's clock) to received (the "
                "receiving connector's broker). Same broker: the message entered "
                "and left the mesh at one broker; cross broker: at two."
            )
        )
    counts = [(t["hop"], _count(t["records"]), _count(t["messages"])) for t in latency["traces"]]
    if counts:
        parts.append(_table(("trace hop", "records", "messages"), counts))
    return "".join(parts)


def _connectors_section(data: dict[str, Any], image: str | None) -> str:
    connectors = data["connectors"]
    parts = ["<h2>Connectors</h2>"]
    if image:
        parts.append(_img(image, "connectors per broker"))
    parts.append(
        _note(
            f"The whole mesh: {coverage(data)}. At each interval each broker counts "
            "with its latest count (its own, or for a broker without telemetry here, "
            f"what its peers heard from it) if not older than {STALE_BUCKETS} intervals, "
            "and not after it left or crashed: connectors that fail over are counted once."
        )
    )
    changes = connectors["changes"][-MAX_CHANGE_ROWS:]
    if changes:
        body = [
            (
                when(c["at"]),
                c["broker"],
                _count(c["before"]),
                _count(c["after"]),
                f"{c['change']:+d}",
            )
            for c in changes
        ]
        parts.append(_table(("time", "broker", "before", "after", "change"), body))
        if connectors["change_count"] > len(changes):
            parts.append(
                _note(f"The last {len(changes)} of {connectors['change_count']:,} changes.")
            )
    else:
        parts.append(_note("No broker's connector count changed in the window."))
    return "".join(parts)


def _errors_section(data: dict[str, Any], image: str | None) -> str:
    errors = data["errors"]
    keys = (
        "dropped_no_route",
        "dropped_too_large",
        "dropped_bad_hop",
        "timeouts",
        "late_responses",
        "requests",
    )
    headers = (
        "broker",
        "no route",
        "too large",
        "bad hop",
        "timeouts",
        "late responses",
        "requests",
    )
    body = [(t["broker"], *(_count(t[k]) for k in keys)) for t in errors["totals"]]
    total = ("all brokers", *(_count(errors["total"][k]) for k in keys))
    parts = ["<h2>Drops and timeouts</h2>"]
    if image:
        parts.append(_img(image, "drops and timeouts per broker"))
    parts.append(_table(headers, body, total))
    return "".join(parts)


def render_html(data: dict[str, Any], images: dict[str, str | None] | None = None) -> str:
    """The whole report page."""
    images = plots(data) if images is None else images
    window = data["window"]
    meta = (
        f"Brokers asked: {data['brokers_asked']}. Window: {when(window['start'])} to "
        f"{when(window['end'])}. Generated {when(data['generated_at'])}."
    )
    body = "\n".join(
        [
            _brokers_section(data),
            _unreachable_section(data),
            _events_section(data),
            _throughput_section(data, images.get("throughput")),
            _latency_section(data, images.get("latency")),
            _connectors_section(data, images.get("connectors")),
            _errors_section(data, images.get("errors")),
            _streams_section(data),
        ]
    )
    return _PAGE.substitute(title="meshbus report", meta=_esc(meta), body=body)
