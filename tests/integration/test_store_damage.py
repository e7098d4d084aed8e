"""A damaged stream store, as a user meets it: the broker refuses to start, with one
message naming the file, what is wrong and how to recover -- never a traceback, never
altered or silently missing messages."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest

import meshbus
from tests.conftest import start_broker, stop_all
from tests.integration.helpers import start_broker_process

COUNT = 2000


async def stored(data_dir: Path, kill: bool) -> None:
    host = await start_broker("--data-dir", str(data_dir))
    try:
        async with await meshbus.connect(host.address, server="pub") as conn:
            await conn.streams.add("ledger", "multicast:ledger")
            publisher = await conn.register()
            for i in range(COUNT):
                await publisher.send(
                    "multicast:ledger", b"entry-%05d|" % i + b"P" * 200, reliable=True
                )
            await conn.wait_acked(30)
            assert conn.unacked == 0
    finally:
        if kill:
            host.process.kill()
            assert await host.process.wait() == -9
        else:
            assert await stop_all([host]) == [0]


async def refused(data_dir: Path) -> str:
    process = await start_broker_process("--listen", "127.0.0.1:0", "--data-dir", str(data_dir))
    try:
        out, err = await asyncio.wait_for(process.communicate(), 20)
    finally:
        if process.returncode is None:  # it started: the test fails, the broker must go
            process.kill()
            await process.wait()
    text = err.decode()
    assert process.returncode == 1, (out, text)
    assert "Traceback" not in text
    db = data_dir / "streams.db"
    assert text.startswith(f"Error: the stream store {db} is damaged: "), text
    assert f"`meshbus stream salvage --data-dir {data_dir} --out NEW_DIR`" in text
    return text


def flip(path: Path, at: int, count: int = 64) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        data = f.read(count)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))


def truncate_8k(db: Path) -> None:
    os.truncate(db, db.stat().st_size - 8192)


def cut_in_half(db: Path) -> None:
    os.truncate(db, db.stat().st_size // 2)


def overwrite_header(db: Path) -> None:
    flip(db, 0, 100)


def flip_a_payload(db: Path) -> None:
    flip(db, db.read_bytes().find(b"P" * 100))


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (truncate_8k, "it was cut short"),
        (cut_in_half, "it was cut short"),
        (overwrite_header, "its first bytes are not an SQLite header"),
        (flip_a_payload, "of stream 'ledger' is damaged (its CRC32 does not match its bytes)"),
    ],
)
async def test_a_damaged_store_stops_the_broker(
    tmp_path: Path, damage: Callable[[Path], None], said: str
) -> None:
    await stored(tmp_path, kill=False)
    damage(tmp_path / "streams.db")
    assert said in await refused(tmp_path)


async def test_a_damaged_wal_of_a_killed_broker_stops_the_broker(tmp_path: Path) -> None:
    await stored(tmp_path, kill=True)
    wal = tmp_path / "streams.db-wal"
    size = wal.stat().st_size
    assert size > 32 + 4096 * 4
    flip(wal, 32 + 24 + 200)  # the first frame's page
    text = await refused(tmp_path)
    assert f"its write-ahead log {wal} is damaged at frame 1 of " in text
    assert "committed transactions since the last checkpoint" in text
    assert wal.stat().st_size == size  # nothing cut: salvage or moving it aside can decide
