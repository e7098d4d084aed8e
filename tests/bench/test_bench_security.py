"""The security options of `python -m bench` (issue 14) end to end, with tiny loads:
--auth (brokers with users, links signed in), --tls, and the handshake command. The
figures must be real and the last line parseable."""

from __future__ import annotations

import re

import pytest

from tests.bench.helpers import run_bench

_NUMBER = r"(\d+(?:\.\d+)?)"


def _fields(line: str, *names: str) -> dict[str, float]:
    """The ``name=value`` pairs of a last line, which must hold exactly ``names``, in order."""
    match = re.fullmatch(" ".join(f"{name}={_NUMBER}" for name in names), line)
    assert match, line
    return {name: float(value) for name, value in zip(names, match.groups(), strict=True)}


def test_unicast_auth_both_over_tls_vs_nats() -> None:
    line = run_bench(
        "unicast", "--count", "20000", "--runs", "1", "--auth", "both", "--tls", "--vs-nats"
    )
    got = _fields(line, "meshbus", "meshbus_auth", "auth_ratio", "nats", "ratio")
    assert got["meshbus"] > 0
    assert got["meshbus_auth"] > 0
    assert got["nats"] > 0
    assert got["auth_ratio"] == pytest.approx(got["meshbus_auth"] / got["meshbus"], rel=0.01)
    assert got["ratio"] == pytest.approx(got["meshbus"] / got["nats"], rel=0.01)


def test_request_signed_in_over_tls_vs_nats() -> None:
    line = run_bench(
        "request", "--count", "300", "--runs", "1", "--concurrency", "4", "--auth", "on",
        "--tls", "--vs-nats",
    )  # fmt: skip
    got = _fields(line, "meshbus_p50_us", "nats_p50_us", "ratio")
    assert 0 < got["meshbus_p50_us"] < 1_000_000
    assert 0 < got["nats_p50_us"] < 1_000_000
    assert got["ratio"] == pytest.approx(got["meshbus_p50_us"] / got["nats_p50_us"], rel=0.02)


def test_cross_auth_both() -> None:
    """A 2-broker mesh with users and [[brokers]] keys carries the traffic too."""
    line = run_bench("cross", "--count", "20000", "--runs", "1", "--auth", "both")
    got = _fields(line, "meshbus", "meshbus_auth", "auth_ratio")
    assert got["meshbus"] > 0
    assert got["meshbus_auth"] > 0
    assert got["auth_ratio"] == pytest.approx(got["meshbus_auth"] / got["meshbus"], rel=0.01)


@pytest.mark.parametrize("tls", [(), ("--tls",)], ids=["tcp", "tls"])
def test_handshake_last_line(tls: tuple[str, ...]) -> None:
    line = run_bench("handshake", "--count", "5", "--runs", "1", *tls)
    got = _fields(
        line,
        "meshbus_p50_us",
        "meshbus_auth_p50_us",
        "auth_ratio",
        "meshbus_p99_us",
        "meshbus_auth_p99_us",
    )
    assert 0 < got["meshbus_p50_us"] <= got["meshbus_p99_us"]
    assert 0 < got["meshbus_auth_p50_us"] <= got["meshbus_auth_p99_us"]
    assert got["auth_ratio"] == pytest.approx(
        got["meshbus_auth_p50_us"] / got["meshbus_p50_us"], rel=0.01
    )


def test_unicast_monitor_both() -> None:
    """A broker with --monitor scraped every 0.1 s beside one without: both figures real."""
    line = run_bench(
        "unicast", "--count", "20000", "--runs", "1", "--monitor", "both",
        "--scrape-interval", "0.1",
    )  # fmt: skip
    got = _fields(line, "meshbus", "meshbus_monitor", "monitor_ratio")
    assert got["meshbus"] > 0
    assert got["meshbus_monitor"] > 0
    assert got["monitor_ratio"] == pytest.approx(got["meshbus_monitor"] / got["meshbus"], rel=0.01)
