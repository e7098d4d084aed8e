"""`python -m bench stream` end to end: real brokers and a real nats-server -js, a last line
that parses and adds up, and no server left running afterwards (``run_bench``)."""

from __future__ import annotations

import re

from tests.bench.helpers import run_bench

_LAST_LINE = re.compile(
    r"append=(\d+) nats_append=(\d+) append_ratio=(\d+\.\d{3}) append_wire=(\d+) "
    r"wire_ratio=(\d+\.\d{3}) fetch=(\d+) nats_fetch=(\d+) fetch_ratio=(\d+\.\d{3}) "
    r"append_always=(\d+)"
)


def _figures(line: str) -> dict[str, float]:
    match = _LAST_LINE.fullmatch(line)
    assert match, line
    names = "append nats_append append_ratio append_wire wire_ratio fetch nats_fetch fetch_ratio"
    return dict(zip([*names.split(), "append_always"], map(float, match.groups()), strict=True))


def test_stream_last_line() -> None:
    f = _figures(run_bench("stream", "--count", "2000", "--runs", "1"))
    assert min(f.values()) > 0
    # The ratios are of the printed medians (rounded to whole msgs/s, so within 1%).
    for ratio, mine, theirs in [
        ("append_ratio", "append", "nats_append"),
        ("wire_ratio", "append_wire", "nats_append"),
        ("fetch_ratio", "fetch", "nats_fetch"),
    ]:
        assert abs(f[ratio] - f[mine] / f[theirs]) <= 0.01 * f[ratio] + 0.001


def test_fetch_reads_everything_when_a_batch_does_not_fit_in_one_frame() -> None:
    # 1000 messages of 10 kB do not fit in one 1 MiB answer: each fetch gets fewer, and the
    # bench checks that it still reads seqs 1..count, each with all its bytes.
    f = _figures(
        run_bench("stream", "--count", "300", "--size", "10000", "--batch", "1000", "--runs", "1")
    )
    assert f["fetch"] > 0
    assert f["nats_fetch"] > 0
