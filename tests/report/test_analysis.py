"""The report's analysis on handcrafted telemetry and trace records with known answers."""

from __future__ import annotations

import copy
import html
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession

from meshbus.report import analysis as A
from meshbus.report.job import (
    ReportError,
    analyse,
    rows,
    tuned_for_small_data,
    with_unanswered,
)
from meshbus.report.plots import PLOTS
from meshbus.report.render import render_html
from tests.report.conftest import stream_rows, telemetry, trace

pytestmark = [pytest.mark.spark, pytest.mark.slow]

T0 = 1_732_345_600.0


def b1_records() -> list[dict[str, Any]]:
    """b1: four samples a second apart, a restart (down from 102 to ~110), two more."""
    return [
        telemetry("b1", T0 + 0, msgs_in=0, msgs_out=0, timeouts=0, connectors=2),
        telemetry("b1", T0 + 1, msgs_in=100, msgs_out=200, timeouts=1, connectors=2),
        telemetry(
            "b1", T0 + 2, msgs_in=300, msgs_out=600, timeouts=3, dropped_no_route=5, connectors=3
        ),
        # restarted: every counter from 0 again, and only ~1 interval of counting
        telemetry("b1", T0 + 10, msgs_in=50, msgs_out=100, dropped_no_route=1, connectors=0),
        telemetry(
            "b1", T0 + 11, msgs_in=150, msgs_out=300, timeouts=2, dropped_no_route=1, connectors=1
        ),
    ]


def b2_records() -> list[dict[str, Any]]:
    return [
        telemetry("b2", T0 + 0.5, msgs_in=10, dropped_too_large=1, connectors=1),
        telemetry("b2", T0 + 1.5, msgs_in=20, dropped_too_large=1, connectors=1),
        telemetry("b2", T0 + 2.5, msgs_in=40, dropped_too_large=4, connectors=1),
    ]


@pytest.fixture(scope="module")
def tel(spark: SparkSession) -> DataFrame:
    raw = stream_rows(spark, "telemetry.b1", b1_records()).unionByName(
        stream_rows(spark, "telemetry.b2", b2_records())
    )
    return A.parse_telemetry(raw).cache()


def by(frame: DataFrame, *keys: str) -> list[dict[str, Any]]:
    return rows(frame, *keys)


def test_rates_from_counter_differences_survive_a_restart(tel: DataFrame) -> None:
    rates = by(A.throughput(A.counter_deltas(tel)), "broker", "at")
    got = [(r["broker"], r["at"] - T0, r["msgs_in_per_s"], r["msgs_out_per_s"]) for r in rates]
    assert got == [
        ("b1", 0, None, None),  # the first sample is only the baseline
        ("b1", 1, 100.0, 200.0),
        ("b1", 2, 200.0, 400.0),
        # 50 since the restart, over one interval (1 s), not over the 8 s gap
        ("b1", 10, 50.0, 100.0),
        ("b1", 11, 100.0, 200.0),
        ("b2", 0.5, None, None),
        ("b2", 1.5, 10.0, 0.0),
        ("b2", 2.5, 20.0, 0.0),
    ]
    restarts = [r["restart"] for r in by(A.counter_deltas(tel), "broker", "at")]
    assert restarts == [None, False, False, True, False, None, False, False]


def test_mean_and_peak_rates(tel: DataFrame) -> None:
    summary = {r["broker"]: r for r in by(A.throughput_summary(A.counter_deltas(tel)))}
    # b1: 450 messages in over 1 + 1 + 1 (restart) + 1 seconds
    assert summary["b1"]["seconds"] == pytest.approx(4.0)
    assert summary["b1"]["mean_msgs_in_per_s"] == pytest.approx(112.5)
    assert summary["b1"]["peak_msgs_in_per_s"] == pytest.approx(200.0)
    assert summary["b2"]["mean_msgs_in_per_s"] == pytest.approx(15.0)


def test_error_totals_count_across_a_restart(tel: DataFrame) -> None:
    totals = {r["broker"]: r for r in by(A.error_totals(A.counter_deltas(tel)))}
    # timeouts 0 -> 1 -> 3 | restart 0 -> 2: 1 + 2 + 0 + 2
    assert totals["b1"]["timeouts"] == 5
    # no route 0 -> 0 -> 5 | restart 1 -> 1: 0 + 5 + 1 + 0
    assert totals["b1"]["dropped_no_route"] == 6
    assert totals["b1"]["restarts"] == 1
    # too large 1 -> 1 -> 4: the 1 before the first sample is not in the window
    assert totals["b2"]["dropped_too_large"] == 3
    assert totals["b2"]["restarts"] == 0
    series = by(A.errors_over_time(A.counter_deltas(tel)), "broker", "at")
    assert [r["drops"] for r in series] == [None, 0, 5, 1, 0, None, 0, 3]


def test_resampled_rates_stay_exact(tel: DataFrame) -> None:
    deltas = A.counter_deltas(tel)
    buckets = by(A.throughput(A.resample(deltas, 5.0)), "broker", "at")
    b1 = [(r["at"] - T0, r["msgs_in_per_s"]) for r in buckets if r["broker"] == "b1"]
    # [T0, T0+5): 300 messages over 2 s; [T0+10, T0+15): 150 over 2 s
    assert b1 == [(2, 150.0), (11, 75.0)]


def test_connector_counts_changes_and_totals(tel: DataFrame) -> None:
    series = by(A.connector_series(tel), "broker", "at")
    assert [(r["broker"], r["connectors"]) for r in series] == [
        ("b1", 2),
        ("b1", 2),
        ("b1", 3),
        ("b1", 0),
        ("b1", 1),
        ("b2", 1),
        ("b2", 1),
        ("b2", 1),
    ]
    changes = by(A.connector_changes(tel), "at")
    assert [(c["broker"], c["at"] - T0, c["before"], c["after"], c["change"]) for c in changes] == [
        ("b1", 2, 2, 3, 1),
        ("b1", 10, 3, 0, -3),
        ("b1", 11, 0, 1, 1),
    ]
    totals = by(A.connector_totals(tel, 1.0), "at")
    assert [(t["at"] - T0, t["connectors"], t["brokers"]) for t in totals] == [
        (0.5, 3, 2),
        (1.5, 3, 2),
        (2.5, 4, 2),
        (10, 0, 1),  # b2 stopped reporting
        (11, 1, 1),
    ]
    summary = {r["broker"]: r for r in by(A.broker_summary(tel))}
    assert (summary["b1"]["samples"], summary["b1"]["connectors"]) == (5, 1)
    assert (summary["b1"]["min_connectors"], summary["b1"]["max_connectors"]) == (0, 3)


def test_connector_totals_count_a_broker_whose_sample_missed_a_bucket(
    spark: SparkSession,
) -> None:
    """Brokers sample out of step: c2's samples land in buckets 0, 2 and 3 but not 1.
    It is still there in bucket 1 (before the fix the total dipped from 5 to 3)."""
    c1 = [telemetry("c1", T0 + t, connectors=3) for t in (0.1, 1.1, 2.1, 3.1)]
    c2 = [telemetry("c2", T0 + t, connectors=2) for t in (0.9, 2.0, 3.05)]
    raw = stream_rows(spark, "telemetry.c1", c1).unionByName(stream_rows(spark, "telemetry.c2", c2))
    totals = by(A.connector_totals(A.parse_telemetry(raw), 1.0), "at")
    assert [(round(t["at"] - T0, 2), t["connectors"], t["brokers"]) for t in totals] == [
        (0.9, 5, 2),
        (1.1, 5, 2),
        (2.1, 5, 2),
        (3.1, 5, 2),
    ]


def crash_records() -> list[dict[str, Any]]:
    """A mesh of a, b, and three brokers with no telemetry here: c crashes at T0 + 4.2
    (its 2 connectors fail over, one to a and one to b), d (no connectors) drains and
    leaves at T0 + 6.5, e (no connectors) runs without telemetry. a samples on the
    second, b half a second later."""

    def peers(at: float) -> list[dict[str, Any]]:
        listed = [("c", 2, 4.0), ("d", 0, 6.5), ("e", 0, 99.0)]
        return [
            {"name": name, "address": f"{name}:1", "connectors": count, "draining": False}
            for name, count, until in listed
            if at - T0 <= until
        ]

    def event(at: float, kind: str, broker: str, reason: str | None = None, **more: Any) -> Any:
        return {"at": T0 + at, "kind": kind, "broker": broker, "reason": reason, **more}

    a_events = {
        0: [event(0, "join", "a")],
        1: [event(0.45, "join", "b")],
        5: [event(4.2, "crash", "c", "connection-lost", last_heard=T0 + 4.1)],
        7: [event(6.0, "drain", "d"), event(6.5, "leave", "d", "peer-bye", last_heard=T0 + 6.49)],
    }
    b_events = {
        0.5: [event(0.4, "join", "b")],
        4.5: [event(4.25, "crash", "c", "connection-lost", last_heard=T0 + 4.12)],
        6.5: [event(6.02, "drain", "d")],
        7.5: [event(6.51, "leave", "d", "peer-bye", last_heard=T0 + 6.5)],
    }
    records = []
    for name, offset, events in (("a", 0.0, a_events), ("b", 0.5, b_events)):
        for i in range(10):
            at = i + offset
            records.append(
                telemetry(
                    name,
                    T0 + at,
                    connectors=3 if at < 5 else 4,
                    peers=peers(T0 + at),
                    events=events.get(at, []),
                )
            )
    return records


@pytest.fixture(scope="module")
def crash(spark: SparkSession) -> DataFrame:
    records = crash_records()
    raw = stream_rows(spark, "telemetry.a", [r for r in records if r["broker"] == "a"])
    raw = raw.unionByName(
        stream_rows(spark, "telemetry.b", [r for r in records if r["broker"] == "b"])
    )
    return A.parse_telemetry(raw).cache()


def test_a_dead_brokers_connectors_are_counted_once(crash: DataFrame) -> None:
    """8 connectors before c's crash and after: c's 2, counted from what a and b heard
    from it, until it crashed, then where they went. The dip is the failover, while
    they were on no broker (counting the brokers with records only: 6, then 8)."""
    totals = by(A.connector_totals(crash, 1.0), "at")
    got = [(round(t["at"] - T0, 2), t["connectors"], t["brokers"]) for t in totals]
    assert got == [
        (0.5, 8, 5),
        (1.5, 8, 5),
        (2.5, 8, 5),
        (3.5, 8, 5),
        (4.5, 6, 4),  # c crashed at 4.2: its connectors are failing over
        (5.5, 8, 4),
        (6.51, 8, 3),  # d left at 6.51 (the bucket's last event)
        (7.5, 8, 3),
        (8.5, 8, 3),
        (9.5, 8, 3),
    ]
    views = by(A.peer_view_series(crash, 1.0), "broker", "at")
    assert [(round(v["at"] - T0, 2), v["connectors"]) for v in views if v["broker"] == "c"] == [
        (0.5, 2),
        (1.5, 2),
        (2.5, 2),
        (3.5, 2),
        (4.0, 2),
    ]
    assert {v["broker"] for v in views} == {"c", "d", "e"}


def test_brokers_gone_from_the_mesh_are_unreachable(crash: DataFrame) -> None:
    """c crashed and d left; e, still a peer in a's and b's latest records, is not gone."""
    gone = {u["broker"]: u for u in by(A.unreachable(crash), "broker")}
    assert sorted(gone) == ["c", "d"]
    c, d = gone["c"], gone["d"]
    # the last frame b heard from c, after a's last record with it (T0 + 4)
    assert c["last_seen"] - T0 == pytest.approx(4.12)
    assert (round(c["lost_at"] - T0, 2), c["how"], c["reason"]) == (
        4.25,
        "crash",
        "connection-lost",
    )
    assert (c["address"], c["seen_by"]) == ("c:1", ["a", "b"])
    assert d["last_seen"] - T0 == pytest.approx(6.5)
    assert (round(d["lost_at"] - T0, 2), d["how"], d["reason"]) == (6.51, "leave", "peer-bye")


def test_an_event_is_listed_once_however_many_brokers_recorded_it(
    spark: SparkSession, crash: DataFrame
) -> None:
    events = by(A.event_occurrences(A.mesh_events(crash)), "at")
    assert [(round(e["at"] - T0, 2), e["kind"], e["broker"], e["seen_by"]) for e in events] == [
        (0, "join", "a", ["a"]),
        (0.4, "join", "b", ["a", "b"]),
        (4.2, "crash", "c", ["a", "b"]),
        (6.0, "drain", "d", ["a", "b"]),
        (6.5, "leave", "d", ["a", "b"]),
    ]
    crashed = events[2]
    assert (crashed["reason"], round(crashed["last_heard"] - T0, 2)) == ("connection-lost", 4.1)
    # The same kind about the same broker EVENT_GAP after the last report: another one.
    again = stream_rows(
        spark,
        "telemetry.a",
        [
            telemetry(
                "a",
                T0 + 20,
                events=[{"at": T0 + 10, "kind": "crash", "broker": "c"}],
            )
        ],
    )
    both = A.mesh_events(crash).unionByName(A.mesh_events(A.parse_telemetry(again)))
    crashes = by(A.event_occurrences(both).where("kind = 'crash'"), "at")
    assert [round(c["at"] - T0, 2) for c in crashes] == [4.2, 10]


def test_parse_skips_what_is_not_a_record(spark: SparkSession) -> None:
    records: list[Any] = [
        b"not json",
        b'{"broker": "b1"}',  # no "at"
        {"at": T0, "connectors": 4, "counters": {"msgs_in": 7}},  # no broker: the stream's
    ]
    parsed = by(A.parse_telemetry(stream_rows(spark, "telemetry.b_x", records)))
    assert [(r["broker"], r["connectors"], r["msgs_in"], r["msgs_out"]) for r in parsed] == [
        ("b_x", 4, 7, None)
    ]


def latency_records() -> list[dict[str, Any]]:
    """100 same-broker deliveries of 1..100 ms on b1; one multicast message from b1
    received on b2 twice (5 and 7 ms) and on b1 once (2 ms); one received hop whose
    entry is missing (3 ms); one received hop without sent_at (not a latency)."""
    records = []
    for i in range(1, 101):
        sent = T0 + i
        records.append(trace("game01:1", i, "entry", "b1", sent + 0.0002))
        records.append(trace("game01:1", i, "exit", "b1", sent + 0.0005))
        records.append(trace("game01:1", i, "received", "b1", sent + i / 1000, sent))
    sent = T0 + 200
    records.append(trace("game02:1", 7, "entry", "b1", sent + 0.0001))
    for broker, ms in (("b2", 5), ("b2", 7), ("b1", 2)):
        records.append(trace("game02:1", 7, "exit", broker, sent + 0.001))
        records.append(trace("game02:1", 7, "received", broker, sent + ms / 1000, sent))
    records.append(trace("game03:1", 1, "received", "b2", T0 + 300.003, T0 + 300))
    records.append(trace("game03:1", 2, "received", "b2", T0 + 301, None))
    return records


@pytest.fixture(scope="module")
def traces(spark: SparkSession) -> DataFrame:
    return A.parse_traces(stream_rows(spark, "traces.b1", latency_records())).cache()


def test_latency_path_classification(traces: DataFrame) -> None:
    lat = by(A.latencies(traces), "src", "msg_id", "latency_ms")
    multicast = [(r["exit_broker"], r["path"]) for r in lat if r["src"] == "game02:1"]
    assert multicast == [("b1", A.SAME_BROKER), ("b2", A.CROSS_BROKER), ("b2", A.CROSS_BROKER)]
    assert [r["latency_ms"] for r in lat if r["src"] == "game02:1"] == pytest.approx(
        [2, 5, 7], abs=1e-3
    )
    orphan = [r for r in lat if r["src"] == "game03:1"]
    assert [(r["path"], r["entry_broker"]) for r in orphan] == [(A.UNKNOWN_PATH, None)]
    assert len(lat) == 100 + 3 + 1  # the hop without sent_at is no latency


def test_latency_percentiles_and_cdf_of_a_known_set(traces: DataFrame) -> None:
    stats = {r["path"]: r for r in by(A.latency_stats(traces.transform(A.latencies)))}
    assert set(stats) == {A.SAME_BROKER, A.CROSS_BROKER, A.UNKNOWN_PATH, A.ALL_PATHS}
    same = stats[A.SAME_BROKER]
    # 1..100 ms and 2 ms: exact percentiles, interpolated (numpy's "linear")
    assert same["count"] == 101
    assert same["p50_ms"] == pytest.approx(50.0, abs=1e-3)
    assert same["p90_ms"] == pytest.approx(90.0, abs=1e-3)
    assert same["p99_ms"] == pytest.approx(99.0, abs=1e-3)
    assert same["max_ms"] == pytest.approx(100.0, abs=1e-3)
    assert same["mean_ms"] == pytest.approx((5050 + 2) / 101, abs=1e-3)
    cross = stats[A.CROSS_BROKER]
    assert cross["count"] == 2
    assert cross["p50_ms"] == pytest.approx(6.0, abs=1e-3)
    assert cross["p90_ms"] == pytest.approx(6.8, abs=1e-3)
    assert cross["max_ms"] == pytest.approx(7.0, abs=1e-3)
    assert stats[A.UNKNOWN_PATH]["count"] == 1
    assert stats[A.ALL_PATHS]["count"] == 104

    cdf = same["cdf"]  # the latencies at CDF_FRACTIONS, from the fastest to the slowest
    assert len(cdf) == len(A.CDF_FRACTIONS)
    assert cdf[0] == pytest.approx(1.0, abs=1e-3)
    assert cdf[A.CDF_FRACTIONS.index(0.5)] == pytest.approx(same["p50_ms"])
    assert cdf[-1] == pytest.approx(100.0, abs=1e-3)
    assert cdf == sorted(cdf)


def test_trace_counts(traces: DataFrame) -> None:
    counts = {r["hop"]: (r["records"], r["messages"]) for r in by(A.trace_counts(traces))}
    assert counts == {"entry": (101, 101), "exit": (103, 101), "received": (105, 103)}


@pytest.fixture(scope="module")
def analysed(spark: SparkSession) -> dict[str, Any]:
    """``analyse`` of b1's telemetry and the traces from T0 + 1.5 on, with what
    ``report_data`` adds."""
    raw_tel = stream_rows(spark, "telemetry.b1", b1_records())
    raw_traces = stream_rows(spark, "traces.b1", latency_records())
    data = analyse(raw_tel, raw_traces, since_at=T0 + 1.5)
    data.update(generated_at=T0 + 20, brokers_asked="h:1", streams=[])
    return data


def test_analyse_a_window(analysed: dict[str, Any]) -> None:
    data = analysed
    # the sample at T0 + 1 is before the window, and the baseline of the one at T0 + 2
    assert data["window"]["start"] == T0 + 2
    rates = [(p["at"] - T0, p["msgs_in_per_s"]) for p in data["throughput"]["series"]]
    assert rates == [(2, 200.0), (10, 50.0), (11, 100.0)]
    assert data["errors"]["total"]["timeouts"] == 2 + 0 + 2
    assert data["brokers"][0]["samples"] == 3
    assert data["brokers"][0]["restarts"] == 1
    assert [(c["at"] - T0, c["change"]) for c in data["connectors"]["changes"]] == [
        (2, 1),
        (10, -3),
        (11, 1),
    ]
    # records of brokers older than the peers and events: no mesh to tell of
    assert (data["unreachable"], data["events"], data["connectors"]["peer_views"]) == ([], [], [])
    # deliveries received before the window are left out: 2..100 ms of the first set
    same = next(p for p in data["latency"]["percentiles"] if p["path"] == A.SAME_BROKER)
    assert same["count"] == 99 + 1
    assert data["latency"]["cdf"][A.SAME_BROKER][-1] == [1.0, pytest.approx(100.0, abs=1e-3)]


def test_analyse_resamples_long_series(spark: SparkSession) -> None:
    raw = stream_rows(spark, "telemetry.b1", b1_records())
    data = analyse(raw, stream_rows(spark, "traces.b1", []), max_points=2)
    assert data["throughput"]["resolution"] == pytest.approx(11 / 2)
    # buckets are multiples of 5.5 s of Unix time: T0 is 1.5 s past one, so they are
    # [T0 - 1.5, T0 + 4): 300 messages in 2 s; [T0 + 9.5, T0 + 15): 50 + 100 in 1 + 1 s
    assert T0 % 5.5 == 1.5
    series = data["throughput"]["series"]
    rates = [(p["at"] - T0, p["msgs_in_per_s"], p["restart"]) for p in series]
    assert rates == [(2, 150.0, False), (11, 75.0, True)]
    assert data["throughput"]["summary"][0]["mean_msgs_in_per_s"] == pytest.approx(112.5)


@pytest.mark.parametrize("before", ["true", None])
def test_the_tuning_for_small_data_is_undone_after(spark: SparkSession, before: str | None) -> None:
    """``analyse`` turns adaptive execution off for its own queries only: a session it
    is given (the demo's) gets its own setting back, set or not."""
    key = "spark.sql.adaptive.enabled"
    saved = spark.conf.get(key, None)
    try:
        spark.conf.set(key, before) if before is not None else spark.conf.unset(key)
        with tuned_for_small_data(spark):
            assert spark.conf.get(key) == "false"
        assert spark.conf.get(key, None) == before
    finally:
        spark.conf.set(key, saved) if saved is not None else spark.conf.unset(key)


def test_analyse_an_empty_window(spark: SparkSession) -> None:
    raw = stream_rows(spark, "telemetry.b1", b1_records())
    with pytest.raises(ReportError, match="no telemetry records in the window"):
        analyse(raw, stream_rows(spark, "traces.b1", []), since_at=T0 + 100)


def test_render_draws_every_plot_and_escapes(analysed: dict[str, Any]) -> None:
    page = render_html(analysed)
    assert page.count('<img src="data:image/png;base64,') == len(PLOTS)
    hostile = '<script>alert("$x$")</script>'
    page = render_html(rename_brokers(copy.deepcopy(analysed), hostile))
    assert "<script>" not in page
    assert "&lt;script&gt;alert(&quot;$x$&quot;)&lt;/script&gt;" in page


def test_render_tells_of_unreachable_brokers_and_events(analysed: dict[str, Any]) -> None:
    """b1's report with what a crash adds: c, which b1 saw crash, with its connectors as
    b1 heard them; c:1 and x:1 were asked for and did not answer."""
    from meshbus.report.plots import _colors, plot_connectors

    data = copy.deepcopy(analysed)
    seen = {
        "broker": "c",
        "address": "c:1",
        "last_seen": T0 + 4.12,
        "lost_at": T0 + 4.25,
        "how": "crash",
        "reason": "connection-lost",
        "seen_by": ["b1"],
    }
    data["unreachable"] = with_unanswered([seen], {"c:1": "refused", "x:1": "timed out"})
    assert [(u["broker"], u["address"], u["no_answer"]) for u in data["unreachable"]] == [
        ("c", "c:1", "refused"),
        (None, "x:1", "timed out"),
    ]
    data["events"] = [
        {"at": T0 + 4.2, "kind": "crash", "broker": "c", "reason": "connection-lost",
         "last_heard": T0 + 4.12, "seen_by": ["b1"]},
        {"at": T0 + 10.5, "kind": "join", "broker": "b1", "reason": None,
         "last_heard": None, "seen_by": ["b1"]},
    ]  # fmt: skip
    data["connectors"]["peer_views"] = [
        {"broker": "c", "at": T0 + at, "connectors": 2} for at in (2.0, 4.0)
    ]
    page = render_html(data)
    assert "<h2>Unreachable brokers</h2>" in page
    assert "<td>crashed (connection-lost)</td>" in page
    assert "<td>timed out</td>" in page
    assert "<h2>Mesh events</h2>" in page
    assert "<td>crash</td><td>c</td><td>b1</td>" in page
    coverage = (
        "b1, c (c: as its peers saw it, unreachable since 07:06:44 UTC; "
        "x:1: unreachable, not counted)"
    )
    assert html.escape(coverage) in page
    figure = plot_connectors(data, _colors(["b1", "c"]))
    assert figure is not None
    for axes in figure.axes:  # each event a vertical line in each panel
        assert len([line for line in axes.get_lines() if len(set(line.get_xdata())) == 1]) == 2
    assert "crash c" in [text.get_text().strip() for text in figure.axes[0].texts]


def rename_brokers(data: Any, name: str) -> Any:
    """``data`` with every "broker" value set to ``name``."""
    if isinstance(data, dict):
        return {k: name if k == "broker" else rename_brokers(v, name) for k, v in data.items()}
    if isinstance(data, list):
        return [rename_brokers(v, name) for v in data]
    return data


def test_a_count_plot_of_nothing_but_zeros_has_whole_number_ticks() -> None:
    """No drops at all: the axis goes to 1 with ticks 0 and 1, not to 0.054 in
    fractions of a drop."""
    from meshbus.report.plots import _colors, plot_errors

    points = [{"broker": "b1", "at": T0 + i, "drops": 0, "timeouts": 0} for i in range(5)]
    figure = plot_errors({"errors": {"series": points}, "events": []}, _colors(["b1"]))
    assert figure is not None
    for axes in figure.axes:
        assert axes.get_ylim()[1] >= 1
        assert all(float(t).is_integer() for t in axes.get_yticks())
