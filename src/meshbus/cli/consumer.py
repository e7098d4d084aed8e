"""``meshbus stream consumer``: durable consumers from the shell.

A durable consumer is a cursor over one stream that the stream's host keeps: ``next``
takes the messages it has not delivered yet (and those whose ack did not come within
``ack_wait``), ``ack`` acknowledges them, and it resumes where it stopped, after a
restart too. The commands are ``conn.streams.consumer`` and ``Consumer``'s calls, one
or a few requests each, through any broker of the mesh (meshbus.cli.stream's options).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from meshbus.cli.common import Access, Parsed, plain_row, run
from meshbus.cli.stream import STREAM_NAME, any_broker_option, connect, json_option, print_message

if TYPE_CHECKING:
    from meshbus.client.streams import StreamMessage

# Asked for at a time by `next`; the broker sends fewer when they would not fit a frame.
_PAGE = 1000
# How often `next --wait` asks again while nothing is there.
_POLL = 0.1


def _check_consumer_name(text: str) -> str:
    from meshbus.storage.store import check_name

    check_name("consumer", text)
    return text


CONSUMER_NAME = Parsed("CONSUMER", _check_consumer_name)


@click.group()
def consumer() -> None:
    """Durable consumers: cursors over a stream that its host broker keeps.

    A consumer delivers each message of its stream once, in order; a message not
    acknowledged (`ack`) within --ack-wait is delivered again, up to --max-deliver
    times. It resumes where it stopped, after a restart of the broker too. Only the
    user that added it may use or delete it (or one with the operator right
    `consumers`).
    """


# -- add ------------------------------------------------------------------------------------


@consumer.command()
@click.argument("stream", type=STREAM_NAME)
@click.argument("name", type=CONSUMER_NAME)
@click.option(
    "--ack-wait",
    type=click.FloatRange(0, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds a delivered message waits for its ack before it is delivered again.",
)
@click.option(
    "--max-deliver",
    type=click.IntRange(0),
    default=5,
    show_default=True,
    help="Deliver a message at most this many times, then give it up (0: no limit).",
)
@click.option(
    "--start-seq",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="The first seq to deliver (0: the stream's first message).",
)
@any_broker_option
@json_option
def add(
    stream: str,
    name: str,
    ack_wait: float,
    max_deliver: int,
    start_seq: int,
    broker_address: str,
    access: Access,
    as_json: bool,
) -> None:
    """Add consumer NAME to stream STREAM; prints it as `info` does.

    Adding an existing consumer with the same settings changes nothing; with
    other settings it is refused (delete it first).
    """

    async def go() -> dict[str, Any]:
        async with await connect(broker_address, access) as conn:
            made = await conn.streams.consumer(
                stream, name, ack_wait=ack_wait, max_deliver=max_deliver, start_seq=start_seq
            )
            return await made.info()

    state = run(go())
    assert state is not None
    _print_consumers([state], as_json, one=True)


# -- info, list -------------------------------------------------------------------------------


@consumer.command()
@click.argument("stream", type=STREAM_NAME)
@click.argument("name", type=CONSUMER_NAME)
@any_broker_option
@json_option
def info(stream: str, name: str, broker_address: str, access: Access, as_json: bool) -> None:
    """Show consumer NAME of STREAM: its settings, where it is, what waits for an ack.

    --json prints one object with the keys stream, name, ack_wait, max_deliver,
    start_seq, owner, next_seq (the next new message it delivers), ack_floor
    (every seq up to it is acknowledged), pending (delivered, waiting for an
    ack) and dropped (given up after --max-deliver deliveries).
    """

    async def go() -> dict[str, Any]:
        async with await connect(broker_address, access) as conn:
            return await conn.streams.bind_consumer(stream, name).info()

    state = run(go())
    assert state is not None
    _print_consumers([state], as_json, one=True)


@consumer.command(name="list")
@click.argument("stream", type=STREAM_NAME)
@any_broker_option
@json_option
def list_(stream: str, broker_address: str, access: Access, as_json: bool) -> None:
    """List the consumers of STREAM, with where each one is.

    A consumer of another user is listed by name only (its figures are its
    owner's to read). --json prints a list of the objects `info --json` prints;
    such a consumer's object has only stream, name and error.
    """
    from meshbus.errors import PermissionDenied

    async def go() -> list[dict[str, Any]]:
        async with await connect(broker_address, access) as conn:
            names = (await conn.streams.info(stream)).consumers
            states: list[dict[str, Any]] = []
            for name in names:
                try:
                    states.append(await conn.streams.bind_consumer(stream, name).info())
                except PermissionDenied as exc:
                    states.append({"stream": stream, "name": name, "error": str(exc)})
            return states

    states = run(go())
    assert states is not None
    if not states and not as_json:
        click.echo(f"stream {stream} has no consumers", err=True)
        return
    _print_consumers(states, as_json)


# The rows of `info`; `list` shows the first six (the settings are `info`'s to show).
_FIELDS = (
    ("consumer", "name"),
    ("owner", "owner"),
    ("next seq", "next_seq"),
    ("ack floor", "ack_floor"),
    ("pending", "pending"),
    ("dropped", "dropped"),
    ("ack wait", "ack_wait"),
    ("max deliver", "max_deliver"),
    ("start seq", "start_seq"),
)
_LISTED = _FIELDS[:6]


def _shown(key: str, state: dict[str, Any]) -> str:
    value = state.get(key)
    if key == "owner":
        return str(value) if value else "-"  # nobody's: made on a broker without users
    if key == "ack_wait" and isinstance(value, float):
        return f"{value:g} s"
    if key == "max_deliver" and value == 0:
        return "no limit"
    if key == "start_seq" and value == 0:
        return "first"
    return "-" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def _print_consumers(states: list[dict[str, Any]], as_json: bool, *, one: bool = False) -> None:
    if as_json:
        click.echo(json.dumps(states[0] if one else states, indent=2))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if one:
        state = states[0]
        table = Table(title=f"consumer {escape(state['name'])}", show_header=False,
                      title_justify="left")  # fmt: skip
        table.add_column("field")
        table.add_column("value")
        plain_row(table, "stream", state["stream"])
        for label, key in _FIELDS[1:]:
            plain_row(table, label, _shown(key, state))
    else:
        table = Table(title=f"consumers of stream {escape(states[0]['stream'])}")
        for label, _ in _LISTED:
            table.add_column(label, justify="left" if label in ("consumer", "owner") else "right")
        for state in states:
            if "error" in state:
                plain_row(table, state["name"], "another user's", *("" for _ in _LISTED[2:]))
            else:
                plain_row(table, *(_shown(key, state) for _, key in _LISTED))
    Console().print(table)


# -- next, ack --------------------------------------------------------------------------------


@consumer.command(name="next")
@click.argument("stream", type=STREAM_NAME)
@click.argument("name", type=CONSUMER_NAME)
@click.option(
    "--count",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Take at most this many messages.",
)
@click.option(
    "--wait",
    type=click.FloatRange(0),
    default=0.0,
    show_default=True,
    help="Seconds to wait for a first message when none is there (0: answer at once).",
)
@click.option(
    "--ack",
    "ack_them",
    is_flag=True,
    help="Acknowledge each message once it is printed (without it, ack them with "
    "`ack`, or they come again after the consumer's ack wait).",
)
@any_broker_option
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="One JSON object per line: seq, stored_at (Unix time), src, dst, payload, group, "
    "priority, delivery (1 the first time, more when delivered again).",
)
def next_(
    stream: str,
    name: str,
    count: int,
    wait: float,
    ack_them: bool,
    broker_address: str,
    access: Access,
    as_json: bool,
) -> None:
    """Take up to --count messages of consumer NAME of STREAM and print them.

    Each line as `meshbus stream fetch` prints it, with `(delivery N)` after the
    time for a message delivered again. Messages are delivered once each: print
    them with --ack, or acknowledge them with `ack` within the consumer's ack
    wait. Prints nothing (and says so on stderr) when nothing is waiting.
    """

    async def go() -> int:
        import asyncio

        async with await connect(broker_address, access) as conn:
            taker = conn.streams.bind_consumer(stream, name)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait
            taken = 0
            while taken < count:
                page: list[StreamMessage] = await taker.next(min(count - taken, _PAGE))
                if not page:
                    if taken or loop.time() >= deadline:
                        break
                    await asyncio.sleep(_POLL)
                    continue
                for message in page:
                    print_message(message, as_json, delivery=True)
                if ack_them:
                    await taker.ack(page)
                taken += len(page)
            return taken

    if not run(go()):
        click.echo(f"no message waits for consumer {name} of stream {stream}", err=True)


def _seq(text: str) -> int:
    seq = int(text)
    if seq < 1:
        raise ValueError(f"{text} is not a seq: seqs start at 1")
    return seq


@consumer.command()
@click.argument("stream", type=STREAM_NAME)
@click.argument("name", type=CONSUMER_NAME)
@click.argument("seqs", nargs=-1, required=True, type=Parsed("SEQ", _seq))
@any_broker_option
def ack(stream: str, name: str, seqs: tuple[int, ...], broker_address: str, access: Access) -> None:
    """Acknowledge the messages SEQS (their seqs, as `next` printed them) of consumer
    NAME of STREAM: they are not delivered again.

    Says how many of them were waiting for an ack; acking one that was not (acked
    already, never delivered, given up) changes nothing.
    """

    async def go() -> int:
        async with await connect(broker_address, access) as conn:
            return await conn.streams.bind_consumer(stream, name).ack(list(seqs))

    acked = run(go())
    others = len(seqs) - (acked or 0)
    were = "was" if others == 1 else "were"
    note = f" ({others} {were} not waiting for an ack)" if others else ""
    click.echo(f"acked {acked} of {len(seqs)}{note}")


# -- delete ---------------------------------------------------------------------------------


@consumer.command()
@click.argument("stream", type=STREAM_NAME)
@click.argument("name", type=CONSUMER_NAME)
@any_broker_option
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
def delete(stream: str, name: str, broker_address: str, access: Access, yes: bool) -> None:
    """Delete consumer NAME of STREAM: its position and what waits for an ack. The
    stream's messages stay.

    Asks for confirmation unless --yes is given.
    """
    if not yes:
        click.confirm(
            f"Delete consumer {name} of stream {stream} and its position?", abort=True, err=True
        )

    async def go() -> None:
        async with await connect(broker_address, access) as conn:
            await conn.streams.bind_consumer(stream, name).delete()

    run(go())
    click.echo(f"deleted consumer {name} of stream {stream}")
