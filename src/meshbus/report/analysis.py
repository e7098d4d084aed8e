"""The report's numbers: pure functions from Spark DataFrames to Spark DataFrames.

Inputs are rows as the ``meshbus`` data source reads a stream (the payload is the
UTF-8 JSON record a broker wrote; docs/report.md has both record formats):

* ``telemetry.<broker>``: one record per broker every ``--telemetry-interval``
  seconds; its counters are cumulative since that broker started, so a counter
  that went *down* means the broker restarted (and started again from 0). It also
  has the broker's peers (with the connectors each announced) and the mesh's events
  it saw: a broker's streams die with it, so these are all there is of a dead one.
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
    BooleanType,
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

# The kinds of the mesh's events (meshbus.broker.mesh.membership.MeshEvent); after the last two a
# broker is no longer in the mesh.
JOIN, DRAIN, LEAVE, CRASH = "join", "drain", "leave", "crash"
GONE = (LEAVE, CRASH)
# The brokers linked to a crashed one notice within a heartbeat budget of each other
# (1.5 s by default): reports of one event about one broker closer than this are one.
EVENT_GAP = 5.0
# A broker's connector count holds for this many totals buckets after its sample, unless
# it left or crashed first: brokers sample out of step and a record may come late, yet
# one that stopped reporting with no leave or crash recorded (an older broker) must
# count no more.
STALE_BUCKETS = 3

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
_PEER = StructType(
    [
        StructField("name", StringType()),
        StructField("address", StringType()),
        StructField("connectors", LongType()),
        StructField("draining", BooleanType()),
    ]
)
_EVENT = StructType(
    [
        StructField("at", DoubleType()),
        StructField("kind", StringType()),
        StructField("broker", StringType()),
        StructField("reason", StringType()),
        StructField("last_heard", DoubleType()),
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
        StructField("peers", ArrayType(_PEER)),
        StructField("events", ArrayType(_EVENT)),
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
    services, routes, pending), one column per counter, links, peers and events (null
    in a record of a broker older than them). Rows that are not telemetry records (no
    ``at``) are left out; a record without ``broker`` is named after its stream."""
    rec = _record(raw, TELEMETRY_SCHEMA)
    from_stream = F.regexp_replace("stream", "^" + TELEMETRY_PREFIX.replace(".", r"\."), "")
    return rec.where(F.col("r.at").isNotNull()).select(
        F.coalesce(F.col("r.broker"), from_stream).alias("broker"),
        F.col("r.at").alias("at"),
        F.col("r.interval").alias("interval"),
        *(F.col(f"r.{name}").alias(name) for name in GAUGES),
        *(F.col(f"r.counters.{name}").alias(name) for name in COUNTERS),
        F.col("r.links").alias("links"),
        F.col("r.peers").alias("peers"),
        F.col("r.events").alias("events"),
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
    telemetry interval or more): at (the bucket's last sample or event), connectors
    (added up), brokers (how many counted).

    Each broker counts with its latest count so far -- its own sample, or for a broker
    without records of its own, what its peers heard (``peer_views``) -- for
    ``STALE_BUCKETS`` buckets, and not once a broker recorded that it left or crashed
    (until a later record has it as a peer again: it is back, or that peer had not
    noticed yet). So a dead broker's connectors, which fail over to the others, are counted once:
    where they were until the crash, where they went after. (Counting only the brokers
    with records left out a dead broker's connectors before its crash -- its streams
    died with it -- and the failover looked like growth.)"""

    def counts(frame: DataFrame, gone: bool) -> DataFrame:
        return frame.select("broker", "at", "connectors", F.lit(gone).alias("gone"))

    ends = mesh_events(telemetry).where(F.col("kind").isin(*GONE))
    rows = (
        counts(telemetry, False)
        .unionByName(counts(peer_views(telemetry), False))
        .unionByName(counts(ends.withColumn("connectors", F.lit(None).cast("long")), True))
        .withColumn("bucket", F.floor(F.col("at") / F.lit(width)))
    )
    per_broker = rows.groupBy("broker", "bucket").agg(
        F.max_by(F.struct("at", "connectors", "gone"), "at").alias("last")
    )
    buckets = rows.groupBy("bucket").agg(F.max("at").alias("at"))
    grid = (
        per_broker.select("broker")
        .distinct()
        .crossJoin(buckets)
        .join(per_broker, ["broker", "bucket"], "left")
    )
    so_far = (
        Window.partitionBy("broker").orderBy("bucket").rowsBetween(Window.unboundedPreceding, 0)
    )
    filled = grid.select(
        "bucket", "at", F.last("last", ignorenulls=True).over(so_far).alias("last")
    )
    fresh = F.col("at") - F.col("last.at") <= F.lit(STALE_BUCKETS * width)
    live = filled.where(~F.col("last.gone") & fresh)
    totals = live.groupBy("bucket").agg(
        F.max("at").alias("at"),
        F.sum("last.connectors").cast("long").alias("connectors"),
        F.count(F.lit(1)).alias("brokers"),
    )
    return totals.drop("bucket")


# -- the mesh as the brokers saw it --------------------------------------------------------


def _listed(telemetry: DataFrame) -> DataFrame:
    """One row per peer in each record: seen_by (the record's broker), at, broker (the
    peer), address, connectors."""
    peers = telemetry.select(F.col("broker").alias("seen_by"), "at", F.explode("peers").alias("p"))
    return peers.where(F.col("p.name").isNotNull()).select(
        "seen_by",
        "at",
        F.col("p.name").alias("broker"),
        F.col("p.address").alias("address"),
        F.col("p.connectors").alias("connectors"),
    )


def peer_views(telemetry: DataFrame) -> DataFrame:
    """The connectors of the brokers with no telemetry records here -- dead, gone, or
    without telemetry -- as the brokers linked to them heard it (their LOAD, sent with
    every heartbeat and every change) at each of their own samples: broker, at,
    connectors, seen_by."""
    own = telemetry.select("broker").distinct()
    return _listed(telemetry).join(own, "broker", "left_anti")


def peer_view_series(telemetry: DataFrame, width: float) -> DataFrame:
    """``peer_views`` per broker in buckets of ``width`` seconds, for a plot: broker,
    at, connectors (the bucket's last view)."""
    bucket = F.floor(F.col("at") / F.lit(width)).alias("bucket")
    return (
        peer_views(telemetry)
        .groupBy("broker", bucket)
        .agg(F.max("at").alias("at"), F.max_by("connectors", "at").alias("connectors"))
        .drop("bucket")
    )


def mesh_events(telemetry: DataFrame) -> DataFrame:
    """Every event of the mesh the brokers recorded, one row per record of it: seen_by
    (the broker that recorded it), at, kind (``JOIN``, ``DRAIN``, ``LEAVE``, ``CRASH``),
    broker (the one it happened to), reason and last_heard (a closed link's: why, and
    when the broker last heard from it)."""
    events = telemetry.select(F.col("broker").alias("seen_by"), F.explode("events").alias("e"))
    complete = F.col("e.at").isNotNull() & F.col("e.kind").isNotNull()
    return events.where(complete & F.col("e.broker").isNotNull()).select(
        "seen_by", *(F.col(f"e.{f.name}").alias(f.name) for f in _EVENT)
    )


def event_occurrences(events: DataFrame, gap: float = EVENT_GAP) -> DataFrame:
    """``mesh_events`` once per occurrence, however many brokers recorded it: the records
    of one kind about one broker less than ``gap`` seconds after the one before are one
    occurrence. at, kind, broker, reason and last_heard (those of its first record), and
    seen_by (sorted)."""
    order = Window.partitionBy("kind", "broker").orderBy("at")
    starts = events.withColumn(
        "starts", F.coalesce(F.col("at") - F.lag("at").over(order) >= gap, F.lit(True))
    )
    numbered = starts.withColumn(
        "occurrence",
        F.sum(F.col("starts").cast("int")).over(order.rowsBetween(Window.unboundedPreceding, 0)),
    )
    return (
        numbered.groupBy("kind", "broker", "occurrence")
        .agg(
            F.min("at").alias("at"),
            F.min_by("reason", "at").alias("reason"),
            F.min_by("last_heard", "at").alias("last_heard"),
            F.array_sort(F.collect_set("seen_by")).alias("seen_by"),
        )
        .drop("occurrence")
    )


def unreachable(telemetry: DataFrame) -> DataFrame:
    """The brokers gone from the mesh: named as a peer or in an event, with no telemetry
    records here (their streams died with them), and a peer in no broker's latest record.

    broker, address (the last one its peers had); last_seen, the latest of the last
    sample that had it as a peer and (when a broker recorded its link closing) the last
    time a broker heard from it; lost_at, how ("leave" or "crash") and reason, of the
    last such event about it (null when none was recorded, as by brokers older than
    the events); seen_by, the brokers that had it as a peer or recorded an event of it
    (sorted)."""
    listed = _listed(telemetry)
    events = mesh_events(telemetry)
    latest = telemetry.groupBy(F.col("broker").alias("seen_by")).agg(F.max("at").alias("at"))
    still_there = listed.join(latest, ["seen_by", "at"]).select("broker")
    witnesses = listed.select("broker", "seen_by").unionByName(events.select("broker", "seen_by"))
    gone = (
        witnesses.groupBy("broker")
        .agg(F.array_sort(F.collect_set("seen_by")).alias("seen_by"))
        .join(telemetry.select("broker").distinct(), "broker", "left_anti")
        .join(still_there.distinct(), "broker", "left_anti")
    )
    sightings = listed.groupBy("broker").agg(
        F.max("at").alias("last_listed"), F.max_by("address", "at").alias("address")
    )
    ends = (
        events.where(F.col("kind").isin(*GONE))
        .groupBy("broker")
        .agg(
            F.max_by(F.struct("at", "kind", "reason"), "at").alias("end"),
            F.max("last_heard").alias("last_heard"),
        )
    )
    return (
        gone.join(sightings, "broker", "left")
        .join(ends, "broker", "left")
        .select(
            "broker",
            "address",
            F.greatest("last_listed", "last_heard").alias("last_seen"),
            F.col("end.at").alias("lost_at"),
            F.col("end.kind").alias("how"),
            F.col("end.reason").alias("reason"),
            "seen_by",
        )
    )


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
