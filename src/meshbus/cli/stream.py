"""``meshbus stream``: create, inspect, read and delete durable streams.

A thin layer over ``conn.streams``: each command opens an operator's link to the
broker named by --broker (never redirected, not counted as a connector), makes one
or a few STREAM requests and exits. A stream is hosted by the broker ``add`` talks
to; every other command works through any broker of the mesh, which relays the
request to the host. Library errors become one-line messages and exit 1, bad
arguments exit 2 (click's usage errors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import click

from meshbus.address import Address, Multicast
from meshbus.cli.common import (
    DEFAULT_SERVER,
    Access,
    Parsed,
    access_options,
    broker_option,
    plain_row,
    run,
)
from meshbus.cli.lazy import LazyGroup
from meshbus.errors import StreamError

if TYPE_CHECKING:
    from meshbus.client.connector import Connector
    from meshbus.client.streams import StreamInfo, StreamMessage

F = TypeVar("F", bound=Callable[..., Any])

# One fetch request asks for at most this many; the broker sends fewer when they would not
# fit in one frame (1 MiB by default), and the command simply asks again from there.
_PAGE = 1000


def _check_stream_name(text: str) -> str:
    from meshbus.storage.store import check_name

    check_name("stream", text)
    return text


def _parse_capture(text: str) -> Address:
    address = Address.parse(text)
    if not isinstance(address, Multicast):
        raise ValueError(
            f"{address} is not a multicast address; a stream captures what is sent to "
            "multicast:NAME addresses"
        )
    return address


STREAM_NAME = Parsed("NAME", _check_stream_name)
CAPTURE = Parsed("multicast:NAME", _parse_capture)


def any_broker_option(command: F) -> F:
    """--broker and the access options (--creds, --tls-*) of every stream command but
    ``add``: any broker of the mesh will do."""
    return broker_option(
        "--broker",
        "broker_address",
        help_text="Broker to ask (HOST:PORT, or HOST:PORT,HOST:PORT: the first that answers); "
        "any broker of the mesh relays the request to the stream's host.",
    )(access_options(command))


def json_option(command: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(
        command
    )


async def connect(broker_address: str, access: Access) -> Connector:

    return await access.connect(broker_address, server=DEFAULT_SERVER, operator=True)


@click.group(cls=LazyGroup, elsewhere={"consumer": "meshbus.cli.consumer:consumer"})
def stream() -> None:
    """Durable streams: messages sent to a multicast address, stored and numbered.

    A stream captures every message sent to its multicast addresses, mesh-wide,
    and numbers them 1, 2, 3, ... on the broker that hosts it (kept in
    --data-dir/streams.db, or in memory without --data-dir). Publish to it with
    `meshbus send multicast:NAME ...` or, acknowledged once stored, with a
    reliable send from the library; read it back with `meshbus stream fetch`,
    or take it with acks through a durable consumer (`meshbus stream consumer`).
    """


# -- add -------------------------------------------------------------------------------------


@stream.command()
@click.argument("name", type=STREAM_NAME)
@click.option(
    "--capture",
    "captures",
    type=CAPTURE,
    multiple=True,
    required=True,
    help="A multicast address whose messages the stream stores, e.g. multicast:orders "
    "(repeat for more).",
)
@click.option(
    "--max-msgs",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Keep at most this many messages, dropping the oldest (0: no limit).",
)
@click.option(
    "--max-bytes",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Keep at most this many payload bytes, dropping the oldest messages (0: no limit).",
)
@click.option(
    "--max-age",
    type=click.FloatRange(0),
    default=0.0,
    show_default=True,
    help="Drop messages older than this many seconds (0: no limit).",
)
@click.option(
    "--dedupe-window",
    type=click.FloatRange(0),
    default=120.0,
    show_default=True,
    help="Seconds during which a publish with the same publish id is stored only once "
    "(0: no deduplication).",
)
@click.option(
    "--replicas",
    type=click.Choice(["1", "3", "5"]),
    default="1",
    show_default=True,
    help="How many brokers hold the stream. 3 or 5: a Raft group on brokers the --broker "
    "picks among the ready ones (each needs --data-dir); a reliable send is acknowledged "
    "once a majority has it on disk, and the stream survives the loss of a minority.",
)
@broker_option(
    "--broker",
    "broker_address",
    one=True,
    help_text="The broker that is to host the stream (stores its messages); with "
    "--replicas 3 or 5, the one that places it.",
)
@access_options
@json_option
def add(
    name: str,
    captures: tuple[Address, ...],
    max_msgs: int,
    max_bytes: int,
    max_age: float,
    dedupe_window: float,
    replicas: str,
    broker_address: str,
    access: Access,
    as_json: bool,
) -> None:
    """Create stream NAME on the --broker broker, capturing the --capture addresses.

    Adding an existing stream with the same settings changes nothing; with other
    settings it is refused (delete it first). Prints the stream as `info` does.
    """

    async def go() -> StreamInfo:
        async with await connect(broker_address, access) as conn:
            return await conn.streams.add(
                name,
                list(captures),
                max_msgs=max_msgs,
                max_bytes=max_bytes,
                max_age=max_age,
                dedupe_window=dedupe_window,
                replicas=int(replicas),
            )

    info = run(go())
    assert info is not None
    _print_info(info, as_json)


# -- info, list --------------------------------------------------------------------------------


@stream.command()
@click.argument("name", type=STREAM_NAME)
@any_broker_option
@json_option
def info(name: str, broker_address: str, access: Access, as_json: bool) -> None:
    """Show stream NAME: its host broker, first and last seq, messages, payload bytes,
    consumers and limits.

    --json prints one object with the keys name, broker, captures, first_seq,
    last_seq, messages, bytes, consumers, max_msgs, max_bytes, max_age,
    dedupe_window, store, host and owner (the user that added it; "" on a broker
    without users), and replicas, leader, replica_states and learners (a replicated
    stream's voting brokers, the one leading it, each one's state and lag as its
    leader knows them, and the brokers being added in place of a lost one; [], "",
    [] and [] otherwise). An empty stream has last_seq = first_seq - 1.
    """

    async def go() -> StreamInfo:
        async with await connect(broker_address, access) as conn:
            found = await conn.streams.info(name)
            if found.replicas and found.leader:
                # Only the leader knows how far behind each replica is.
                with contextlib.suppress(StreamError):
                    found = await conn.streams.info(name, current=True)
            return found

    result = run(go())
    assert result is not None
    _print_info(result, as_json)


def byte_size(size: int) -> str:
    """``1,073,741,824 (1 GiB)``: the exact count, and in binary units past 1 KiB."""
    exact = f"{size:,}"
    if size < 1024:
        return exact
    scaled = float(size)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        scaled /= 1024
        if scaled < 1024 or unit == "PiB":
            break
    shown = f"{scaled:.3g}" if scaled < 1000 else f"{scaled:,.0f}"
    return f"{exact} ({shown} {unit})"


def _print_info(info: StreamInfo, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(info), indent=2))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"stream {escape(info.name)}", show_header=False, title_justify="left")
    table.add_column("field")
    table.add_column("value")

    def limit(value: float, unit: str = "") -> str:
        return f"{value:g}{unit}" if value else "none"

    def count(value: int) -> str:
        return f"{value:,}" if value else "none"

    rows = [
        ("host broker", info.broker),
        ("owner", info.owner or "-"),
        ("stored in", f"{info.store} on {info.host}" if info.store else "memory"),
        ("captures", ", ".join(info.captures)),
        ("messages", f"{info.messages:,}"),
        ("bytes", byte_size(info.bytes)),
        ("first seq", str(info.first_seq)),
        ("last seq", str(info.last_seq)),
        ("consumers", ", ".join(info.consumers) or "-"),
        ("max msgs", count(info.max_msgs)),
        ("max bytes", byte_size(info.max_bytes) if info.max_bytes else "none"),
        ("max age", limit(info.max_age, " s")),
        ("dedupe window", limit(info.dedupe_window, " s")),
    ]
    if info.replicas:
        rows[:1] = [
            ("answered by", info.broker),
            ("replicas", ", ".join(info.replicas)),
            *(
                [("learners", ", ".join(info.learners) + " (copying the log, not counted yet)")]
                if info.learners
                else []
            ),
            ("leader", info.leader or "none (an election is under way, or a majority is down)"),
            *(
                (
                    f"replica {r['broker']}",
                    f"{r['state']}{'' if r.get('voter', True) else ' learner'}, "
                    f"{r['lag']:,} entries behind",
                )
                for r in info.replica_states
            ),
        ]
    for field, value in rows:
        plain_row(table, field, value)
    Console().print(table)


@stream.command(name="list")
@any_broker_option
@json_option
def list_(broker_address: str, access: Access, as_json: bool) -> None:
    """List every stream of the mesh and the broker that hosts it."""

    async def go() -> list[dict[str, Any]]:
        async with await connect(broker_address, access) as conn:
            return await conn.streams.list()

    streams = run(go())
    assert streams is not None
    if as_json:
        click.echo(json.dumps(streams, indent=2))
        return
    if not streams:
        click.echo("no streams", err=True)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table()
    table.add_column("stream")
    table.add_column("host broker")
    for entry in streams:
        plain_row(table, entry["name"], entry["broker"])
    Console().print(table)


# -- fetch -------------------------------------------------------------------------------------


@stream.command()
@click.argument("name", type=STREAM_NAME)
@click.option(
    "--from",
    "from_seq",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="First seq to print; older messages that retention removed are skipped.",
)
@click.option(
    "--count",
    type=click.IntRange(1),
    default=100,
    show_default=True,
    help="Print at most this many messages.",
)
@click.option(
    "--current",
    is_flag=True,
    help="A replicated stream: read through its leader, which has every acknowledged "
    "message (a replica answers from what it has applied, which may be a moment behind).",
)
@any_broker_option
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="One JSON object per line: seq, stored_at (Unix time), src, dst, payload, group, "
    "priority.",
)
def fetch(
    name: str,
    from_seq: int,
    count: int,
    current: bool,
    broker_address: str,
    access: Access,
    as_json: bool,
) -> None:
    """Print up to --count messages of stream NAME from seq --from on, in order.

    Each line: `#SEQ TIME [SRC -> DST] PAYLOAD`, TIME in UTC. Payloads are shown as
    UTF-8 with undecodable bytes and line breaks escaped. Reading does not change
    the stream (use a durable consumer in the library to take messages with acks).
    """

    async def go() -> None:
        async with await connect(broker_address, access) as conn:
            seq, left = from_seq, count
            while left > 0:
                page = await conn.streams.fetch(name, seq, min(left, _PAGE), current=current)
                if not page:
                    return
                for message in page:
                    print_message(message, as_json)
                left -= len(page)
                seq = page[-1].seq + 1

    run(go())


def print_message(msg: StreamMessage, as_json: bool, *, delivery: bool = False) -> None:
    """One line for ``msg``: JSON, or ``#SEQ TIME [SRC -> DST] PAYLOAD``; with
    ``delivery`` (a consumer's messages) also how many times it was delivered."""
    payload = msg.payload.decode("utf-8", errors="backslashreplace")
    if as_json:
        fields: dict[str, object] = {
            "seq": msg.seq,
            "stored_at": msg.stored_at,
            "src": str(msg.src),
            "dst": str(msg.dst),
            "payload": payload,
            "group": msg.group,
            "priority": msg.priority,
        }
        if delivery:
            fields["delivery"] = msg.delivery
        line = json.dumps(fields)
    else:
        at = datetime.fromtimestamp(msg.stored_at, UTC).isoformat(timespec="milliseconds")
        text = payload.replace("\r", "\\r").replace("\n", "\\n")
        again = f" (delivery {msg.delivery})" if delivery and msg.delivery > 1 else ""
        line = f"#{msg.seq} {at.replace('+00:00', 'Z')}{again} [{msg.src} -> {msg.dst}] {text}"
    click.echo(line)


# -- delete ------------------------------------------------------------------------------------


@stream.command()
@click.argument("name", type=STREAM_NAME)
@any_broker_option
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
def delete(name: str, broker_address: str, access: Access, yes: bool) -> None:
    """Delete stream NAME with all its messages and consumers; it stops capturing.

    Asks for confirmation unless --yes is given.
    """
    if not yes:
        click.confirm(f"Delete stream {name} and all its messages?", abort=True, err=True)

    async def go() -> None:
        async with await connect(broker_address, access) as conn:
            await conn.streams.delete(name)

    run(go())
    click.echo(f"deleted stream {name}")


# -- salvage ---------------------------------------------------------------------------------


@stream.command()
@click.option(
    "--data-dir",
    required=True,
    type=click.Path(file_okay=False, exists=True),
    help="The data directory of the damaged store (its broker must be stopped).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Where to write the new store (a directory without a streams.db) "
    "[default: DATA_DIR-salvaged].",
)
def salvage(data_dir: str, out: str | None) -> None:
    """Copy every intact block of every stream of a damaged store into a new one.

    Offline: no broker may run on --data-dir, and the store there is not changed.
    Prints, per stream, what it could not save (blocks, messages, seq ranges). A
    hole left by lost blocks splits a stream: its name keeps the newest seqs, and
    each older run becomes a stream NAME.FIRST-LAST that captures nothing. Then
    start the broker with `--data-dir OUT`.
    """
    import os

    from meshbus.storage.data_dir import DataDirLocked, lock_data_dir
    from meshbus.storage.errors import StoreError
    from meshbus.storage.salvage import salvage as salvage_store

    out = out or data_dir.rstrip(os.sep) + "-salvaged"
    source = os.path.join(data_dir, "streams.db")
    target = os.path.join(out, "streams.db")
    if not os.path.exists(source):
        raise click.ClickException(f"{source} does not exist: no stream store to salvage")
    if os.path.exists(target):
        raise click.ClickException(f"{target} exists: give --out a directory without a store")
    try:
        lock = lock_data_dir(data_dir)
    except DataDirLocked as exc:
        raise click.ClickException(f"{exc}; stop it before salvaging") from None
    try:
        os.makedirs(out, exist_ok=True)
        report = salvage_store(source, target)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        lock.close()
    click.echo(f"salvaged {source} into {target}")
    click.echo(f"checks at open: {report.problem or 'nothing wrong found'}")
    for sv in report.streams:
        kept = sum(last - first + 1 for _, first, last in sv.saved)
        total = sv.last_seq - sv.first_seq + 1
        click.echo(
            f"stream {sv.name}: saved {kept} of {total} messages ({sv.blocks_saved} blocks); "
            f"lost {sv.messages_lost} messages ({sv.blocks_lost} blocks)"
        )
        for lost in sv.lost:
            click.echo(f"  lost seqs {lost.first}..{lost.last}: {lost.why}")
        for name, first, last in sv.saved:
            if name != sv.name:
                click.echo(f"  seqs {first}..{last} are in stream {name} (it captures nothing)")
    click.echo(f"start the broker with --data-dir {out}")
