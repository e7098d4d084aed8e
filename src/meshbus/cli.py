"""The ``meshbus`` command: a thin layer over the library.

Every command connects with ``meshbus.connect``, does one thing through the
public service API and exits. Library errors become one-line messages (exit 1),
never tracebacks; ``request`` and ``send --notify`` report a timeout or a
missing route with their own exit codes so scripts can tell them apart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import click

from meshbus.address import Address, Unicast
from meshbus.errors import MeshbusError, NoRoute, Timeout
from meshbus.protocol.layout import DEFAULT_MAX_FRAME, MIN_MAX_FRAME
from meshbus.util import parse_hostport

if TYPE_CHECKING:
    from rich.console import RenderableType

    from meshbus.client import Connector, Message, Service, Undeliverable

DEFAULT_BROKER = "127.0.0.1:7400"
DEFAULT_SERVER = "cli"

# Exit codes besides click's own (1 error, 2 usage), the same for every command.
EXIT_TIMEOUT = 3
EXIT_NO_ROUTE = 4

ADDRESS_HELP = """\b
Addresses:
  SERVER:INSTANCE   one service (unicast), e.g. game01:5; the server name is
                    at most 11 bytes, fixed instances are 1..65535
  multicast:NAME    a topic: every member gets a copy, e.g. multicast:chat
  anycast:NAME      a pool: exactly one member gets each message,
                    e.g. anycast:login
  Group names are at most 15 bytes; names may not contain ':'."""

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class _Parsed(click.ParamType[T]):
    """A parameter checked by ``parse`` when it is read, so a typo fails with its message."""

    def __init__(self, name: str, parse: Callable[[str], T]) -> None:
        self.name = name
        self._parse = parse

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> T:
        if not isinstance(value, str):
            return value  # type: ignore[return-value]  # already converted (a default)
        try:
            return self._parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def _check_hostport(text: str) -> str:
    parse_hostport(text)
    return text


def _check_server_name(text: str) -> str:
    Unicast(text, 1)  # the server part of a unicast address: <= 11 bytes of UTF-8, no ':'
    return text


HOSTPORT = _Parsed("HOST:PORT", _check_hostport)
ADDRESS = _Parsed("ADDRESS", Address.parse)
SERVER_NAME = _Parsed("NAME", _check_server_name)


class TimedOut(click.ClickException):
    """Printed as ``Error: ...`` on stderr; exit code 3."""

    exit_code = EXIT_TIMEOUT


class NoRouteFailure(click.ClickException):
    """Printed as ``Error: ...`` on stderr; exit code 4."""

    exit_code = EXIT_NO_ROUTE


class _KeyValueFormatter(logging.Formatter):
    """One line per event: time, level, logger, message, then the ``extra=`` fields as
    key=value pairs, so logs stay greppable and machine-readable."""

    _STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = {k: v for k, v in vars(record).items() if k not in self._STANDARD}
        return line + "".join(f" {k}={v!r}" for k, v in fields.items())


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_KeyValueFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=ADDRESS_HELP)
@click.option("-v", "--verbose", count=True, help="More log output on stderr (-v info, -vv debug).")
@click.version_option(package_name="meshbus")
def main(verbose: int) -> None:
    """meshbus: a message-routing bus for game and service back ends.

    Start a broker with `meshbus broker`, then talk to it with `send`, `listen`,
    `request`, `reply` and `stat`. Addresses are written SERVER:INSTANCE
    (unicast), multicast:NAME or anycast:NAME.
    """
    _setup_logging(verbose)


@main.command()
@click.option(
    "--listen",
    "listen",
    type=HOSTPORT,
    default=DEFAULT_BROKER,
    show_default=True,
    help="Address to accept connectors on; port 0 picks a free port.",
)
@click.option("--name", default="", help="Broker name (default: broker-PORT, with the bound port).")
@click.option(
    "--max-frame",
    type=click.IntRange(MIN_MAX_FRAME, 2**31),
    default=DEFAULT_MAX_FRAME,
    show_default=True,
    help="Largest frame accepted or sent, in bytes.",
)
@click.option(
    "--max-pending-bytes",
    type=click.IntRange(1),
    default=64 * 1024 * 1024,
    show_default=True,
    help="A link with more unsent output than this is closed as a slow consumer.",
)
def broker(listen: str, name: str, max_frame: int, max_pending_bytes: int) -> None:
    """Run a broker in the foreground until SIGINT or SIGTERM.

    Prints one line when ready: `meshbus broker NAME listening on HOST:PORT`.
    """
    import uvloop

    from meshbus.broker import BrokerConfig, serve

    host, port = parse_hostport(listen)
    config = BrokerConfig(
        host=host,
        port=port,
        name=name,
        max_frame=max_frame,
        max_pending_bytes=max_pending_bytes,
    )
    try:
        uvloop.run(serve(config))
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {listen}: {exc.strerror or exc}") from exc


# -- shared plumbing ------------------------------------------------------------


def _connection_options(command: F) -> F:
    """--broker and --server, the same on every client command."""
    command = click.option(
        "--server",
        type=SERVER_NAME,
        default=DEFAULT_SERVER,
        show_default=True,
        help="Server name of the command's own dynamic address (SERVER:65536 and up).",
    )(command)
    command = click.option(
        "--broker",
        "broker_address",
        type=HOSTPORT,
        default=DEFAULT_BROKER,
        show_default=True,
        help="Broker to connect to.",
    )(command)
    return command


def _run(coro: Coroutine[Any, Any, T], *, interruptible: bool = False) -> T | None:
    """Run ``coro`` on uvloop; a library error becomes a one-line message and exit 1.

    ``interruptible`` commands (listen, reply) run until Ctrl-C, so for them
    Ctrl-C is the normal way out and ends the command quietly with exit 0.
    """
    import uvloop

    try:
        return uvloop.run(coro)
    except MeshbusError as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        if not interruptible:
            raise
        return None


def _payload(text: str) -> bytes:
    """A command-line argument as bytes: UTF-8, and bytes that are not are passed through."""
    return text.encode("utf-8", errors="surrogateescape")


def _text(payload: bytes) -> str:
    """A payload for a one-line display: UTF-8, undecodable bytes and line breaks escaped."""
    text = payload.decode("utf-8", errors="backslashreplace")
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _print_message(msg: Message, as_json: bool) -> None:
    if as_json:
        line = json.dumps(
            {
                "src": str(msg.src),
                "dst": str(msg.dst),
                "payload": msg.payload.decode("utf-8", errors="backslashreplace"),
                "request": msg.is_request,
                "msg_id": msg.msg_id,
            }
        )
    else:
        line = f"[{msg.src} -> {msg.dst}] {_text(msg.payload)}"
    click.echo(line)  # click.echo flushes, so a reader on a pipe sees each line at once


def _check_bindable(address: Address) -> None:
    if isinstance(address, Unicast) and not address.is_fixed:
        raise click.BadParameter(
            f"{address} is a dynamic instance id; only fixed ids 1..65535 can be registered "
            "by name (use a fixed id or a group address)",
            param_hint="'ADDRESS'",
        )


def _server_for(address: Address, server: str) -> str:
    """The connector's server name: the address's own for a unicast address."""
    return address.server if isinstance(address, Unicast) else server


async def _bind(conn: Connector, address: Address) -> Service:
    """Become reachable at ``address``: register the fixed unicast instance, or register a
    dynamic service and join the group."""
    if isinstance(address, Unicast):
        return await conn.register(instance=address.instance)
    service = await conn.register()
    await service.join(address)
    return service


# -- send ------------------------------------------------------------------------


@main.command(epilog=ADDRESS_HELP)
@_connection_options
@click.option(
    "--notify",
    is_flag=True,
    help=f"Ask the broker to report a missing route; exit {EXIT_NO_ROUTE} if it does.",
)
@click.argument("address", type=ADDRESS)
@click.argument("text")
def send(broker_address: str, server: str, notify: bool, address: Address, text: str) -> None:
    """Send TEXT (UTF-8) to ADDRESS, at most once, and exit.

    The message comes from a dynamic address SERVER:N. A send with no route is
    dropped silently unless --notify is given.

    \b
    Exit codes: 0 sent, 1 error (e.g. no broker),
    2 bad arguments, 4 no route (with --notify).
    """
    _run(_send(broker_address, server, address, _payload(text), notify))


async def _send(
    broker_address: str, server: str, address: Address, payload: bytes, notify: bool
) -> None:
    import meshbus

    async with await meshbus.connect(broker_address, server=server) as conn:
        service = await conn.register()
        failed: list[Undeliverable] = []
        conn.on_undeliverable(failed.append)
        await service.send(address, payload, notify=notify)
        # The broker answers in the order it reads: PONG comes after the send was routed
        # (and after its NO_ROUTE, if any), so the message has left this process.
        await conn.ping()
    if failed:
        raise NoRouteFailure(f"no route to {failed[0].dst}: {failed[0].reason}")


# -- listen ----------------------------------------------------------------------


@main.command(epilog=ADDRESS_HELP)
@_connection_options
@click.option(
    "--count", type=click.IntRange(1), default=None, help="Stop after N messages (default: never)."
)
@click.option(
    "--timeout",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help=f"Stop after S seconds; with --count, exit {EXIT_TIMEOUT} if fewer than N came.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per message.")
@click.argument("address", type=ADDRESS)
def listen(
    broker_address: str,
    server: str,
    count: int | None,
    timeout: float | None,
    as_json: bool,
    address: Address,
) -> None:
    """Print the messages sent to ADDRESS, one per line: [SOURCE -> DESTINATION] PAYLOAD.

    A group address (multicast:NAME, anycast:NAME) is joined by a dynamic
    service SERVER:N. A unicast address SERVER:INSTANCE is registered itself,
    so `meshbus listen game01:5` listens as game01:5 (--server is ignored).
    Runs until --count messages came, --timeout passed, or Ctrl-C.

    \b
    Exit codes: 0 done, 1 error (e.g. address in use, no broker),
    2 bad arguments, 3 --timeout passed before --count messages.
    """
    _check_bindable(address)
    _run(
        _listen(broker_address, _server_for(address, server), address, count, timeout, as_json),
        interruptible=True,
    )


async def _listen(
    broker_address: str,
    server: str,
    address: Address,
    count: int | None,
    timeout: float | None,
    as_json: bool,
) -> None:
    import meshbus

    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    received = 0
    async with await meshbus.connect(broker_address, server=server) as conn:
        service = await _bind(conn, address)
        click.echo(f"listening on {address} as {service.address}", err=True)
        while count is None or received < count:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                break
            try:
                msg = await service.recv(timeout=remaining)
            except Timeout:
                break
            _print_message(msg, as_json)
            received += 1
    if count is not None and received < count:
        raise TimedOut(f"received {received} of {count} messages within {timeout} s")


# -- request ---------------------------------------------------------------------


@main.command(epilog=ADDRESS_HELP)
@_connection_options
@click.option(
    "--timeout",
    type=click.FloatRange(0, min_open=True),
    default=5.0,
    show_default=True,
    help="Seconds to wait for the response.",
)
@click.argument("address", type=ADDRESS)
@click.argument("text")
def request(broker_address: str, server: str, timeout: float, address: Address, text: str) -> None:
    """Send TEXT (UTF-8) as a request to ADDRESS and print the response's payload.

    For an anycast address one member answers; for a multicast address the
    first response wins.

    \b
    Exit codes: 0 response printed, 1 error (e.g. no broker),
    2 bad arguments, 3 timeout (no response in time),
    4 no route (nobody serves ADDRESS).
    """
    _run(_request(broker_address, server, address, _payload(text), timeout))


async def _request(
    broker_address: str, server: str, address: Address, payload: bytes, timeout: float
) -> None:
    import meshbus

    async with await meshbus.connect(broker_address, server=server) as conn:
        service = await conn.register()
        try:
            response = await service.request(address, payload, timeout=timeout)
        except Timeout as exc:
            raise TimedOut(str(exc)) from exc
        except NoRoute as exc:
            raise NoRouteFailure(str(exc)) from exc
    click.echo(response.payload.decode("utf-8", errors="backslashreplace"))


# -- reply -----------------------------------------------------------------------


@main.command(epilog=ADDRESS_HELP)
@_connection_options
@click.option(
    "--echo",
    "echo",
    is_flag=True,
    help="Answer each request with its own payload (the default).",
)
@click.option("--text", default=None, help="Answer each request with this text instead.")
@click.option(
    "--count",
    type=click.IntRange(1),
    default=None,
    help="Stop after answering N requests (default: never).",
)
@click.option("--json", "as_json", is_flag=True, help="Print each request as a JSON object.")
@click.argument("address", type=ADDRESS)
def reply(
    broker_address: str,
    server: str,
    echo: bool,
    text: str | None,
    count: int | None,
    as_json: bool,
    address: Address,
) -> None:
    """Answer the requests sent to ADDRESS, printing each one as `listen` does.

    ADDRESS is joined (groups) or registered (SERVER:INSTANCE) as for
    `listen`. Plain (non-request) messages are printed but not answered.
    Runs until --count requests were answered, or Ctrl-C.

    \b
    Exit codes: 0 done, 1 error (e.g. address in use, no broker),
    2 bad arguments.
    """
    if echo and text is not None:
        raise click.UsageError("--echo and --text exclude each other")
    _check_bindable(address)
    answer = None if text is None else _payload(text)
    _run(
        _reply(broker_address, _server_for(address, server), address, answer, count, as_json),
        interruptible=True,
    )


async def _reply(
    broker_address: str,
    server: str,
    address: Address,
    answer: bytes | None,
    count: int | None,
    as_json: bool,
) -> None:
    import meshbus

    answered = 0
    async with await meshbus.connect(broker_address, server=server) as conn:
        service = await _bind(conn, address)
        click.echo(f"answering {address} as {service.address}", err=True)
        while count is None or answered < count:
            msg = await service.recv()
            _print_message(msg, as_json)
            if msg.is_request:
                await msg.reply(msg.payload if answer is None else answer)
                answered += 1
        # The last response must reach the broker before the link closes.
        await conn.ping()


# -- stat ------------------------------------------------------------------------


@main.command()
@_connection_options
@click.option("--json", "as_json", is_flag=True, help="Print the broker's raw answer as JSON.")
def stat(broker_address: str, server: str, as_json: bool) -> None:
    """Show the broker's view: links, services, groups and counters.

    The command's own connection is one of the links listed.
    """
    data = _run(_stat(broker_address, server))
    assert data is not None
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    from rich.console import Console

    console = Console()
    for renderable in stat_renderables(data):
        console.print(renderable)


async def _stat(broker_address: str, server: str) -> dict[str, Any]:
    import meshbus

    async with await meshbus.connect(broker_address, server=server) as conn:
        return await conn.stat()


def stat_renderables(data: dict[str, Any]) -> list[RenderableType]:
    """Rich tables for a ``conn.stat()`` answer (also used by ``python -m meshbus.demo``)."""
    from rich.table import Table

    title = (
        f"broker [bold]{data.get('broker', '?')}[/] on {data.get('address', '?')}, "
        f"up {data.get('uptime_s', 0)} s, {len(data.get('services', []))} services"
    )
    links = Table(title="links", title_justify="left")
    for column in ("id", "name", "peer", "state"):
        links.add_column(column, overflow="fold")
    links.add_column("services", no_wrap=True)
    links.add_column("msgs in/out", justify="right")
    links.add_column("bytes in/out", justify="right")
    for link in data.get("links", []):
        links.add_row(
            str(link.get("id", "")),
            str(link.get("name", "")),
            str(link.get("peer", "")),
            str(link.get("state", "")),
            "\n".join(link.get("services", [])) or "-",
            f"{link.get('msgs_in', '?')}/{link.get('msgs_out', '?')}",
            f"{link.get('bytes_in', '?')}/{link.get('bytes_out', '?')}",
        )
    groups = Table(title="groups", title_justify="left")
    groups.add_column("group")
    groups.add_column("members", justify="right")
    groups.add_column("member addresses")
    for group, members in sorted(data.get("groups", {}).items()):
        groups.add_row(group, str(len(members)), ", ".join(members))
    counters = Table(title="counters", title_justify="left")
    counters.add_column("counter")
    counters.add_column("value", justify="right")
    for name, value in data.get("counters", {}).items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in sorted(value.items())) or "-"
        counters.add_row(name, str(value))
    return [title, links, groups, counters]


def _add_bench() -> None:
    from meshbus.bench.cli import bench

    main.add_command(bench)


_add_bench()


if __name__ == "__main__":
    main()
