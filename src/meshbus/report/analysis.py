"""The report's numbers: pure functions from Spark DataFrames to Spark DataFrames.

Inputs are rows as the ``meshbus`` data source reads a stream (the payload is the
UTF-8 JSON record a broker wrote; docs/report.md has both record formats):

* ``telemetry.<broker>``: one record per broker every ``--telemetry-interval``
  seconds; its counters are cumulative since that broker started, so a counter
  that went *down* means the broker restarted (and started again from 0).
* ``traces.<broker>``: one record per hop of a sampled message -- ``entry``,
  ``exit``, ``received`` -- joined by (src, msg_id).

Nothing here collects to the driver or does I/O: every function takes and returns
DataFrames, so each can be tested on DataFrames built from handcrafted records.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from meshbus.report import TELEMETRY_PREFIX

# The cumulative counters of a telemetry record, in the order the report shows them.
COUNTERS = (
    "msgs_in",
    "msgs_out",
    "requests",
    "timeouts",
    "late_responses",
    "dropped_no_route",
    "dropped_too_large",
    "dropped_bad_hop",
)
DROPS = ("dropped_no_route", "dropped_too_large", "dropped_bad_hop")
ERRORS = (*DROPS, "timeouts", "late_responses")
GAUGES = ("connectors", "services", "routes", "pending")

SAME_BROKER = "same broker"
CROSS_BROKER = "cross broker"
UNKNOWN_PATH = "unknown"  # a received hop whose entry hop is not in the traces read
ALL_PATHS = "all"

# Percentiles of the latency table, and the points of the CDF plot.
PERCENTILES = {"p50_ms": 0.5, "p90_ms": 0.9, "p99_ms": 0.99}
CDF_FRACTIONS = (*(i / 100 for i in range(100)), 0.995, 0.999, 1.0)

_LINK = StructType(
    [
        StructField("id", LongType()),
        StructField("kind", StringType()),
        StructField("name", StringType()),
        *(
            StructField(name, LongType())
            for name in ("msgs_in", "msgs_out", "bytes_in", "bytes_out", "queued")
        ),
    ]
)
TELEMETRY_SCHEMA = StructType(
    [
        StructField("broker", StringType()),
        StructField("at", DoubleType()),
        StructField("interval", DoubleType()),
        *(StructField(name, LongType()) for name in GAUGES),
        StructField("counters", StructType([StructField(c, LongType()) for c in COUNTERS])),
        StructField("links", ArrayType(_LINK)),
    ]
)
TRACE_SCHEMA = StructType(
    [
        StructField("src", StringType()),
        StructField("msg_id", LongType()),
        StructField("dst", StringType()),
        StructField("hop", StringType()),
        StructField("broker", StringType()),
        StructField("at", DoubleType()),
        StructField("sent_at", DoubleType()),
    ]
)


def _record(raw: DataFrame, schema: StructType) -> DataFrame:
    """``raw`` with its JSON payload parsed into a struct column ``r`` (null fields for
    whatever is missing; a payload that is not a JSON object gives no ``r.at``)."""
    text = F.col("payload").cast("string")
    return raw.select("stream", F.from_json(text, schema).alias("r"))


def parse_telemetry(raw: DataFrame) -> DataFrame:
    """One row per telemetry record: broker, at, interval, the gauges (connectors,
    services, routes, pending), one column per counter, and links. Rows that are not
    telemetry records (no ``at``) are left out; a record without ``broker`` is named
    after its stream."""
    rec = _record(raw, TELEMETRY_SCHEMA)
    from_stream = F.regexp_replace("stream", "^" + TELEMETRY_PREFIX.replace(".", r"\."), "")
    return rec.where(F.col("r.at").isNotNull()).select(
        F.coalesce(F.col("r.broker"), from_stream).alias("broker"),
        F.col("r.at").alias("at"),
        F.col("r.interval").alias("interval"),
        *(F.col(f"r.{name}").alias(name) for name in GAUGES),
        *(F.col(f"r.counters.{name}").alias(name) for name in COUNTERS),
        F.col("r.links").alias("links"),
    )


def parse_traces(raw: DataFrame) -> DataFrame:
    """One row per trace record: src, msg_id, dst, hop, broker, at, sent_at. Rows without
    src, msg_id, hop, broker or at are left out."""
    rec = _record(raw, TRACE_SCHEMA)
    needed = ("src", "msg_id", "hop", "broker", "at")
    present = F.lit(True)
    for name in needed:
        present = present & F.col(f"r.{name}").isNotNull()
    return rec.where(present).select(*(F.col(f"r.{f.name}").alias(f.name) for f in TRACE_SCHEMA))


# -- counters: differences, rates, totals ------------------------------------------------


def counter_deltas(telemetry: DataFrame) -> DataFrame:
    """Per broker and sample: what each counter grew by since the broker's previous
    sample, and over how many seconds (``dt``).

    Columns: broker, at, connectors, restart, dt, and one column per counter. A broker's
    first sample only sets the baseline: its deltas and ``dt`` are null. A counter that
    went down means the broker restarted (``restart`` is true): it counted from 0 again,
    so its delta is its value, over ``min(interval, gap)`` seconds -- it had been up about
    one telemetry interval, not the whole gap, which includes the downtime.
    """
    order = Window.partitionBy("broker").orderBy("at")
    prev_at = F.lag("at").over(order)
    prev = {c: F.lag(c).over(order) for c in COUNTERS}
    restart = F.lit(False)
    for c in COUNTERS:
        restart = restart | F.coalesce(F.col(c) < prev[c], F.lit(False))
    gap = F.col("at") - F.col("prev_at")
    since_start = F.when(F.col("interval") > 0, F.least(F.col("interval"), gap)).otherwise(gap)
    staged = telemetry.select(
        "broker",
        "at",
        "interval",
        "connectors",
        *COUNTERS,
        prev_at.alias("prev_at"),
        restart.alias("restart"),
        *(prev[c].alias(f"prev_{c}") for c in COUNTERS),
    )
    first = F.col("prev_at").isNull()
    return staged.select(
        "broker",
        "at",
        "connectors",
        F.when(first, F.lit(None)).otherwise(F.col("restart")).cast("boolean").alias("restart"),
        F.when(first, F.lit(None))
        .when(F.col("restart"), since_start)
        .otherwise(gap)
        .cast("double")
        .alias("dt"),
        *(
            F.when(first, F.lit(None))
            .when(F.col("restart"), F.col(c))
            .otherwise(F.col(c) - F.col(f"prev_{c}"))
            .cast("long")
            .alias(c)
            for c in COUNTERS
        ),
    )


def resample(deltas: DataFrame, width: float) -> DataFrame:
    """``counter_deltas`` rows merged into buckets of ``width`` seconds per broker (so a
    long report plots a few hundred points, not one per sample): deltas and ``dt`` add
    up, ``at`` and ``connectors`` are those of the bucket's last sample, ``restart`` is
    true if any sample was one. Rates of the result are still exact averages."""
    bucket = F.floor(F.col("at") / F.lit(width)).alias("bucket")
    return (
        deltas.groupBy("broker", bucket)
        .agg(
            F.max("at").alias("at"),
            F.max_by("connectors", "at").alias("connectors"),
            F.max("restart").alias("restart"),
            F.sum("dt").alias("dt"),
            *(F.sum(c).cast("long").alias(c) for c in COUNTERS),
        )
        .drop("bucket")
    )


def _rate(column: str) -> Column:
    return F.when(F.col("dt") > 0, F.col(column) / F.col("dt"))


def throughput(deltas: DataFrame) -> DataFrame:
    """Messages per second per broker over time: ``deltas`` with msgs_in_per_s,
    msgs_out_per_s and requests_per_s added (null for a broker's first sample)."""
    return deltas.withColumns({f"{c}_per_s": _rate(c) for c in ("msgs_in", "msgs_out", "requests")})


def throughput_summary(deltas: DataFrame) -> DataFrame:
    """Per broker: the mean rates over the whole window (total messages / total seconds)
    and the peak rate of one interval."""
    rates = deltas.where(F.col("dt") > 0)
    summary = rates.groupBy("broker").agg(
        F.sum("dt").alias("seconds"),
        *(F.sum(c).alias(f"total_{c}") for c in ("msgs_in", "msgs_out", "requests")),
        *(F.max(_rate(c)).alias(f"peak_{c}_per_s") for c in ("msgs_in", "msgs_out")),
    )
    return summary.select(
        "broker",
        "seconds",
        *(
            (F.col(f"total_{c}") / F.col("seconds")).alias(f"mean_{c}_per_s")
            for c in ("msgs_in", "msgs_out", "requests")
        ),
        "peak_msgs_in_per_s",
        "peak_msgs_out_per_s",
    )


def errors_over_time(deltas: DataFrame) -> DataFrame:
    """Drops, timeouts and late responses per broker and interval: ``deltas`` (which has
    a column per kind) with ``drops``, the three kinds of drop added up, null for a
    broker's first sample."""
    return deltas.withColumn("drops", sum((F.col(c) for c in DROPS[1:]), F.col(DROPS[0])))


def error_totals(deltas: DataFrame) -> DataFrame:
    """Per broker over the window: each error counter's total, requests, and how often
    the broker restarted."""
    return deltas.groupBy("broker").agg(
        *(F.coalesce(F.sum(c), F.lit(0)).cast("long").alias(c) for c in (*ERRORS, "requests")),
        F.coalesce(F.sum(F.col("restart").cast("int")), F.lit(0)).cast("long").alias("restarts"),
    )


# -- connectors ---------------------------------------------------------------------------


def broker_summary(telemetry: DataFrame) -> DataFrame:
    """Per broker: samples, first_at, last_at, interval (the longest telemetry interval),
    and connectors at the last sample, min, max."""
    return telemetry.groupBy("broker").agg(
        F.count(F.lit(1)).alias("samples"),
        F.min("at").alias("first_at"),
        F.max("at").alias("last_at"),
        F.max("interval").alias("interval"),
        F.max_by("connectors", "at").alias("connectors"),
        F.min("connectors").alias("min_connectors"),
        F.max("connectors").alias("max_connectors"),
    )


def connector_series(telemetry: DataFrame) -> DataFrame:
    """Connectors per broker per sample: broker, at, connectors."""
    return telemetry.select("broker", "at", "connectors")


def connector_changes(telemetry: DataFrame) -> DataFrame:
    """Every sample at which a broker's connector count changed: broker, at, before,
    after, change. Joins, drains and failovers show up here as steps."""
    prev = F.lag("connectors").over(Window.partitionBy("broker").orderBy("at"))
    steps = telemetry.select("broker", "at", prev.alias("before"), F.col("connectors"))
    return steps.where(F.col("before") != F.col("connectors")).select(
        "broker",
        "at",
        "before",
        F.col("connectors").alias("after"),
        (F.col("connectors") - F.col("before")).alias("change"),
    )


def connector_totals(telemetry: DataFrame, width: float) -> DataFrame:
    """Connectors of the whole mesh over time, in buckets of ``width`` seconds (one
    telemetry interval or more): at (the bucket's last sample), connectors (added up),
    brokers (how many counted). A broker counts with its last count so far if it
    reported in that bucket or the one before: brokers sample out of step, and one
    whose sample fell just past a bucket's edge is still there (counting only the
    samples inside a bucket drew a failover where there was none). A broker that
    stopped reporting counts no more."""
    bucket = F.floor(F.col("at") / F.lit(width)).alias("bucket")
    per_broker = telemetry.groupBy("broker", bucket).agg(
        F.max("at").alias("at"), F.max_by("connectors", "at").alias("connectors")
    )
    grid = (
        per_broker.select("broker")
        .distinct()
        .crossJoin(per_broker.select("bucket").distinct())
        .join(per_broker, ["broker", "bucket"], "left")
    )
    so_far = (
        Window.partitionBy("broker").orderBy("bucket").rowsBetween(Window.unboundedPreceding, 0)
    )
    filled = grid.select(
        "bucket",
        "at",
        F.last("connectors", ignorenulls=True).over(so_far).alias("connectors"),
        F.last(F.when(F.col("at").isNotNull(), F.col("bucket")), ignorenulls=True)
        .over(so_far)
        .alias("reported"),
    )
    live = filled.where(F.col("reported") >= F.col("bucket") - 1)
    totals = live.groupBy("bucket").agg(
        F.max("at").alias("at"),
        F.sum("connectors").cast("long").alias("connectors"),
        F.count(F.lit(1)).alias("brokers"),
    )
    return totals.drop("bucket")


# -- latency from traces ----------------------------------------------------------------


def latencies(traces: DataFrame) -> DataFrame:
    """One row per ``received`` hop that has ``sent_at``: src, msg_id, dst, entry_broker,
    exit_broker, at, latency_ms (received ``at`` - ``sent_at``) and path.

    The exit broker of a delivery is the broker that recorded the ``received`` hop: the
    receiving connector's broker, the one that delivered it. The path is "same broker"
    when the message entered the mesh there, "cross broker" when it entered at another
    one, "unknown" when its ``entry`` hop is not among the traces (not read, or trimmed).
    """
    entries = (
        traces.where(F.col("hop") == "entry")
        .groupBy("src", "msg_id")
        .agg(F.min_by("broker", "at").alias("entry_broker"))
    )
    received = traces.where((F.col("hop") == "received") & F.col("sent_at").isNotNull())
    joined = received.join(entries, ["src", "msg_id"], "left")
    path = (
        F.when(F.col("entry_broker").isNull(), F.lit(UNKNOWN_PATH))
        .when(F.col("entry_broker") == F.col("broker"), F.lit(SAME_BROKER))
        .otherwise(F.lit(CROSS_BROKER))
    )
    return joined.select(
        "src",
        "msg_id",
        "dst",
        "entry_broker",
        F.col("broker").alias("exit_broker"),
        "at",
        ((F.col("at") - F.col("sent_at")) * 1000.0).alias("latency_ms"),
        path.alias("path"),
    )


def latency_stats(lat: DataFrame, fractions: tuple[float, ...] = CDF_FRACTIONS) -> DataFrame:
    """Per path, and once more over every delivery as path "all": count, mean_ms, p50_ms,
    p90_ms, p99_ms, max_ms, and ``cdf``, the latencies at ``fractions`` (the points of
    the distribution's CDF: that fraction of the deliveries took at most that long).
    Percentiles are exact, interpolated between the two nearest deliveries."""
    wanted = [*PERCENTILES.values(), *fractions]
    aggregates = (
        F.count("latency_ms").alias("count"),
        F.avg("latency_ms").alias("mean_ms"),
        F.max("latency_ms").alias("max_ms"),
        F.percentile("latency_ms", wanted).alias("q"),
    )
    per_path = lat.groupBy("path").agg(*aggregates)
    overall = lat.agg(*aggregates).select(F.lit(ALL_PATHS).alias("path"), "*")
    stats = per_path.unionByName(overall).where(F.col("count") > 0)
    return stats.select(
        "path",
        "count",
        "mean_ms",
        *(F.col("q")[i].alias(name) for i, name in enumerate(PERCENTILES)),
        "max_ms",
        F.slice("q", len(PERCENTILES) + 1, len(fractions)).alias("cdf"),
    )


def trace_counts(traces: DataFrame) -> DataFrame:
    """How many trace records of each hop were read: hop, records, messages (distinct
    (src, msg_id))."""
    return traces.groupBy("hop").agg(
        F.count(F.lit(1)).alias("records"),
        F.count_distinct("src", "msg_id").alias("messages"),
    )
