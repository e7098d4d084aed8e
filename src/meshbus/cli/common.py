"""What every ``meshbus`` command shares: parameter types, connection options, running.

``meshbus.cli.main`` (the client commands), ``meshbus.cli.broker``, ``meshbus.cli.admin``
(the operator's), ``cli_stream`` and ``cli_auth`` build on it; none imports another's
commands.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click

from meshbus.address import Address, Unicast
from meshbus.auth import CREDS_ENV
from meshbus.client.brokers import (
    BROKER_ENV,
    DEFAULT_PORT,
    TLS_CA_ENV,
    broker_list,
)
from meshbus.client.brokers import (
    DEFAULT_BROKER as DEFAULT_BROKER,  # the CLI's default too
)
from meshbus.errors import MeshbusError, TLSError
from meshbus.tls import cli_context
from meshbus.util import hostport_text, parse_hostport

if TYPE_CHECKING:
    from rich.table import Table

    from meshbus.client.connector import Connector

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
  Group names are at most 15 bytes; names may not contain ':'. They are
  matched exactly: '*' and '>' are not wildcards, and are refused. For
  wildcards and longer names use subjects: `meshbus subscribe 'chat.>'`."""

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


def _check_one_broker(text: str) -> str:
    if "," in text:
        raise ValueError(f"{text!r}: this command takes one broker, HOST:PORT")
    return hostport_text(*parse_hostport(text, default_port=DEFAULT_PORT))


def _check_server_name(text: str) -> str:
    Unicast(text, 1)  # the server part of a unicast address: <= 11 bytes of UTF-8, no ':'
    return text


def _check_brokers(text: str) -> str:
    return ",".join(broker_list(text))


ONE_BROKER = Parsed("HOST:PORT", _check_one_broker)
BROKERS = Parsed("HOST:PORT[,...]", _check_brokers)
ADDRESS = Parsed("ADDRESS", Address.parse)
SERVER_NAME = Parsed("NAME", _check_server_name)


@dataclass(frozen=True)
class Access:
    """How a client command reaches a broker, besides its address: the TLS context of
    --tls-* (None: plain TCP) and the credentials file of --creds (None: the one
    MESHBUS_CREDS names, if any). ``connect`` takes them as they are. The TLS files'
    paths are kept for connections made elsewhere (the Spark tasks of meshbus report)."""

    tls: ssl.SSLContext | None
    credentials: str | None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def data_source_options(self) -> dict[str, str]:
        """The options of the ``meshbus`` Spark data source that connect the same way
        (docs/spark.md): the paths, which its tasks open themselves."""
        given = {
            "creds": self.credentials,
            "tlsCa": self.tls_ca,
            "tlsCert": self.tls_cert,
            "tlsKey": self.tls_key,
        }
        return {option: path for option, path in given.items() if path}

    async def connect(self, broker_address: str, **options: Any) -> Connector:
        import meshbus

        # The options already read MESHBUS_TLS_CA: no context is plain TCP (--no-tls).
        tls = False if self.tls is None else self.tls
        return await meshbus.connect(
            broker_address, tls=tls, credentials=self.credentials, **options
        )


def broker_option(*decls: str, help_text: str, one: bool = False) -> Callable[[F], F]:
    """The --broker option of a client command (``decls`` as click's): HOST:PORT, or
    several separated by commas unless ``one``; a bare HOST means port 7400; from
    MESHBUS_BROKER when not given."""
    return click.option(
        *decls,
        type=ONE_BROKER if one else BROKERS,
        default=DEFAULT_BROKER,
        show_default=True,
        envvar=BROKER_ENV,
        show_envvar=True,
        help=help_text,
    )


def access_options(command: F) -> F:
    """--creds, --tls-ca, --tls-cert, --tls-key and --no-tls, the same on every client
    command; the command gets them as one argument, ``access`` (an ``Access``). A TLS
    file that does not load fails here, before any I/O (meshbus.tls.cli_context)."""

    @functools.wraps(command)
    def with_access(
        *args: Any,
        creds: str | None,
        tls_ca: str | None,
        tls_cert: str | None,
        tls_key: str | None,
        no_tls: bool,
        **kwargs: Any,
    ) -> Any:
        if no_tls:
            source = click.get_current_context().get_parameter_source
            given = [
                f"--{name.replace('_', '-')}"
                for name in ("tls_ca", "tls_cert", "tls_key")
                if source(name) is click.core.ParameterSource.COMMANDLINE
            ]
            if given:
                raise click.UsageError(f"--no-tls contradicts {', '.join(given)}")
            tls_ca = tls_cert = tls_key = None  # MESHBUS_TLS_CA too
        try:
            tls = cli_context(tls_ca, tls_cert, tls_key)
        except TLSError as exc:
            raise click.ClickException(str(exc)) from exc
        return command(*args, access=Access(tls, creds, tls_ca, tls_cert, tls_key), **kwargs)

    path = click.Path(dir_okay=False)
    for name, envvar, help_text in (
        ("--tls-key", None, "PEM private key (unencrypted) of --tls-cert."),
        (
            "--tls-cert",
            None,
            "PEM client certificate, for a broker that requires one (--tls-verify-clients); "
            "needs --tls-key.",
        ),
        (
            "--tls-ca",
            TLS_CA_ENV,
            "PEM CA certificate the broker's certificate must be signed by. Any --tls-* "
            "option connects with TLS; without --tls-ca the system's CAs are used.",
        ),
    ):
        click.option(
            name,
            type=path,
            default=None,
            envvar=envvar,
            show_envvar=envvar is not None,
            help=help_text,
        )(with_access)
    click.option(
        "--no-tls",
        is_flag=True,
        help="Plain TCP, even with MESHBUS_TLS_CA set (for a broker without TLS).",
    )(with_access)
    click.option(
        "--creds",
        type=path,
        default=None,
        envvar=CREDS_ENV,
        show_envvar=True,
        help="Credentials file to sign in with, for a broker that has users "
        "(`meshbus keygen` writes one).",
    )(with_access)
    return cast(F, with_access)


def connection_options(command: F) -> F:
    """--broker, --server and the access options (``access_options``), the same on every
    client command.

    --broker may name several brokers of one mesh, separated by commas: the
    command uses the first that answers."""
    command = access_options(command)
    command = click.option(
        "--server",
        type=SERVER_NAME,
        default=DEFAULT_SERVER,
        show_default=True,
        help="Server name of the command's own dynamic address (SERVER:65536 and up).",
    )(command)
    command = broker_option(
        "--broker",
        "broker_address",
        help_text="Broker to connect to: HOST:PORT, or several of one mesh as HOST:PORT,HOST:PORT.",
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


def plain_row(table: Table, *cells: object) -> None:
    """A row of data in a rich table, escaped: rich reads markup in a cell, and would
    swallow a name such as ``[[brokers]]`` or ``[bold]`` that comes from a broker."""
    from rich.markup import escape

    table.add_row(*(escape(str(cell)) for cell in cells))
