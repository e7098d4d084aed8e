"""NATS JetStream as the peer of meshbus durable streams: acked appends, then range reads.

``jetstream_append`` measures how fast one producer link gets messages *stored*: every
publish carries a reply inbox, so the server answers each with a PubAck once the message is
in the file store, and at most ``window`` publishes are unacknowledged at a time.
``jetstream_fetch`` measures how fast one reader link pulls those messages back in batches.

It is a fair peer because both sides do the same work the same way: a file-backed, single
replica stream with default limits; one pipelined link per role, driven from the same kind
of asyncio loop as the meshbus bench; and the raw text protocol spoken directly (no client
library), so the driver adds no more than it does for meshbus. nats-server's defaults do
not fsync each write (it syncs every 2 minutes), so neither do we ask it to.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any, Self

import msgspec

from bench.cluster import Cluster, nats_cluster, nats_monitor, wait_until
from bench.servers import BenchSetupError, Server, find_nats_server, free_port, nats_server

STREAM = "BENCH"
SUBJECT = "bench.append"
# Bounds one wait on the server; only reached when it is broken or a check is about to fail.
_IO_TIMEOUT = 10.0
# How long a cluster that has just formed may take to place a replicated stream.
_PLACE_TIMEOUT = 20.0
# How long to wait for a stream's info before taking it that no leader answers.
_LEADER_ASK_TIMEOUT = 0.25


class JetStreamError(Exception):
    """The server refused a request, or what it stored or delivered is not what was sent."""


@contextlib.contextmanager
def jetstream_server(store_dir: str) -> Iterator[Server]:
    """A `nats-server -js` subprocess storing in ``store_dir``, on a random loopback port."""
    # "Store Directory:" is printed once JetStream has its store; without it, no JetStream.
    with nats_server(
        "-js", "-sd", store_dir, kind="nats-jetstream", after="Store Directory:"
    ) as server:
        yield server


# Every write fsynced before its ack: nats-server's `sync_interval: always` (its default is
# a sync every 2 minutes). Older servers (2.9) do not know the key.
SYNC_ALWAYS = "jetstream { sync_interval: always }\n"


def nats_server_version() -> str:
    """What the nats-server measured says of its version (``nats-server: v2.9.10``)."""
    said = subprocess.run(
        [find_nats_server(), "--version"], capture_output=True, text=True, timeout=10
    )
    return said.stdout.strip()


def sync_always_refused() -> str:
    """Why this machine's nats-server cannot fsync every write ("" if it can): what it says
    of a config file with ``SYNC_ALWAYS`` when asked to check one (-t)."""
    with tempfile.TemporaryDirectory(prefix="meshbus-bench-nats-conf-") as workdir:
        path = os.path.join(workdir, "sync.conf")
        with open(path, "w") as conf:
            conf.write(SYNC_ALWAYS)
        checked = subprocess.run(
            [find_nats_server(), "-t", "-c", path], capture_output=True, text=True, timeout=10
        )
    if checked.returncode == 0:
        return ""
    said = (checked.stderr or checked.stdout).strip().replace(path, "the config file")
    said = said.removeprefix("nats-server: ")
    return f"{nats_server_version()}: {said}"


@contextlib.contextmanager
def jetstream_cluster(size: int, sync_always: bool) -> Iterator[Cluster]:
    """``size`` clustered `nats-server -js` nodes, named n0, n1, ..., each storing in a
    directory of its own; with ``sync_always``, each fsyncs every write (``SYNC_ALWAYS``).
    Handed out once every node knows the JetStream meta leader."""

    def each(workdir: str, index: int) -> list[str]:
        args = ["-js", "-sd", os.path.join(workdir, f"js{index}"), "--server_name", f"n{index}"]
        if index == 0:
            # A clustered JetStream wants routes configured, the first node too: a route to
            # itself (which nats-server ignores), so its route port is picked here.
            route = f"nats://127.0.0.1:{free_port()}"
            args += ["--cluster", route, "--routes", route]
        if sync_always:
            path = os.path.join(workdir, "sync.conf")
            with open(path, "w") as conf:
                conf.write(SYNC_ALWAYS)
            args += ["-c", path]
        return args

    def meta_leader_known() -> bool:
        for port in cluster.monitors:
            meta = nats_monitor(port, "jsz").get("meta_cluster", {})
            if not meta.get("leader") or meta.get("cluster_size") != size:
                return False
        return True

    with nats_cluster(size, each) as cluster:
        try:
            wait_until(f"a JetStream meta leader known to {size} nats-servers", meta_leader_known)
        except BenchSetupError as exc:
            raise BenchSetupError(f"{exc} (are they JetStream-enabled?)") from exc
        yield cluster


class _Msg(msgspec.Struct):
    subject: bytes
    reply: bytes
    status: bytes  # b"" for a plain MSG; "404"/"408"/"503"... from an HMSG status line
    payload: bytes


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    error: _ApiError | None = None


_decode_ack = msgspec.json.Decoder(_PubAck).decode


def _check_ack(payload: bytes, expected_seq: int) -> None:
    ack = _decode_ack(payload)
    if ack.error is not None:
        raise JetStreamError(f"publish {expected_seq} refused: {ack.error.description}")
    # One link's publishes are stored in the order sent, so the acks count up by one.
    if ack.stream != STREAM or ack.seq != expected_seq:
        raise JetStreamError(f"ack {expected_seq} is for {ack.stream} seq {ack.seq}")


class _Link:
    """One client connection; parses whole read chunks so the driver stays cheap per message."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.inbox = b"_INBOX." + secrets.token_hex(8).encode()
        self._buf = bytearray()

    @classmethod
    async def open(cls, host: str, port: int) -> _Link:
        reader, writer = await asyncio.open_connection(host, port)
        link = cls(reader, writer)
        try:
            async with asyncio.timeout(_IO_TIMEOUT):
                info = msgspec.json.decode((await reader.readline()).removeprefix(b"INFO "))
            if not info.get("jetstream"):
                raise JetStreamError(f"{host}:{port} does not have JetStream enabled")
            writer.write(
                b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"no_responders":true}'
                b"\r\nSUB %s.> 1\r\n" % link.inbox
            )
            await link.request("$JS.API.INFO", b"")  # a round trip: CONNECT and SUB are in
        except BaseException:
            writer.close()
            raise
        return link

    def close(self) -> None:
        self.writer.close()

    def publish(self, subject: bytes, reply: bytes, payload: bytes) -> None:
        self.writer.write(b"PUB %s %s %d\r\n%s\r\n" % (subject, reply, len(payload), payload))

    async def read(self) -> list[_Msg]:
        """At least one message, more if they arrived together."""
        while True:
            async with asyncio.timeout(_IO_TIMEOUT):
                chunk = await self.reader.read(1 << 18)
            if not chunk:
                raise ConnectionError("nats-server closed the link")
            msgs = self._parse(chunk)
            if msgs:
                return msgs

    def _parse(self, chunk: bytes) -> list[_Msg]:
        buf = self._buf
        buf += chunk
        out: list[_Msg] = []
        pos = 0
        while (eol := buf.find(b"\r\n", pos)) >= 0:
            # split(), not split(b" "): 2.9 writes "MSG <subj> <sid>  <size>" with no reply.
            args = bytes(buf[pos:eol]).split()
            op = args[0].upper() if args else b""
            if op in (b"MSG", b"HMSG"):
                end = eol + 2 + int(args[-1])
                if len(buf) < end + 2:
                    break  # the rest of the body is still on its way
                body = bytes(buf[eol + 2 : end])
                status, has_reply = b"", len(args) == 5
                if op == b"HMSG":
                    head_size, has_reply = int(args[-2]), len(args) == 6
                    first = body[: body.find(b"\r\n")].split()
                    status, body = (first[1] if len(first) > 1 else b""), body[head_size:]
                out.append(_Msg(args[1], args[3] if has_reply else b"", status, body))
                pos = end + 2
                continue
            if op == b"PING":
                self.writer.write(b"PONG\r\n")  # unanswered, the server drops the link
            elif op == b"-ERR":
                raise JetStreamError(f"nats-server: {bytes(buf[pos:eol]).decode()}")
            pos = eol + 2  # INFO, PONG, +OK
        del buf[:pos]
        return out

    @property
    def api_reply(self) -> bytes:
        """The subject the JetStream API's answers come back on."""
        return self.inbox + b".api"

    async def request(self, subject: str, body: bytes) -> dict[str, Any]:
        """A JetStream API call; only for set-up, when nothing else is in flight."""
        reply = self.api_reply
        self.publish(subject.encode(), reply, body)
        while True:
            for msg in await self.read():
                if msg.subject != reply:
                    raise JetStreamError(f"unexpected message on {msg.subject!r} during set-up")
                if msg.status:
                    raise JetStreamError(f"{subject}: status {msg.status.decode()}")
                answer: dict[str, Any] = msgspec.json.decode(msg.payload)
                if "error" in answer:
                    raise JetStreamError(f"{subject}: {answer['error']}")
                return answer


def _stream_config(replicas: int) -> bytes:
    config: dict[str, Any] = {"name": STREAM, "subjects": [SUBJECT], "storage": "file"}
    if replicas > 1:
        config["num_replicas"] = replicas
    return msgspec.json.encode(config)


async def jetstream_add(host: str, port: int, replicas: int) -> str:
    """Create the stream with ``replicas`` replicas through the server at host:port, once
    the cluster can place them; the name of the server that leads it."""
    link = await _Link.open(host, port)
    try:
        deadline = time.monotonic() + _PLACE_TIMEOUT
        while True:
            try:
                created = await link.request(
                    f"$JS.API.STREAM.CREATE.{STREAM}", _stream_config(replicas)
                )
            except JetStreamError:
                # A cluster that has just formed may not know all its JetStream peers yet
                # ("insufficient resources"), or have no meta leader ("status 503").
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
                continue
            leader: str = created.get("cluster", {}).get("leader", "")
            if leader:
                return leader
            if time.monotonic() > deadline:
                raise JetStreamError(f"stream {STREAM} has no leader after {_PLACE_TIMEOUT} s")
            await asyncio.sleep(0.05)
            # Creating it again with the same config answers its info, leader included.
    finally:
        link.close()


async def jetstream_leader(host: str, port: int) -> str:
    """The name of the server that leads the stream, as the server at host:port knows it
    ("" while there is none: no answer, or an error)."""
    link: _Link | None = None
    try:
        # While the stream (or the meta group) has no leader, requests go unanswered.
        async with asyncio.timeout(_LEADER_ASK_TIMEOUT):
            link = await _Link.open(host, port)
            info = await link.request(f"$JS.API.STREAM.INFO.{STREAM}", b"")
    except (JetStreamError, TimeoutError):
        return ""
    finally:
        if link is not None:
            link.close()
    leader: str = info.get("cluster", {}).get("leader", "")
    return leader


async def jetstream_append(
    host: str,
    port: int,
    count: int,
    size: int,
    window: int = 256,
    *,
    replicas: int = 1,
    latencies: list[float] | None = None,
) -> float:
    """Store ``count`` messages of ``size`` bytes in a new stream (of ``replicas``: one made
    by ``jetstream_add`` beforehand, still empty); acknowledged messages/s. ``latencies``:
    filled with each publish's seconds from its write to its ack."""
    if count < 1 or window < 1:
        raise ValueError("count and window must be at least 1")
    link = await _Link.open(host, port)
    try:
        created = await link.request(f"$JS.API.STREAM.CREATE.{STREAM}", _stream_config(replicas))
        # Creating an existing stream with the same config succeeds and keeps its messages.
        if created["state"]["messages"]:
            raise JetStreamError(f"stream {STREAM} already holds messages; start from a new store")
        ack_subject = link.inbox + b".ack"
        # Every ack goes to one subject: acks come back in publish order, so the n-th ack must
        # carry seq n, and one pre-encoded publish serves for all.
        one = b"PUB %s %s %d\r\n%s\r\n" % (SUBJECT.encode(), ack_subject, size, b"x" * size)
        sent_at: list[float] = []
        start = time.perf_counter()
        sent = min(window, count)
        link.writer.write(one * sent)
        if latencies is not None:
            sent_at += [start] * sent
        acked = 0
        while acked < count:
            msgs = await link.read()
            now = time.perf_counter()
            before = acked
            for msg in msgs:
                if msg.subject == link.api_reply:
                    # A second answer to the stream's create, late: nats-server 2.15 in a
                    # cluster sent one once, in the middle of the acks.
                    continue
                if msg.subject != ack_subject or msg.status:
                    raise JetStreamError(f"not a PubAck: {msg}")
                acked += 1
                _check_ack(msg.payload, acked)
            if latencies is not None:
                latencies += [now - at for at in sent_at[before:acked]]
            more = min(count - sent, window - (sent - acked))
            if more > 0:
                link.writer.write(one * more)
                sent += more
                if latencies is not None:
                    sent_at += [now] * more
            await link.writer.drain()
        elapsed = time.perf_counter() - start
        state = (await link.request(f"$JS.API.STREAM.INFO.{STREAM}", b""))["state"]
        if state["last_seq"] != count or state["messages"] != count:
            raise JetStreamError(f"stream holds {state} after {count} acked publishes")
        return count / elapsed
    finally:
        link.close()


async def jetstream_fetch(host: str, port: int, count: int, batch: int = 100) -> float:
    """Read the ``count`` messages of the appended stream back in order; messages/s."""
    if count < 1 or batch < 1:
        raise ValueError("count and batch must be at least 1")
    link = await _Link.open(host, port)
    # A fresh durable each call, so the same stream can be read back by several runs.
    name = "fetch-" + secrets.token_hex(4)
    try:
        # AckPolicy none: the server just advances the consumer's cursor along the stream
        # sequence, like reading a sequence range from a given position. Explicit acks would
        # add an ack message per read plus per-message pending state and redelivery timers,
        # work a range read does not do; that would measure acking, not reading.
        config = {"durable_name": name, "name": name, "ack_policy": "none", "deliver_policy": "all"}
        request = {"stream_name": STREAM, "config": config}
        await link.request(f"$JS.API.CONSUMER.CREATE.{STREAM}.{name}", msgspec.json.encode(request))
        next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{name}".encode()
        reply = link.inbox + b".fetch"
        got = 0
        start = time.perf_counter()
        # One pull request in flight, each for a whole batch, as a client's fetch() loop does.
        # no_wait: a short stream answers at once with a 404/408 status instead of idling.
        while got < count:
            wanted = min(batch, count - got)
            link.publish(next_subject, reply, b'{"batch":%d,"no_wait":true}' % wanted)
            end = got + wanted
            while got < end:
                for msg in await link.read():
                    if msg.status:
                        raise JetStreamError(
                            f"fetch stopped at {got}: status {msg.status.decode()}"
                        )
                    # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>
                    # .<timestamp>.<pending>: the order check needs no payload of its own.
                    tokens = msg.reply.split(b".")
                    got += 1
                    if len(tokens) != 9 or int(tokens[5]) != got:
                        raise JetStreamError(f"message {got} arrived as {msg.reply!r}")
        elapsed = time.perf_counter() - start
        if int(tokens[8]) != 0:
            raise JetStreamError(f"{tokens[8].decode()} messages left after {count}")
        await link.request(f"$JS.API.CONSUMER.DELETE.{STREAM}.{name}", b"")
        return count / elapsed
    finally:
        link.close()


class JetStreamProducer:
    """Unique values published on one link to the stream, ``window`` unacknowledged at
    most, each with a reply subject of its own and a Nats-Msg-Id (the stream stores a
    resend once, within its 2-minute dedupe window). An unacknowledged one -- no answer,
    a 503 "no responders" while the stream has no leader, an error ack -- is published
    again on the meshbus connector's schedule: 0.2 s after, then twice as long each
    time, at most ``resend_max`` apart. Every acknowledged value is recorded with when."""

    def __init__(self, link: _Link, window: int, resend_max: float) -> None:
        self.acked: list[int] = []
        self.acked_at: list[float] = []
        self._link, self._window, self._resend_max = link, window, resend_max
        self._acks = link.inbox + b".ack"
        self._due: dict[int, tuple[float, float]] = {}  # value -> (resend at, wait)
        self._next = 0

    @classmethod
    async def open(cls, host: str, port: int, window: int, resend_max: float) -> Self:
        return cls(await _Link.open(host, port), window, resend_max)

    async def run(self) -> None:
        """Publish until cancelled (then the link is closed)."""
        reading = asyncio.create_task(self._read())
        try:
            self._top_up()
            while not reading.done():
                now = time.monotonic()
                for value, (at, wait) in list(self._due.items()):
                    if at <= now:
                        wait = min(wait * 2, self._resend_max)
                        self._publish(value, now + wait, wait)
                await asyncio.sleep(0.01)
            reading.result()  # its error
        finally:
            reading.cancel()
            self._link.close()

    def _publish(self, value: int, resend_at: float, wait: float) -> None:
        msg_id = b"%d" % value
        headers = b"NATS/1.0\r\nNats-Msg-Id: %s\r\n\r\n" % msg_id
        self._link.writer.write(
            b"HPUB %s %s.%s %d %d\r\n%s%s\r\n"
            % (SUBJECT.encode(), self._acks, msg_id, len(headers),
               len(headers) + len(msg_id), headers, msg_id)
        )  # fmt: skip
        self._due[value] = (resend_at, wait)

    def _top_up(self) -> None:
        now = time.monotonic()
        while len(self._due) < self._window:
            self._publish(self._next, now + 0.2, 0.2)
            self._next += 1

    async def _read(self) -> None:
        skip = len(self._acks) + 1
        while True:
            for msg in await self._link.read():
                value = int(msg.subject[skip:])
                if msg.status or value not in self._due:
                    continue  # no leader now (resent when due), or a resend's second ack
                if _decode_ack(msg.payload).error is not None:
                    continue
                del self._due[value]
                self.acked.append(value)
                self.acked_at.append(time.monotonic())
            self._top_up()


async def jetstream_payloads(host: str, port: int) -> list[bytes]:
    """Every message of the stream, read in order through a consumer of its own."""
    link = await _Link.open(host, port)
    name = "read-" + secrets.token_hex(4)
    try:
        config = {"durable_name": name, "ack_policy": "none", "deliver_policy": "all"}
        request = {"stream_name": STREAM, "config": config}
        await link.request(f"$JS.API.CONSUMER.CREATE.{STREAM}.{name}", msgspec.json.encode(request))
        next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{name}".encode()
        reply = link.inbox + b".read"
        payloads: list[bytes] = []
        while True:
            link.publish(next_subject, reply, b'{"batch":1000,"no_wait":true}')
            before = len(payloads)
            ended = False
            while not ended and len(payloads) - before < 1000:
                for msg in await link.read():
                    if msg.status:  # 404/408: nothing more for this request
                        ended = True
                    else:
                        payloads.append(msg.payload)
            if len(payloads) == before:
                return payloads
    finally:
        link.close()
