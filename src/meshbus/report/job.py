"""The report's Spark job: find the streams, start Spark, read them, compute the numbers.

Three steps, each its own function so the command can show progress between them:

* ``discover`` (the client, no Spark): every ``telemetry.*`` and ``traces.*`` stream
  of the mesh and the range of seqs to read -- with ``--since``, found by a binary
  search on ``stored_at``, so a long-lived stream is not read from its start -- and
  which of the brokers asked for did not answer.
* ``local_spark``: a local[2] SparkSession whose JVM writes its log to a file
  instead of the terminal.
* ``read_streams`` and ``analyse``: the rows through the ``meshbus`` data source,
  then the functions of ``analysis`` collected into one JSON-able dict (the
  ``--json`` file, and what ``render`` draws).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from meshbus.client.brokers import broker_list
from meshbus.errors import MeshbusError
from meshbus.report import TELEMETRY_PREFIX, TRACES_PREFIX

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from meshbus.cli.common import Access
    from meshbus.client.connector import Connector

SERVER = "report"  # the server name of the report's connectors
MAX_POINTS = 600  # per broker and plot: longer windows are resampled into buckets
MAX_CHANGES = 1000  # connector changes kept in the JSON (the latest ones)
TRACE_MARGIN = 10.0  # with --since, also read traces this much older: entry hops
PROBE_TIMEOUT = 2.0  # for each broker asked for that the mesh does not list


class ReportError(Exception):
    """The report cannot be made; the message says why and what to do."""


class SparkFailed(ReportError):
    """Spark did not start, or its job failed: its log has the details."""


@dataclass(frozen=True)
class StreamPlan:
    """One stream to read: seqs ``start_seq`` through ``last_seq``, of which those from
    ``window_seq`` on were stored in the window (the rest: baseline, margin)."""

    name: str
    kind: str  # "telemetry" or "traces"
    host: str  # the broker that hosts it
    start_seq: int
    last_seq: int
    window_seq: int

    @property
    def records(self) -> int:
        return max(0, self.last_seq - self.start_seq + 1)

    @property
    def in_window(self) -> int:
        return max(0, self.last_seq - self.window_seq + 1)


@dataclass(frozen=True)
class Discovery:
    """What ``discover`` found: the streams to read, and the brokers asked for (in
    ``--brokers``) that did not answer, by address, with the error."""

    plans: list[StreamPlan]
    unanswered: dict[str, str]


# -- discover ------------------------------------------------------------------------------


def _kind(name: str) -> str | None:
    for kind, prefix in (("telemetry", TELEMETRY_PREFIX), ("traces", TRACES_PREFIX)):
        if name.startswith(prefix) and len(name) > len(prefix):
            return kind
    return None


async def discover(brokers: str, since_at: float | None, access: Access) -> Discovery:
    """The telemetry and trace streams of the mesh that ``brokers`` belong to, with the
    seqs to read: everything, or (``since_at``) from the first message stored at or
    after it -- one more for telemetry (the baseline of the first difference), and
    ``TRACE_MARGIN`` seconds more for traces (entry hops of the first deliveries).
    And which of ``brokers`` did not answer: each that the mesh does not list is asked
    itself (it may be in the mesh under another address)."""
    async with await access.connect(brokers, server=SERVER, operator=True) as conn:
        in_mesh = {*conn.brokers, conn.broker_address}
        listed = await conn.streams.list()
        plans = []
        for entry in sorted(listed, key=lambda e: str(e["name"])):
            name = str(entry["name"])
            kind = _kind(name)
            if kind is None:
                continue
            info = await conn.streams.info(name)
            start = window = info.first_seq
            if since_at is not None and info.last_seq >= info.first_seq:
                window = await _first_at(conn, name, since_at)
                if kind == "telemetry":
                    start = max(info.first_seq, window - 1)
                else:
                    start = await _first_at(conn, name, since_at - TRACE_MARGIN)
            plans.append(StreamPlan(name, kind, info.broker, start, info.last_seq, window))
    others = [address for address in broker_list(brokers) if address not in in_mesh]
    errors = await asyncio.gather(*(_no_answer(address, access) for address in others))
    return Discovery(plans, {a: e for a, e in zip(others, errors, strict=True) if e})


async def _no_answer(address: str, access: Access) -> str:
    """Why the broker at ``address`` does not take a connection ("" if it does)."""
    try:
        conn = await access.connect(
            address, server=SERVER, operator=True, failover=False, timeout=PROBE_TIMEOUT
        )
    except MeshbusError as exc:
        return str(exc)
    await conn.close()
    return ""


async def _first_at(conn: Connector, stream: str, since_at: float) -> int:
    """The first seq of ``stream`` stored at or after ``since_at`` (last_seq + 1 if
    none): a binary search, as stored_at only grows with seq."""
    info = await conn.streams.info(stream)
    low, high = info.first_seq, info.last_seq + 1
    while low < high:
        middle = (low + high) // 2
        page = await conn.streams.fetch(stream, middle, 1)
        if not page or page[0].stored_at >= since_at:
            high = middle
        else:
            low = page[0].seq + 1  # > middle if retention removed seqs meanwhile
    return low


# -- Spark ---------------------------------------------------------------------------------


def check_spark() -> None:
    """Fails with what to install when pyspark or Java is missing."""
    try:
        import matplotlib  # noqa: F401
        import pyarrow  # noqa: F401
        import pyspark  # noqa: F401
    except ImportError as exc:
        raise ReportError(
            f"meshbus report needs the spark extra ({exc.name} is missing): "
            "pip install 'meshbus[spark]'"
        ) from None
    if shutil.which("java") is None and "JAVA_HOME" not in os.environ:
        raise ReportError("Spark needs Java 17 or later: no java on PATH and no JAVA_HOME")


@contextlib.contextmanager
def local_spark(log: IO[bytes] | None = None) -> Iterator[SparkSession]:
    """A local[2] SparkSession with the ``meshbus`` data source, stopped on exit. Its
    JVM (and the Python workers it starts) write their output to ``log``. A session
    that is already running in this process is used as it is, and left running."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway
    from pyspark.sql import SparkSession

    import meshbus.spark

    if SparkContext._active_spark_context is not None:
        spark = SparkSession.builder.getOrCreate()
        meshbus.spark.register(spark)
        yield spark
        return
    conf = SparkConf().setAll(
        [
            ("spark.master", "local[2]"),
            ("spark.app.name", "meshbus-report"),
            ("spark.ui.enabled", "false"),
            ("spark.ui.showConsoleProgress", "false"),
            ("spark.sql.shuffle.partitions", "2"),
            ("spark.default.parallelism", "2"),
            ("spark.sql.session.timeZone", "UTC"),
            # Telemetry is small (a record per broker and interval): compiling whole-stage
            # code for each of the report's queries costs more time than it saves.
            ("spark.sql.codegen.wholeStage", "false"),
            *_SMALL_DATA.items(),
        ]
    )
    redirect = None if log is None else {"stdout": log, "stderr": log}
    try:
        gateway = launch_gateway(conf, popen_kwargs=redirect)  # type: ignore[no-untyped-call]
        context = SparkContext(conf=conf, gateway=gateway)
    except Exception as exc:
        raise SparkFailed(f"Spark did not start: {summarize(exc)}") from exc
    context.setLogLevel("ERROR")
    spark = SparkSession.builder.getOrCreate()
    meshbus.spark.register(spark)
    try:
        yield spark
    finally:
        spark.stop()


# Adaptive execution re-plans every stage of a query as it runs; on the report's few
# thousand records that costs more than it saves (``analyse`` of the tests' records on a
# warm session: a median 7.1 s with it, 5.5 s without). Set for the report's own session,
# and for the length of ``analyse`` on a session it is given.
_SMALL_DATA = {"spark.sql.adaptive.enabled": "false"}


@contextlib.contextmanager
def tuned_for_small_data(spark: SparkSession) -> Iterator[None]:
    """``_SMALL_DATA`` set on ``spark`` until the block ends, then what it was before."""
    before: dict[str, str | None] = {key: spark.conf.get(key, None) for key in _SMALL_DATA}
    for key, value in _SMALL_DATA.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, was in before.items():
            if was is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, was)


def summarize(exc: BaseException) -> str:
    """The line of a Spark error (a Python traceback inside a JVM stack trace) that says
    what went wrong: the last ``meshbus...Error: ...`` line, else the first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("meshbus.") and ": " in line:
            return line.split(": ", 1)[1]
    return lines[0] if lines else type(exc).__name__


def read_streams(
    spark: SparkSession, brokers: str, plans: list[StreamPlan], access: dict[str, str]
) -> DataFrame:
    """The messages of ``plans``' streams, in the ``meshbus`` data source's columns;
    ``access``, its options that sign in and turn TLS on (``Access.data_source_options``).

    The one place that reads the bus: to read some other way (the client's
    ``conn.streams.fetch``), return the same columns (``meshbus.spark.SCHEMA``)."""
    from pyspark.sql import DataFrame

    from meshbus.spark import SCHEMA

    frames = [
        spark.read.format("meshbus")
        .option("brokers", brokers)
        .option("server", SERVER)
        .option("stream", plan.name)
        .option("startingSeq", str(plan.start_seq))
        .option("endingSeq", str(plan.last_seq))  # what was there at discovery
        .options(**access)
        .load()
        for plan in plans
        if plan.records > 0
    ]
    if not frames:
        return spark.createDataFrame([], SCHEMA)
    return functools.reduce(DataFrame.unionByName, frames)


# -- analyse -------------------------------------------------------------------------------


def _value(value: Any) -> Any:
    """A collected value as JSON has it: NaN and infinities (a broker may write them)
    become None, also inside arrays."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_value(v) for v in value]
    return value


def rows(frame: DataFrame, *order: str) -> list[dict[str, Any]]:
    """``frame`` collected as plain dicts (NaN and infinities as None)."""
    ordered = frame.orderBy(*order) if order else frame
    return [{k: _value(v) for k, v in row.asDict().items()} for row in ordered.collect()]


def analyse(
    telemetry_raw: DataFrame,
    traces_raw: DataFrame,
    *,
    since_at: float | None = None,
    max_points: int = MAX_POINTS,
    unanswered: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Every number of the report, as a JSON-able dict (docs/report.md describes it).

    ``since_at`` (Unix time) leaves out samples and deliveries before it; samples just
    before it still serve as the baseline of the first difference. A broker with more
    than ``max_points`` samples has its time series resampled into that many buckets.
    ``unanswered``: the brokers asked for that did not answer (``Discovery``)."""
    with tuned_for_small_data(telemetry_raw.sparkSession):
        return _analyse(telemetry_raw, traces_raw, since_at, max_points, unanswered or {})


def _analyse(
    telemetry_raw: DataFrame,
    traces_raw: DataFrame,
    since_at: float | None,
    max_points: int,
    unanswered: dict[str, str],
) -> dict[str, Any]:
    from pyspark.sql import functions as F

    from meshbus.report import analysis as A

    telemetry = A.parse_telemetry(telemetry_raw).cache()
    traces = A.parse_traces(traces_raw).cache()
    in_window = F.lit(True) if since_at is None else F.col("at") >= F.lit(since_at)
    deltas = A.counter_deltas(telemetry).where(in_window).cache()
    samples = telemetry.where(in_window)
    lat = A.latencies(traces).where(in_window).cache()
    try:
        brokers = rows(A.broker_summary(samples), "broker")
        if not brokers:
            raise ReportError(
                "the telemetry streams hold no telemetry records"
                + ("" if since_at is None else " in the window asked for (--since)")
            )
        start = min(b["first_at"] for b in brokers)
        end = max(b["last_at"] for b in brokers)
        interval = max((b["interval"] or 0.0) for b in brokers) or 1.0
        most = max(b["samples"] for b in brokers)
        resolution = max(end - start, 1e-3) / max_points if most > max_points else None
        resampled = deltas if resolution is None else A.resample(deltas, resolution)
        columns = ("broker", "at", "dt", "restart", "connectors", *_RATES, "drops", *A.ERRORS)
        series = rows(A.errors_over_time(A.throughput(resampled)).select(*columns), "broker", "at")
        totals = rows(A.error_totals(deltas), "broker")
        restarts = {t["broker"]: t["restarts"] for t in totals}
        for broker in brokers:
            broker["restarts"] = restarts.get(broker["broker"], 0)
        changes = rows(A.connector_changes(telemetry).where(in_window), "at", "broker")
        width = max(interval, resolution or 0.0)
        events = A.event_occurrences(A.mesh_events(samples))
        stats = rows(A.latency_stats(lat), "path")
        cdf = {
            s["path"]: [list(p) for p in zip(A.CDF_FRACTIONS, s.pop("cdf"), strict=True)]
            for s in stats
        }
        return {
            "window": {"start": start, "end": end, "since_at": since_at},
            "brokers": brokers,
            "unreachable": with_unanswered(rows(A.unreachable(samples), "broker"), unanswered),
            "events": rows(events, "at", "kind", "broker"),
            "throughput": {
                "resolution": resolution,
                "series": [_pick(p, ("restart", *_RATES)) for p in series if p["dt"]],
                "summary": rows(A.throughput_summary(deltas), "broker"),
            },
            "connectors": {
                "series": [_pick(p, ("connectors",)) for p in series],
                "peer_views": rows(A.peer_view_series(samples, width), "broker", "at"),
                "totals": rows(A.connector_totals(samples, width), "at"),
                "changes": changes[-MAX_CHANGES:],
                "change_count": len(changes),
            },
            "errors": {
                "series": [_pick(p, ("dt", "drops", *A.ERRORS)) for p in series if p["dt"]],
                "totals": totals,
                "total": {
                    c: sum(t[c] for t in totals) for c in (*A.ERRORS, "requests", "restarts")
                },
            },
            "latency": {
                "traces": rows(A.trace_counts(traces), "hop"),
                "percentiles": stats,
                "cdf": cdf,
            },
        }
    finally:
        for frame in (telemetry, traces, deltas, lat):
            frame.unpersist()


_RATES = ("msgs_in_per_s", "msgs_out_per_s", "requests_per_s")


def _pick(point: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {"broker": point["broker"], "at": point["at"], **{k: point[k] for k in keys}}


def report_data(
    spark: SparkSession,
    brokers: str,
    found: Discovery,
    *,
    since_at: float | None = None,
    access: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Read the streams ``discover`` found and ``analyse`` them, with what was read and
    when, and the brokers asked for that did not answer; ``access`` as for
    ``read_streams``."""
    from pyspark.sql import functions as F

    plans = found.plans

    # All streams in one stage (in parallel, and the data source's Python workers start
    # once), kept in memory for the analyses that follow.
    raw = read_streams(spark, brokers, plans, access or {}).cache()
    try:
        planned = sum(p.records for p in plans)
        if planned and not raw.count():
            raise SparkFailed(
                f"the streams hold {planned:,} messages, but the meshbus data source read "
                "none of them (do the brokers run an older meshbus than this command?)"
            )
        telemetry = raw.where(F.col("stream").startswith(TELEMETRY_PREFIX))
        traces = raw.where(F.col("stream").startswith(TRACES_PREFIX))
        data = analyse(telemetry, traces, since_at=since_at, unanswered=found.unanswered)
    finally:
        raw.unpersist()
    return {
        "generated_at": time.time(),
        "brokers_asked": brokers,
        "streams": [
            {
                "name": p.name,
                "kind": p.kind,
                "host": p.host,
                "first_seq": p.start_seq,
                "last_seq": p.last_seq,
            }
            for p in plans
        ],
        **data,
    }


def with_unanswered(
    unreachable: list[dict[str, Any]], unanswered: dict[str, str]
) -> list[dict[str, Any]]:
    """``unreachable`` (``analysis.unreachable``'s rows) with ``no_answer``, the error of
    each address asked for that did not answer: on the row of the broker its peers knew
    at that address, or on a row of its own (no name, nothing seen of it)."""
    by_address = {row["address"]: row for row in unreachable}
    merged = [{**row, "no_answer": unanswered.get(row["address"])} for row in unreachable]
    for address, error in unanswered.items():
        if address not in by_address:
            merged.append(
                {
                    "broker": None,
                    "address": address,
                    "last_seen": None,
                    "lost_at": None,
                    "how": None,
                    "reason": None,
                    "seen_by": [],
                    "no_answer": error,
                }
            )
    return merged
