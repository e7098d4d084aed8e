"""The JetStream peer of the stream benches, against a real nats-server: figures and checks."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.cluster import nats_monitor, wait_until
from bench.jetstream import (
    JetStreamError,
    _check_ack,
    jetstream_add,
    jetstream_append,
    jetstream_cluster,
    jetstream_fetch,
    jetstream_server,
    sync_always_refused,
)
from bench.servers import BenchSetupError, Server

COUNT = 2000


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with jetstream_server(str(tmp_path)) as started:
        yield started


async def test_append_then_fetch(server: Server, tmp_path: Path) -> None:
    appended = await jetstream_append(server.host, server.port, COUNT, 100)
    assert appended > 0
    assert any((tmp_path / "jetstream").rglob("*.blk")), "the stream is not in the file store"
    assert await jetstream_fetch(server.host, server.port, COUNT) > 0
    # Each fetch reads with its own consumer, so the stream can be read again, in odd batches.
    assert await jetstream_fetch(server.host, server.port, COUNT, batch=7) > 0


async def test_append_refuses_a_stream_that_is_not_empty(server: Server) -> None:
    await jetstream_append(server.host, server.port, 10, 100)
    with pytest.raises(JetStreamError, match="already holds"):
        await jetstream_append(server.host, server.port, 10, 100)


@pytest.mark.parametrize(
    ("count", "error"),
    [(COUNT + 1, "fetch stopped at 2000: status 404"), (COUNT - 1, "1 messages left after")],
)
async def test_fetch_wants_exactly_what_the_stream_holds(
    server: Server, count: int, error: str
) -> None:
    await jetstream_append(server.host, server.port, COUNT, 100)
    with pytest.raises(JetStreamError, match=re.escape(error)):
        await jetstream_fetch(server.host, server.port, count)


def test_an_error_ack_or_a_skipped_seq_fails() -> None:
    ok = b'{"stream":"BENCH", "seq":5}'  # byte for byte what 2.9.10 sends
    _check_ack(ok, 5)
    with pytest.raises(JetStreamError, match="ack 6 is for BENCH seq 5"):
        _check_ack(ok, 6)
    refused = (
        b'{"error":{"code":400,"err_code":10054,"description":"message size exceeds maximum'
        b' allowed"},"stream":"BENCH","seq":0}'
    )
    with pytest.raises(JetStreamError, match="message size exceeds"):
        _check_ack(refused, 1)


def test_a_server_that_cannot_store_does_not_start(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(BenchSetupError, match="JetStream"), jetstream_server(str(not_a_dir)):
        pass


def _servers_storing_in(store_dir: Path) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):  # a process that ended while we looked
            args = cmdline.read_bytes().split(b"\0")
            if str(store_dir).encode() in args and b"-js" in args:
                found.append(cmdline.parent.name)
    return found


def test_no_server_is_left_after_an_exception(tmp_path: Path) -> None:
    def crash() -> None:
        with jetstream_server(str(tmp_path)):
            assert _servers_storing_in(tmp_path)
            raise RuntimeError("the bench failed")

    with pytest.raises(RuntimeError, match="the bench failed"):
        crash()
    assert not _servers_storing_in(tmp_path)


async def test_a_stream_of_three_replicas_on_a_cluster() -> None:
    with jetstream_cluster(3, sync_always=False) as cluster:
        first = cluster.nodes[0]
        leader = await jetstream_add(first.host, first.port, 3)
        assert leader in {"n0", "n1", "n2"}
        on_leader = cluster.nodes[int(leader[1:])]
        latencies: list[float] = []
        appended = await jetstream_append(
            on_leader.host, on_leader.port, COUNT, 100, replicas=3, latencies=latencies
        )
        assert appended > 0
        assert len(latencies) == COUNT
        assert min(latencies) > 0

        # Every node holds a replica (an ack needs two of three: the third may lag a little).
        def held(port: int) -> list[tuple[str, int]]:
            streams = nats_monitor(port, "jsz?streams=true")["account_details"][0]["stream_detail"]
            return [(s["name"], s["state"]["messages"]) for s in streams]

        wait_until(
            "every node holding the stream",
            lambda: all(held(port) == [("BENCH", COUNT)] for port in cluster.monitors),
        )


def test_sync_always_is_refused_when_the_server_cannot_start_with_it() -> None:
    refused = sync_always_refused()
    if refused:  # nats-server 2.9 and older
        assert "sync_interval" in refused
        with (
            pytest.raises(BenchSetupError, match="sync_interval"),
            jetstream_cluster(3, sync_always=True),
        ):
            pass
    else:
        with jetstream_cluster(3, sync_always=True) as cluster:
            assert len(cluster.nodes) == 3
