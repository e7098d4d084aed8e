"""How ``meshbus stream info`` shows a size: the exact count, and binary units past 1 KiB
(never ``1.07374e+09``)."""

from __future__ import annotations

import pytest

from meshbus.cli.stream import byte_size


@pytest.mark.parametrize(
    ("size", "shown"),
    [
        (0, "0"),
        (1023, "1,023"),
        (1024, "1,024 (1 KiB)"),
        (1536, "1,536 (1.5 KiB)"),
        (1 << 30, "1,073,741,824 (1 GiB)"),
        (5 << 40, "5,497,558,138,880 (5 TiB)"),
        (1 << 62, "4,611,686,018,427,387,904 (4,096 PiB)"),
    ],
)
def test_sizes_read_as_a_person_says_them(size: int, shown: str) -> None:
    assert byte_size(size) == shown
