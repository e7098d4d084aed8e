"""The ready line: what a broker prints once it accepts links, and what its readers take
from it -- the listen address, and the NATS listener's when it has one."""

from __future__ import annotations

from meshbus.broker.process import nats_address_of, parse_ready_line, ready_line


def test_a_ready_line_reads_back() -> None:
    line = ready_line("b1", "127.0.0.1:7400")
    assert line == "meshbus broker b1 listening on 127.0.0.1:7400"
    assert parse_ready_line(line + "\n") == ("b1", "127.0.0.1:7400")
    assert nats_address_of(line) == ""


def test_a_ready_line_names_the_nats_listener_it_bound() -> None:
    line = ready_line("b1", "127.0.0.1:7400", "[::1]:4222")
    assert line == "meshbus broker b1 listening on 127.0.0.1:7400; NATS clients on [::1]:4222"
    assert parse_ready_line(line) == ("b1", "127.0.0.1:7400")
    assert nats_address_of(line) == "[::1]:4222"


def test_other_lines_are_no_ready_line() -> None:
    for line in ("", "meshbus broker b1 listening on", "starting b1", "listening on 1.2.3.4:5"):
        assert parse_ready_line(line) is None
        assert nats_address_of(line) == ""
