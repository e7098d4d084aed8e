"""The pure parts: option parsing and how a range is split into tasks."""

from __future__ import annotations

import pytest

from meshbus.spark.options import parse_read, parse_write
from meshbus.spark.reader import split

pytestmark = [pytest.mark.spark]

BUS = {"brokers": "127.0.0.1:7400"}


def test_a_range_is_split_into_near_equal_tasks() -> None:
    opts = parse_read({**BUS, "stream": "s", "rowsPerPartition": "4"}, streaming=True)
    parts = split(opts, ("seq",), 10, 21)  # 11 rows, at most 4 each: 3 tasks
    assert [(p.start, p.stop) for p in parts] == [(10, 13), (13, 17), (17, 21)]
    assert split(opts, ("seq",), 5, 5) == []  # Spark also asks for empty ranges
    many = parse_read({**BUS, "stream": "s", "minPartitions": "8"}, streaming=True)
    assert [(p.start, p.stop) for p in split(many, ("seq",), 1, 4)] == [(1, 2), (2, 3), (3, 4)]


def test_options_are_case_insensitive_and_checked() -> None:
    opts = parse_read({"BROKERS": "h:1,h:2", "Stream": "s", "STARTINGSEQ": "7"}, streaming=False)
    assert (opts.bus.brokers, opts.stream, opts.starting_seq) == ("h:1,h:2", "s", 7)
    assert opts.bus.server == "spark"
    bad = [
        ({"stream": "s", "startingSeq": "0"}, "option 'startingSeq' must be at least 1, got 0"),
        ({"stream": "s", "startingSeq": "3", "startingOffsets": "earliest"}, "not both"),
        ({"stream": "s", "startingOffsets": "newest"}, "'earliest' or 'latest'"),
        ({"stream": "s", "startingSeq": "9", "endingSeq": "3"}, "is before 'startingSeq'"),
        ({"stream": "s", "failOnDataLoss": "maybe"}, "must be true or false"),
        ({"stream": "s", "requestTimeout": "-1"}, "positive number of seconds"),
        ({"stream": "s", "server": "multicast"}, "option 'server'"),
    ]
    for options, message in bad:
        with pytest.raises(ValueError, match=message):
            parse_read({**BUS, **options}, streaming=None)
    with pytest.raises(ValueError, match="'endingSeq' is for batch reads"):
        parse_read({**BUS, "stream": "s", "endingSeq": "4"}, streaming=True)
    with pytest.raises(ValueError, match="startingOffsets=latest would read nothing"):
        parse_read({**BUS, "stream": "s", "startingOffsets": "latest"}, streaming=False)
    assert parse_write({**BUS, "address": "unicast:game01:5"}).address == "game01:5"
    with pytest.raises(ValueError, match="option 'address': address 'chat' has no ':'"):
        parse_write({**BUS, "address": "chat"})


def test_credentials_and_tls_files_are_carried_as_paths() -> None:
    access = {"CREDS": "/etc/a.creds", "tlsca": "/etc/ca.pem"}
    bus = parse_write({**BUS, **access, "address": "anycast:x"}).bus
    assert (bus.creds, bus.tls_ca, bus.tls_cert, bus.tls_key) == (
        "/etc/a.creds",
        "/etc/ca.pem",
        None,
        None,
    )
    both = parse_read({**BUS, "stream": "s", "tlsCert": "c.pem", "tlsKey": "k.pem"}, streaming=None)
    assert (both.bus.tls_cert, both.bus.tls_key) == ("c.pem", "k.pem")
    with pytest.raises(ValueError, match="'tlsCert' and 'tlsKey' go together"):
        parse_read({**BUS, "stream": "s", "tlsCert": "c.pem"}, streaming=None)
