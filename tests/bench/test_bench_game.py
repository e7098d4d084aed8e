"""`game` end to end with tiny loads: a broker and a nats-server, game-server, login,
producer and consumer processes, started and stopped by the command; the figures must be
real and parseable. The --vs-nats run goes through ``python -m bench``, the meshbus-only
one runs in process."""

from __future__ import annotations

import re

import pytest

from bench.game import game
from tests.bench.helpers import last_line, run_bench

_TINY = (
    *("--game-servers", "2", "--players", "20", "--zones", "4"),
    *("--unicast-rate", "5", "--zone-rate", "2", "--login-rate", "50", "--results-rate", "50"),
    *("--duration", "2", "--warmup", "0.5", "--runs", "1"),
)
_FIGURES = (
    "msgs",
    "unicast",
    "multicast",
    "requests",
    "reliable",
    "p50_us",
    "p99_us",
    "cpu_s_per_m",
    "server_cpu_s_per_m",
    "kept_up",
)


def _parse(line: str) -> dict[str, float]:
    pairs = dict(pair.split("=", 1) for pair in line.split())
    assert all(re.fullmatch(r"\d+(\.\d+)?", value) for value in pairs.values()), line
    return {key: float(value) for key, value in pairs.items()}


def _check_system(figures: dict[str, float], kind: str) -> None:
    for name in _FIGURES:
        # A server may use less than one clock tick (10 ms) at this load.
        if name != "server_cpu_s_per_m":
            assert figures[f"{kind}_{name}"] > 0, (kind, name, figures)
    assert figures[f"{kind}_server_cpu_s_per_m"] <= figures[f"{kind}_cpu_s_per_m"]
    # 40 players send 5 unicast updates/s each; 2 s measured: nothing near nothing.
    assert figures[f"{kind}_unicast"] > 50
    assert figures[f"{kind}_p99_us"] >= figures[f"{kind}_p50_us"]
    parts = ("unicast", "multicast", "requests", "requests", "reliable")
    assert figures[f"{kind}_msgs"] == pytest.approx(
        sum(figures[f"{kind}_{part}"] for part in parts), rel=0.01, abs=2
    )


def test_game_vs_nats_last_line() -> None:
    figures = _parse(run_bench("game", *_TINY, "--vs-nats"))
    assert set(figures) == {
        *(f"{kind}_{name}" for kind in ("meshbus", "nats") for name in _FIGURES),
        "ratio",
        "p50_ratio",
        "p99_ratio",
        "cpu_ratio",
    }
    _check_system(figures, "meshbus")
    _check_system(figures, "nats")
    for ratio, name in (
        ("ratio", "msgs"),
        ("p50_ratio", "p50_us"),
        ("p99_ratio", "p99_us"),
        ("cpu_ratio", "cpu_s_per_m"),
    ):
        expected = figures[f"meshbus_{name}"] / figures[f"nats_{name}"]
        assert figures[ratio] == pytest.approx(expected, rel=0.02), ratio


def test_game_meshbus_only_line() -> None:
    figures = _parse(last_line(game, *_TINY))
    assert set(figures) == {f"meshbus_{name}" for name in _FIGURES}
    _check_system(figures, "meshbus")
