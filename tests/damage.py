"""Damaging files on purpose, the way disks and crashes do, for the tests of a store that
must notice (tests/unit/storage/test_damage.py, tests/integration/test_store_damage.py)."""

from __future__ import annotations

from pathlib import Path


def flip(path: Path, at: int, count: int = 64) -> None:
    """Invert ``count`` bytes of ``path`` from offset ``at``."""
    with open(path, "r+b") as f:
        f.seek(at)
        data = f.read(count)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))
