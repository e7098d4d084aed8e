"""The ``meshbus`` command: a thin layer over the library."""

from __future__ import annotations

import logging
import sys

import click

from meshbus.address import Address
from meshbus.protocol.layout import DEFAULT_MAX_FRAME, MIN_MAX_FRAME
from meshbus.util import parse_hostport

DEFAULT_BROKER = "127.0.0.1:7400"


class HostPort(click.ParamType[str]):
    """HOST:PORT, checked when parsed so a typo fails with a clear message."""

    name = "HOST:PORT"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> str:
        text = str(value)
        try:
            parse_hostport(text)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return text


class AddressParam(click.ParamType[Address]):
    """A meshbus address in text form: SERVER:INSTANCE, multicast:NAME, anycast:NAME."""

    name = "ADDRESS"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> Address:
        if isinstance(value, Address):
            return value
        try:
            return Address.parse(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


HOSTPORT = HostPort()
ADDRESS = AddressParam()


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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


if __name__ == "__main__":
    main()
