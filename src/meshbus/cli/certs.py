"""``meshbus certs``: a development CA and the certificates a broker (and, for mutual TLS,
its clients) need, for the names and IP addresses given (meshbus.devcerts makes them).
Not for production, and it says so."""

from __future__ import annotations

import datetime
import os

import click

from meshbus.cli.common import Parsed


def _check_host(text: str) -> str:
    from meshbus.devcerts import host_name

    host_name(text)
    return text


def _check_common_name(text: str) -> str:
    if not text or len(text) > 64 or not text.isprintable():
        raise ValueError(f"{text!r}: a common name is 1 to 64 printable characters")
    return text


HOST = Parsed("NAME|IP", _check_host)
COMMON_NAME = Parsed("CN", _check_common_name)


@click.command()
@click.argument("hosts", nargs=-1, required=True, type=HOST)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default="meshbus-certs",
    show_default=True,
    help="The directory to write the files to (made if missing); no file in it is "
    "ever overwritten.",
)
@click.option(
    "--days",
    type=click.IntRange(1, 825),
    default=30,
    show_default=True,
    help="How long the certificates are valid.",
)
@click.option(
    "--client",
    "clients",
    type=COMMON_NAME,
    multiple=True,
    help="Also a client certificate with this common name, for mutual TLS "
    "(--tls-verify-clients) and for a [[users]] entry with certificate = CN: "
    "OUT/CN.crt and OUT/CN.key (repeat for more).",
)
def certs(hosts: tuple[str, ...], out: str, days: int, clients: tuple[str, ...]) -> None:
    """Make a development CA and a broker certificate for HOSTS: DNS names and IP
    addresses, e.g. `meshbus certs localhost 127.0.0.1 ::1 b1.lan`.

    FOR DEVELOPMENT AND TESTS ONLY, NOT FOR PRODUCTION: the CA's key is not kept
    (run it again for more certificates, and give everyone the new ca.pem), and
    nothing is checked before signing. In production use your organisation's CA.

    Writes, each readable by you only (0600): OUT/ca.pem, the CA's certificate
    (--tls-ca of the brokers and of every client), and OUT/broker.crt and
    OUT/broker.key, one certificate for every broker of a local mesh (--tls-cert
    and --tls-key), valid for each HOST: a client checks the host it dials
    against these names, so list every name and address the brokers are
    dialled as (their --advertise hosts).
    """
    names = ["ca.pem", "broker.crt", "broker.key"]
    names += [f"{client}{ext}" for client in clients for ext in (".crt", ".key")]
    if len(set(names)) != len(names):
        raise click.UsageError("two files would have one name: give each --client once")
    paths = [os.path.join(out, name) for name in names]
    there = [path for path in paths if os.path.lexists(path)]
    if there:
        raise click.ClickException(
            f"{', '.join(there)} already exist{'s' if len(there) == 1 else ''}; certs never "
            "overwrites a file (give "
            "another --out, or remove the old files)"
        )
    from meshbus.devcerts import DevelopmentCA

    try:
        os.makedirs(out, exist_ok=True)
        ca = DevelopmentCA("meshbus development CA", datetime.timedelta(days=days))
        ca.write_ca(paths[0])
        ca.issue(hosts[0], hosts, paths[1], paths[2])
        for i, client in enumerate(clients):
            ca.issue(client, [], paths[3 + 2 * i], paths[4 + 2 * i])
    except OSError as exc:
        raise click.ClickException(f"cannot write to {out}: {exc.strerror or exc}") from None
    click.echo(
        f"wrote a development CA and certificates valid {days} days for {', '.join(hosts)} "
        f"to {out} -- not for production",
        err=True,
    )
    ca_file, cert, key = paths[:3]
    click.echo(f"meshbus broker --tls-cert {cert} --tls-key {key} --tls-ca {ca_file} ...")
    click.echo(f"meshbus stat --tls-ca {ca_file} --broker {_dialled(hosts[0])}:7400")
    for i, client in enumerate(clients):
        client_cert, client_key = paths[3 + 2 * i], paths[4 + 2 * i]
        click.echo(f"  as {client}: --tls-cert {client_cert} --tls-key {client_key}")


def _dialled(host: str) -> str:
    """``host`` as written before :PORT: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host
