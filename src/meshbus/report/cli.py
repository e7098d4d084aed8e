"""``meshbus report``: the brokers' telemetry and traces, through Spark, into one HTML file.

Finds the streams with the client first (fast: a wrong address or a mesh without
telemetry fails in a fraction of a second, before Spark's 6-10 s start), then
starts a local SparkSession, reads the streams with the ``meshbus`` data source,
and writes the report. Progress goes to stderr; Spark's own log goes to a file,
which is kept and named when something fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from meshbus.cli.common import Access, access_options, broker_option, run
from meshbus.report.job import Discovery, ReportError, StreamPlan

_EPILOG = """\b
Enable telemetry on every broker to report on:
  meshbus broker --telemetry-interval 1 ...
Each broker then appends a record every interval to the stream
telemetry.BROKER and sampled message traces to traces.BROKER, which
this command reads (any broker of the mesh relays them).
See docs/report.md."""


class _Progress:
    """One line per finished step on stderr, a spinner while a step runs."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(stderr=True, highlight=False)

    @contextlib.contextmanager
    def step(self, doing: str) -> Iterator[list[str]]:
        """A spinner with ``doing``; the step's result line is what the body appends
        to the yielded list (``doing`` itself by default)."""
        done: list[str] = []
        began = time.monotonic()
        from rich.markup import escape

        with self.console.status(escape(doing) + " ..."):
            yield done
        took = time.monotonic() - began
        line = escape(done[0] if done else doing)  # names of streams and brokers: data
        self.console.print(f"[green]✓[/green] {line} [dim]({took:.1f} s)[/dim]")


def _describe(found: Discovery) -> str:
    def streams(kind: str) -> str:
        chosen = [p for p in found.plans if p.kind == kind]
        records = sum(p.in_window for p in chosen)
        label = "trace" if kind == "traces" else kind
        return f"{len(chosen)} {label} stream{'s' * (len(chosen) != 1)} ({records:,} records)"

    silent = "".join(f"; {address} did not answer" for address in found.unanswered)
    return f"found {streams('telemetry')} and {streams('traces')}{silent}"


def _check_target(path: Path, option: str) -> None:
    if path.is_dir():
        raise click.BadParameter(f"{path} is a directory", param_hint=option)
    if not path.parent.is_dir():
        raise click.BadParameter(f"directory {path.parent} does not exist", param_hint=option)


@click.command(epilog=_EPILOG)
@broker_option(
    "--brokers",
    "--broker",
    "brokers",
    help_text="The mesh to report on: HOST:PORT, or several as HOST:PORT,HOST:PORT "
    "(the first that answers; any broker of the mesh will do).",
)
@click.option(
    "--out",
    "out",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The HTML report to write (one self-contained file).",
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the report's numbers to this JSON file.",
)
@click.option(
    "--since",
    type=click.FloatRange(0, min_open=True),
    default=None,
    metavar="SECONDS",
    help="Only the last SECONDS of telemetry and traces (default: all the streams hold).",
)
@access_options
def report(
    brokers: str, out: Path, json_out: Path | None, since: float | None, access: Access
) -> None:
    """Write an HTML report on a mesh from its brokers' telemetry and traces.

    Reads the streams telemetry.* and traces.* with a local Spark job and plots
    throughput per broker (msgs/s), latency percentiles per path (same broker,
    cross broker) from the sampled traces, connectors per broker over time
    (joins, drains, failovers) and drops and timeouts. Needs the spark extra
    (pip install 'meshbus[spark]') and Java 17+.

    \b
    With --creds and --tls-*, the Spark tasks open the same files: on one
    machine, as here, they are there.

    \b
    Exit codes: 0 written, 1 error (no broker reachable, no telemetry,
    Spark failed), 2 bad arguments.
    """
    _check_target(out, "'--out'")
    if json_out is not None:
        _check_target(json_out, "'--json'")
    progress = _Progress()
    since_at = None if since is None else time.time() - since
    from meshbus.report.job import check_spark, discover

    try:
        check_spark()
    except ReportError as exc:
        raise click.ClickException(str(exc)) from exc

    with progress.step(f"looking for telemetry streams through {brokers}") as done:
        found = run(discover(brokers, since_at, access))
        assert found is not None
        _check_telemetry(found.plans, brokers, since)  # a failed step gets no check mark
        done.append(_describe(found))
    data = _spark_job(progress, brokers, found, since_at, access)
    _write(progress, data, out, json_out)


def _check_telemetry(plans: list[StreamPlan], brokers: str, since: float | None) -> None:
    """ClickException unless the mesh has telemetry records to report on."""
    if not any(p.kind == "telemetry" for p in plans):
        raise click.ClickException(
            f"no telemetry streams (telemetry.BROKER) in the mesh of {brokers}: start the "
            "brokers with --telemetry-interval SECONDS (meshbus broker --telemetry-interval 1) "
            "and let them run for a few intervals"
        )
    if not any(p.in_window for p in plans if p.kind == "telemetry"):
        raise click.ClickException(
            "the telemetry streams hold no records"
            + (f" from the last {since:g} s" if since is not None else "")
            + ": are the brokers running with --telemetry-interval?"
        )


def _spark_job(
    progress: _Progress,
    brokers: str,
    found: Discovery,
    since_at: float | None,
    access: Access,
) -> dict[str, Any]:
    from meshbus.report.job import SparkFailed, local_spark, report_data, summarize

    # The JVM writes to the log for as long as it runs; a failure keeps the file.
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115
        prefix="meshbus-report-spark-", suffix=".log", delete=False
    )
    keep_log = False
    try:
        with contextlib.ExitStack() as stack:
            with progress.step("starting Spark (local[2]; takes 6-10 s)") as done:
                spark = stack.enter_context(local_spark(log))
                done.append(f"Spark {spark.version} started")
            streams = sum(1 for p in found.plans if p.records)
            with progress.step(f"reading {streams} stream(s) and computing") as done:
                try:
                    data = report_data(
                        spark,
                        brokers,
                        found,
                        since_at=since_at,
                        access=access.data_source_options(),
                    )
                except ReportError:
                    raise
                except Exception as exc:
                    raise SparkFailed(f"the Spark job failed: {summarize(exc)}") from exc
                done.append(_summary(data))
    except SparkFailed as exc:
        keep_log = True
        raise click.ClickException(f"{exc} (Spark's log: {log.name})") from exc
    except ReportError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        log.close()
        if not keep_log:
            os.unlink(log.name)
    return data


def _summary(data: dict[str, Any]) -> str:
    brokers = len(data["brokers"])
    samples = sum(b["samples"] for b in data["brokers"])
    deliveries = next((p["count"] for p in data["latency"]["percentiles"] if p["path"] == "all"), 0)
    return (
        f"{samples:,} telemetry samples from {brokers} broker(s), {deliveries:,} traced deliveries"
    )


def _write(progress: _Progress, data: dict[str, Any], out: Path, json_out: Path | None) -> None:
    from meshbus.report.plots import plots
    from meshbus.report.render import render_html

    with progress.step("plotting") as done:
        images = plots(data)
        done.append(f"plotted {sum(1 for i in images.values() if i)} figure(s)")
    page = render_html(data, images)
    try:
        out.write_text(page, encoding="utf-8")
        if json_out is not None:
            json_out.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n", "utf-8")
    except OSError as exc:
        raise click.ClickException(f"cannot write the report: {exc}") from exc
    from rich.markup import escape

    wrote = escape(f"wrote {out} ({len(page) / 1024:,.0f} KiB)")
    progress.console.print(f"[green]✓[/green] {wrote}")
    if json_out is not None:
        progress.console.print(f"[green]✓[/green] {escape(f'wrote {json_out}')}")
