"""`meshbus bench stream` end to end: real brokers and a real nats-server -js, a last line
that parses and adds up, and no server left running afterwards (``run_bench``)."""

from __future__ import annotations

import re

from tests.integration.bench_helpers import run_bench

_LAST_LINE = re.compile(
    r"append=(\d+) nats_append=(\d+) append_ratio=(\d+\.\d{3}) fetch=(\d+) nats_fetch=(\d+) "
    r"fetch_ratio=(\d+\.\d{3}) append_always=(\d+)"
)


def _figures(line: str) -> tuple[int, int, float, int, int, float, int]:
    match = _LAST_LINE.fullmatch(line)
    assert match, line
    append, nats_append, append_ratio = int(match[1]), int(match[2]), float(match[3])
    fetch, nats_fetch, fetch_ratio = int(match[4]), int(match[5]), float(match[6])
    always = int(match[7])
    return append, nats_append, append_ratio, fetch, nats_fetch, fetch_ratio, always


def test_stream_last_line() -> None:
    append, nats_append, append_ratio, fetch, nats_fetch, fetch_ratio, always = _figures(
        run_bench("stream", "--count", "2000", "--runs", "1")
    )
    assert min(append, nats_append, fetch, nats_fetch, always) > 0
    # The ratios are of the printed medians (rounded to whole msgs/s, so within 1%).
    assert abs(append_ratio - append / nats_append) <= 0.01 * append_ratio + 0.001
    assert abs(fetch_ratio - fetch / nats_fetch) <= 0.01 * fetch_ratio + 0.001


def test_fetch_reads_everything_when_a_batch_does_not_fit_in_one_frame() -> None:
    # 1000 messages of 10 kB do not fit in one 1 MiB answer: each fetch gets fewer, and the
    # bench checks that it still reads seqs 1..count, each with all its bytes.
    _, _, _, fetch, nats_fetch, _, _ = _figures(
        run_bench("stream", "--count", "300", "--size", "10000", "--batch", "1000", "--runs", "1")
    )
    assert fetch > 0
    assert nats_fetch > 0
