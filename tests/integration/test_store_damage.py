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
from tests.damage import flip
from tests.integration.helpers import start_broker_process
from tests.integration.test_streams import fetch_all

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


async def test_salvage_copies_every_intact_block(tmp_path: Path) -> None:
    from tests.integration.test_cli_stream import stream_cli

    data_dir = tmp_path / "data"
    await stored(data_dir, kill=False)
    db = data_dir / "streams.db"
    flip(db, db.read_bytes().find(b"entry-01000|") + 20)
    assert "is damaged" in await refused(data_dir)
    before = db.read_bytes()
    out = tmp_path / "new"
    result = await stream_cli("salvage", "--data-dir", str(data_dir), "--out", str(out))
    assert result.code == 0, result.err
    assert db.read_bytes() == before  # the damaged store is left as it was
    lines = result.out.splitlines()
    assert lines[0] == f"salvaged {db} into {out / 'streams.db'}"
    assert lines[1].startswith("checks at open: the block of messages ")
    summary = lines[2]
    assert summary.startswith("stream ledger: saved ")
    assert "of 2000 messages" in summary
    lost_line = lines[3]
    assert lost_line.startswith("  lost seqs ")
    assert lost_line.endswith(": the block's CRC32 does not match its bytes")
    first, last = map(int, lost_line.split()[2].rstrip(":").split(".."))
    assert first <= 1001 <= last
    assert (
        lines[4]
        == f"  seqs 1..{first - 1} are in stream ledger.1-{first - 1} (it captures nothing)"
    )
    assert lines[-1] == f"start the broker with --data-dir {out}"

    host = await start_broker("--data-dir", str(out))
    try:
        async with await meshbus.connect(host.address, server="audit") as conn:
            newest = await fetch_all(conn, "ledger")
            assert [m.seq for m in newest] == list(range(last + 1, COUNT + 1))
            assert all(m.payload.startswith(b"entry-%05d|" % (m.seq - 1)) for m in newest)
            older = await fetch_all(conn, f"ledger.1-{first - 1}")
            assert [m.seq for m in older] == list(range(1, first))
            # the salvaged stream goes on capturing, numbering on
            publisher = await conn.register()
            await publisher.send_reliable("multicast:ledger", b"after")
            assert (await conn.streams.info("ledger")).last_seq == COUNT + 1
    finally:
        assert await stop_all([host]) == [0]
