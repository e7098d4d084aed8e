"""What every ``meshbus`` command shares: parameter types, connection options, running.

Both ``meshbus.cli`` (the client commands) and ``meshbus.cli_admin`` (the
operator's) build on it; neither imports the other's commands.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import click

from meshbus.address import Address, Unicast
from meshbus.auth import CREDS_ENV
from meshbus.errors import MeshbusError
from meshbus.util import parse_hostport

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


class Parsed(click.ParamType[T]):
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


def _check_brokers(text: str) -> str:
    from meshbus.client.connecting import broker_list

    broker_list(text)
    return text


HOSTPORT = Parsed("HOST:PORT", _check_hostport)
BROKERS = Parsed("HOST:PORT[,...]", _check_brokers)
ADDRESS = Parsed("ADDRESS", Address.parse)
SERVER_NAME = Parsed("NAME", _check_server_name)


def creds_option(command: F) -> F:
    """--creds FILE (or MESHBUS_CREDS): the credentials to sign in with, for brokers that
    have users (docs/security.md)."""
    return click.option(
        "--creds",
        type=click.Path(dir_okay=False),
        default=None,
        envvar=CREDS_ENV,
        show_envvar=True,
        help="Credentials file to sign in with, for a broker that has users "
        "(`meshbus keygen` writes one).",
    )(command)


def connection_options(command: F) -> F:
    """--broker, --server and --creds, the same on every client command.

    --broker may name several brokers of one mesh, separated by commas: the
    command uses the first that answers."""
    command = creds_option(command)
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
        type=BROKERS,
        default=DEFAULT_BROKER,
        show_default=True,
        help="Broker to connect to: HOST:PORT, or several of one mesh as HOST:PORT,HOST:PORT.",
    )(command)
    return command


def run(coro: Coroutine[Any, Any, T], *, interruptible: bool = False) -> T | None:
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
