"""What ``meshbus top`` shows (meshbus.cli.top_view): samples and rates from stat
answers, the rows, the mesh's total, and what fits a terminal."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from meshbus.broker.core.outbox import TrafficStats
from meshbus.broker.observe.monitor import DROP_REASONS
from meshbus.cli.top_view import (
    Row,
    Sample,
    StatUnusable,
    broker_state,
    figure,
    fit,
    rates,
    row_cells,
    table,
)


def stat(
    *,
    uptime_s: float = 10.0,
    msgs_in: int = 0,
    msgs_out: int = 0,
    connectors: int = 0,
    services: int = 0,
    ready: bool = True,
    draining: bool = False,
    nats: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A brief stat answer (StatView.brief), reduced to what top reads, with every drop
    counter the broker keeps at 1 and a stream capture drop of 1; ``nats`` its NATS
    clients' figures (none by default)."""
    counters: dict[str, Any] = {
        "msgs_in": msgs_in,
        "msgs_out": msgs_out,
        "pending": 2,
        "links_closed": {"bye": 4},
        **dataclasses.asdict(TrafficStats()),
    }
    counters.update({field: 1 for field in counters if field.startswith("dropped_")})
    return {
        "name": "b1",
        "uptime_s": uptime_s,
        "ready": ready,
        "draining": draining,
        "connectors": connectors,
        "services": services,
        "streams": {"stored": 7, "dropped": 1},
        "loop_lag_ms": {"max": 12.345, "max_own": 0.5, "p99": 5.0, "samples": 100},
        "counters": counters,
        "nats": nats or {"clients": 0, "msgs_in": 0, "msgs_out": 0},
    }


def sample(**fields: Any) -> Sample:
    return Sample.from_stat(stat(**fields))


def test_a_sample_takes_the_figures_and_every_drop_counter() -> None:
    s = sample(msgs_in=5, msgs_out=6, connectors=3, services=4)
    assert (s.connectors, s.services, s.msgs_in, s.msgs_out, s.pending) == (3, 4, 5, 6, 2)
    # The reasons the monitor exports as meshbus_dropped_total, stream_capture among them.
    assert s.drops == len(DROP_REASONS) + 1
    assert (s.lag_max_ms, s.lag_p99_ms, s.lag_own_ms) == (12.345, 5.0, 0.5)
    assert s.state == "running"


def test_nats_clients_are_counted_and_their_messages_added_to_the_links() -> None:
    s = sample(msgs_in=5, msgs_out=6, nats={"clients": 3, "msgs_in": 10, "msgs_out": 20})
    assert (s.nats_clients, s.msgs_in, s.msgs_out) == (3, 15, 26)
    older = stat(msgs_in=5)
    del older["nats"]  # a broker of a meshbus before NATS clients: none
    assert (Sample.from_stat(older).nats_clients, Sample.from_stat(older).msgs_in) == (0, 5)


def test_an_answer_without_a_figure_says_which() -> None:
    old = stat()
    del old["loop_lag_ms"]["max_own"]
    with pytest.raises(StatUnusable, match="no usable 'max_own': does it run an older meshbus"):
        Sample.from_stat(old)


@pytest.mark.parametrize(
    ("ready", "draining", "state"),
    [(True, False, "running"), (False, False, "joining"), (True, True, "draining")],
)
def test_the_state(ready: bool, draining: bool, state: str) -> None:
    assert broker_state({"ready": ready, "draining": draining}) == state


def test_rates_are_measured_on_the_brokers_clock() -> None:
    before = sample(uptime_s=10.0, msgs_in=100, msgs_out=300)
    after = sample(uptime_s=12.0, msgs_in=500, msgs_out=301)
    assert rates(before, after) == (200.0, 0.5)


@pytest.mark.parametrize(
    ("before", "why"),
    [
        (None, "no earlier sample"),
        (sample(uptime_s=30.0, msgs_in=1), "the broker restarted: uptime went back"),
        (sample(uptime_s=5.0, msgs_in=900), "a counter went back"),
        (sample(uptime_s=10.0, msgs_in=1), "no time passed"),
    ],
)
def test_no_rate_without_a_difference_that_means_something(before: Sample | None, why: str) -> None:
    assert rates(before, sample(uptime_s=10.0, msgs_in=10)) is None, why


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (0.44, "0.4"),
        (7, "7"),
        (12.6, "13"),
        (99_999, "99999"),
        (123_456, "123.5k"),
        (12_345_678, "12.3M"),
        (4_200_000_000, "4.2G"),
    ],
)
def test_figures_fit_six_characters(value: float, text: str) -> None:
    assert figure(value) == text
    assert len(text) <= 6


def test_a_broker_that_does_not_answer_shows_no_figures() -> None:
    cells = row_cells(Row("b2", "h:2", None, error="refused"))
    assert cells[:3] == ["b2", "h:2", "unreachable"]
    assert set(cells[3:]) == {"-"}


FOUR_NATS = {"clients": 4, "msgs_in": 0, "msgs_out": 0}


def mesh_rows() -> list[Row]:
    return [
        Row("b3", "h:3", None, error="could not connect"),
        Row("b1", "h:1", sample(connectors=2, services=1, nats=FOUR_NATS), (1.5, 300.0)),
        Row("b2", "h:2", sample(connectors=3), None),
    ]


def test_the_table_in_name_order_with_the_total_of_those_that_answer() -> None:
    t = table(mesh_rows())
    assert [line.text for line in t.lines()] == [
        "BROKER  ADDRESS    STATE        CONN  SVCS  NATS  IN/S  OUT/S"
        "  PEND  DROPS   LAG  P99  OWN",
        "b1      h:1        running         2     1     4   1.5    300     "
        "2      7  12.3  5.0  0.5",
        "b2      h:2        running         3     0     0     -      -     "
        "2      7  12.3  5.0  0.5",
        "b3      h:3        unreachable     -     -     -     -      -     "
        "-      -     -    -    -",
        "total   3 brokers                  5     1     4   1.5    300     "
        "4     14  12.3  5.0  0.5",
        "b3: could not connect",
    ]
    assert [line.style for line in t.lines()] == ["header", "row", "row", "down", "total", "note"]
    assert t.width == len(t.header.text)


def test_a_mesh_where_nobody_answers_totals_nothing() -> None:
    total = table([Row("b1", "h:1", None)]).total.text.split()
    assert total == ["total", "1", "brokers", "0", "0", "0", "-", "-", "0", "0", "-", "-", "-"]


def texts(lines: list[Any]) -> list[str]:
    return [line.text for line in lines]


def test_everything_fits_a_large_terminal() -> None:
    lines = fit("title", mesh_rows(), 200, 50)
    assert texts(lines) == ["title", *texts(table(mesh_rows()).lines())]


def test_a_narrow_terminal_loses_the_address_column_first() -> None:
    full, narrow = table(mesh_rows()), table(mesh_rows(), address=False)
    lines = fit("title", mesh_rows(), full.width - 1, 50)
    assert "ADDRESS" not in lines[1].text
    assert texts(lines[1:5]) == texts(narrow.lines()[:4])
    assert fit("title", mesh_rows(), narrow.width, 50)[1].text == narrow.header.text


def test_a_short_terminal_loses_the_notes_then_brokers_and_says_so() -> None:
    t = table(mesh_rows())
    assert texts(fit("title", mesh_rows(), 200, 5)) == [
        "title",
        t.header.text,
        t.rows[0].text,
        "... 2 more brokers: make the terminal taller",
        t.total.text,
    ]
    no_notes = fit("title", mesh_rows(), 200, 6)
    assert texts(no_notes) == ["title", t.header.text, *texts(t.rows), t.total.text]


@pytest.mark.parametrize(("width", "height"), [(40, 50), (200, 4)])
def test_a_terminal_too_small_is_told_what_it_needs(width: int, height: int) -> None:
    narrow = table(mesh_rows(), address=False)
    lines = fit("title", mesh_rows(), width, height)
    message = " ".join(texts(lines))
    assert message.startswith("The terminal is too small for meshbus top")
    assert f"it needs {narrow.width}x5, this one is {width}x{height}" in message
    assert all(len(line.text) <= width for line in lines)
    assert len(lines) <= height
