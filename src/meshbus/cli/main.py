"""The ``meshbus`` command: a thin layer over the library.

Every command connects with ``meshbus.connect``, does one thing through the
public service API and exits. Library errors become one-line messages (exit 1),
never tracebacks; ``request`` and ``send --notify`` report a timeout or a
missing route with their own exit codes so scripts can tell them apart.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import click

from meshbus.address import Address, Unicast
from meshbus.cli.common import (
    ADDRESS,
    ADDRESS_HELP,
    EXIT_NO_ROUTE,
    EXIT_TIMEOUT,
    Access,
    connection_options,
    run,
)
from meshbus.cli.lazy import LazyGroup
from meshbus.errors import NoRoute, ProtocolError, Timeout

if TYPE_CHECKING:
    from meshbus.client.connector import Connector
    from meshbus.client.inbound import Undeliverable
    from meshbus.client.message import Message
    from meshbus.client.service import Service


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


# The operator's commands live in modules of their own, imported when one runs.
_ELSEWHERE = {
    "broker": "meshbus.cli.broker:broker",
    "mesh": "meshbus.cli.admin:mesh",
    "drain": "meshbus.cli.admin:drain",
    "stat": "meshbus.cli.admin:stat",
    "top": "meshbus.cli.top:top",
    "stream": "meshbus.cli.stream:stream",
    "report": "meshbus.report.cli:report",
    "keygen": "meshbus.cli.auth:keygen",
    "hash-token": "meshbus.cli.auth:hash_token",
    "certs": "meshbus.cli.certs:certs",
    "nats-server": "meshbus.cli.nats_server:nats_server",
}


@click.group(
    cls=LazyGroup,
    elsewhere=_ELSEWHERE,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=ADDRESS_HELP,
)
@click.option("-v", "--verbose", count=True, help="More log output on stderr (-v info, -vv debug).")
@click.version_option(package_name="meshbus")
def main(verbose: int) -> None:
    """meshbus: a message-routing bus for game and service back ends.

    Start a broker with `meshbus broker` (or a local mesh of several with
    `meshbus mesh up -n 3`), then talk to it with `send`, `listen`, `request`,
    `reply`, `publish`, `subscribe` and `stat`. Addresses are written
    SERVER:INSTANCE (unicast), multicast:NAME or anycast:NAME; subjects as NATS
    writes them (game.eu.chat, game.*.chat, game.>).
    """
    _setup_logging(verbose)


# -- shared plumbing ------------------------------------------------------------


def _payload(text: str) -> bytes:
    """A command-line argument as bytes: UTF-8, and bytes that are not are passed through."""
    return text.encode("utf-8", errors="surrogateescape")


def _text(payload: bytes) -> str:
    """A payload for a one-line display: UTF-8, undecodable bytes and line breaks escaped."""
    text = payload.decode("utf-8", errors="backslashreplace")
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _json_payload(payload: bytes) -> tuple[str, str]:
    """A payload for JSON and its encoding: UTF-8 text as it is, other bytes in base64."""
    try:
        return payload.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(payload).decode("ascii"), "base64"


def _print_message(msg: Message, as_json: bool) -> None:
    if as_json:
        payload, encoding = _json_payload(msg.payload)
        line = json.dumps(
            {
                "src": str(msg.src),
                "dst": str(msg.dst),
                "subject": msg.subject,
                "payload": payload,
                "encoding": encoding,
                "request": msg.is_request,
                "msg_id": msg.msg_id,
                "headers": _headers_of(msg),
            }
        )
    else:
        where = msg.dst if msg.subject is None else msg.subject
        line = f"[{msg.src} -> {where}] {_text(msg.payload)}"
    click.echo(line)  # click.echo flushes, so a reader on a pipe sees each line at once


def _headers_of(msg: Message) -> dict[str, str]:
    """The message's headers; a malformed block (another service's bytes) is shown as
    such rather than ending the listener."""
    try:
        return msg.headers
    except ProtocolError as exc:
        return {"error": str(exc)}


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


async def _print_messages(
    service: Service, count: int | None, timeout: float | None, as_json: bool
) -> None:
    """Print the messages to ``service`` until ``count`` came or ``timeout`` passed;
    ``TimedOut`` when fewer than ``count`` came in time."""
    received = 0
    async for msg in _messages(service, timeout):
        _print_message(msg, as_json)
        received += 1
        if received == count:
            return
    if count is not None:
        raise TimedOut(f"received {received} of {count} messages within {timeout} s")


async def _messages(service: Service, timeout: float | None) -> AsyncIterator[Message]:
    """The messages to ``service`` as they come, until ``timeout`` seconds have passed
    (None: no end)."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    while True:
        remaining = None if deadline is None else deadline - loop.time()
        if remaining is not None and remaining <= 0:
            return
        try:
            msg = await service.recv(timeout=remaining)
        except Timeout:
            return
        yield msg


F = TypeVar("F", bound=Callable[..., Any])


def _payload_options(command: F) -> F:
    """``--file`` and ``--header``, as send and publish take them."""
    command = click.option(
        "--header",
        "-H",
        "headers",
        multiple=True,
        metavar="NAME:VALUE",
        help="A header the receivers read as msg.headers; repeat for more.",
    )(command)
    return click.option(
        "--file",
        "payload_file",
        type=click.File("rb"),
        default=None,
        help="The bytes of this file (- for stdin) instead of TEXT.",
    )(command)


def _print_options(command: F) -> F:
    """``--count``, ``--timeout`` and ``--json``, as listen and subscribe take them."""
    command = click.option("--json", "as_json", is_flag=True, help="One JSON object per message.")(
        command
    )
    command = click.option(
        "--timeout",
        type=click.FloatRange(0, min_open=True),
        default=None,
        help=f"Stop after S seconds; with --count, exit {EXIT_TIMEOUT} if fewer than N came.",
    )(command)
    return click.option(
        "--count",
        type=click.IntRange(1),
        default=None,
        help="Stop after N messages (default: never).",
    )(command)


# -- send ------------------------------------------------------------------------


@main.command(epilog=ADDRESS_HELP)
@connection_options
@click.option(
    "--notify",
    is_flag=True,
    help=f"Ask the broker to report a missing route; exit {EXIT_NO_ROUTE} if it does.",
)
@_payload_options
@click.argument("address", type=ADDRESS)
@click.argument("text", required=False)
def send(
    broker_address: str,
    server: str,
    access: Access,
    notify: bool,
    payload_file: BinaryIO | None,
    headers: tuple[str, ...],
    address: Address,
    text: str | None,
) -> None:
    """Send TEXT (UTF-8) to ADDRESS, at most once, and exit.

    The payload is TEXT; or the bytes of --file PATH; or, with TEXT `-` or no
    TEXT and stdin not a terminal, the bytes read from stdin.
    The message comes from a dynamic address SERVER:N. A send with no route is
    dropped silently unless --notify is given.

    \b
    Exit codes: 0 sent, 1 error (e.g. no broker),
    2 bad arguments, 4 no route (with --notify).
    """
    payload = _send_payload(text, payload_file)
    run(_send(broker_address, server, access, address, payload, _headers(headers), notify))


def _headers(pairs: tuple[str, ...]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for pair in pairs:
        name, colon, value = pair.partition(":")
        if not colon:
            raise click.BadParameter(f"{pair!r} is not NAME:VALUE", param_hint="'--header'")
        headers[name.strip()] = value.strip()
    return headers


def _send_payload(text: str | None, payload_file: BinaryIO | None) -> bytes:
    """What `send` sends: TEXT, the --file, or stdin (TEXT `-`, or no TEXT off a terminal)."""
    if payload_file is not None:
        if text is not None:
            raise click.UsageError("TEXT and --file exclude each other")
        return payload_file.read()
    if text == "-" or (text is None and not sys.stdin.isatty()):
        return sys.stdin.buffer.read()
    if text is None:
        raise click.UsageError("Missing argument 'TEXT' (or --file PATH, or a payload on stdin)")
    return _payload(text)


async def _send(
    broker_address: str,
    server: str,
    access: Access,
    address: Address,
    payload: bytes,
    headers: dict[str, str],
    notify: bool,
) -> None:
    async with await access.connect(broker_address, server=server) as conn:
        service = await conn.register()
        failed: list[Undeliverable] = []
        conn.on_undeliverable(failed.append)
        await service.send(address, payload, headers=headers, notify=notify)
        # The broker answers in the order it reads: PONG comes after the send was routed
        # (and after its NO_ROUTE, if any), so the message has left this process.
        await conn.ping()
    if failed:
        raise NoRouteFailure(f"no route to {failed[0].dst}: {failed[0].reason}")


# -- listen ----------------------------------------------------------------------


@main.command(epilog=ADDRESS_HELP)
@connection_options
@_print_options
@click.argument("address", type=ADDRESS)
def listen(
    broker_address: str,
    server: str,
    access: Access,
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
    run(
        _listen(
            broker_address, _server_for(address, server), access, address, count, timeout, as_json
        ),
        interruptible=True,
    )


async def _listen(
    broker_address: str,
    server: str,
    access: Access,
    address: Address,
    count: int | None,
    timeout: float | None,
    as_json: bool,
) -> None:

    async with await access.connect(broker_address, server=server) as conn:
        service = await _bind(conn, address)
        click.echo(f"listening on {address} as {service.address}", err=True)
        await _print_messages(service, count, timeout, as_json)


# -- publish and subscribe ---------------------------------------------------------


@main.command()
@connection_options
@_payload_options
@click.argument("subject")
@click.argument("text", required=False)
def publish(
    broker_address: str,
    server: str,
    access: Access,
    payload_file: BinaryIO | None,
    headers: tuple[str, ...],
    subject: str,
    text: str | None,
) -> None:
    """Publish TEXT (UTF-8) on SUBJECT, at most once, and exit.

    Every subscription matching SUBJECT anywhere in the mesh gets it: services'
    (`meshbus subscribe`, `Service.subscribe`) and NATS clients'. SUBJECT is
    tokens separated by '.', with no wildcard, e.g. game.eu.zone7.chat. The
    payload is TEXT, the bytes of --file PATH, or stdin (TEXT `-`, or no TEXT
    and stdin not a terminal).

    \b
    Exit codes: 0 published, 1 error (e.g. no broker), 2 bad arguments.
    """
    payload = _send_payload(text, payload_file)
    run(_publish(broker_address, server, access, subject, payload, _headers(headers)))


async def _publish(
    broker_address: str,
    server: str,
    access: Access,
    subject: str,
    payload: bytes,
    headers: dict[str, str],
) -> None:
    async with await access.connect(broker_address, server=server) as conn:
        await conn.publish(subject, payload, headers=headers)
        await conn.ping()  # answered after the publish was routed: it has left this process


@main.command()
@connection_options
@click.option("--queue", default=None, help="Join this queue group: one member gets each message.")
@_print_options
@click.argument("subjects", nargs=-1, required=True)
def subscribe(
    broker_address: str,
    server: str,
    access: Access,
    queue: str | None,
    count: int | None,
    timeout: float | None,
    as_json: bool,
    subjects: tuple[str, ...],
) -> None:
    """Print what is published on SUBJECTS, one message per line:
    [SOURCE -> SUBJECT] PAYLOAD.

    Each of SUBJECTS is a pattern as NATS writes them: '*' matches one token, a
    last '>' one or more (game.*.chat, game.>). A dynamic service SERVER:N
    subscribes to all of them; each message comes once however many match.
    Runs until --count messages came, --timeout passed, or Ctrl-C.

    \b
    Exit codes: 0 done, 1 error (e.g. no broker, a refused pattern),
    2 bad arguments, 3 --timeout passed before --count messages.
    """
    run(
        _subscribe(broker_address, server, access, subjects, queue, count, timeout, as_json),
        interruptible=True,
    )


async def _subscribe(
    broker_address: str,
    server: str,
    access: Access,
    subjects: tuple[str, ...],
    queue: str | None,
    count: int | None,
    timeout: float | None,
    as_json: bool,
) -> None:
    async with await access.connect(broker_address, server=server) as conn:
        service = await conn.register()
        await service.subscribe(subjects, queue=queue)
        click.echo(f"subscribed to {' '.join(subjects)} as {service.address}", err=True)
        await _print_messages(service, count, timeout, as_json)


# -- request ---------------------------------------------------------------------


@main.command(epilog=ADDRESS_HELP)
@connection_options
@click.option(
    "--timeout",
    type=click.FloatRange(0, min_open=True),
    default=5.0,
    show_default=True,
    help="Seconds to wait for the response.",
)
@click.argument("address", type=ADDRESS)
@click.argument("text")
def request(
    broker_address: str,
    server: str,
    access: Access,
    timeout: float,
    address: Address,
    text: str,
) -> None:
    """Send TEXT (UTF-8) as a request to ADDRESS and print the response's payload.

    For an anycast address one member answers; for a multicast address the
    first response wins.

    \b
    Exit codes: 0 response printed, 1 error (e.g. no broker),
    2 bad arguments, 3 timeout (no response in time),
    4 no route (nobody serves ADDRESS).
    """
    run(_request(broker_address, server, access, address, _payload(text), timeout))


async def _request(
    broker_address: str,
    server: str,
    access: Access,
    address: Address,
    payload: bytes,
    timeout: float,
) -> None:

    async with await access.connect(broker_address, server=server) as conn:
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
@connection_options
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
@click.option(
    "--timeout",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help=f"Stop after S seconds; with --count, exit {EXIT_TIMEOUT} if fewer than N were answered.",
)
@click.option("--json", "as_json", is_flag=True, help="Print each request as a JSON object.")
@click.argument("address", type=ADDRESS)
def reply(
    broker_address: str,
    server: str,
    access: Access,
    echo: bool,
    text: str | None,
    count: int | None,
    timeout: float | None,
    as_json: bool,
    address: Address,
) -> None:
    """Answer the requests sent to ADDRESS, printing each one as `listen` does.

    ADDRESS is joined (groups) or registered (SERVER:INSTANCE) as for
    `listen`. Plain (non-request) messages are printed but not answered.
    Runs until --count requests were answered, --timeout passed, or Ctrl-C.

    \b
    Exit codes: 0 done, 1 error (e.g. address in use, no broker),
    2 bad arguments, 3 --timeout passed before --count requests.
    """
    if echo and text is not None:
        raise click.UsageError("--echo and --text exclude each other")
    _check_bindable(address)
    answer = None if text is None else _payload(text)
    run(
        _reply(
            broker_address,
            _server_for(address, server),
            access,
            address,
            answer,
            count,
            timeout,
            as_json,
        ),
        interruptible=True,
    )


async def _reply(
    broker_address: str,
    server: str,
    access: Access,
    address: Address,
    answer: bytes | None,
    count: int | None,
    timeout: float | None,
    as_json: bool,
) -> None:

    answered = 0
    async with await access.connect(broker_address, server=server) as conn:
        service = await _bind(conn, address)
        click.echo(f"answering {address} as {service.address}", err=True)
        async for msg in _messages(service, timeout):
            _print_message(msg, as_json)
            if msg.is_request:
                await msg.reply(msg.payload if answer is None else answer)
                answered += 1
                if answered == count:
                    break
        # The last response must reach the broker before the link closes.
        await conn.ping()
    if count is not None and answered < count:
        raise TimedOut(f"answered {answered} of {count} requests within {timeout} s")


if __name__ == "__main__":
    main()
