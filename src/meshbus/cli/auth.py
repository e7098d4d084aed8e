"""The credential commands: ``keygen`` (a key pair) and ``hash-token`` (a token's hash).

Each prints, on stdout, exactly what goes into the broker's config file (so
``meshbus keygen >> broker.toml`` works), and everything meant for a person on
stderr. docs/security.md tells the whole story.
"""

from __future__ import annotations

import getpass
import sys

import click

from meshbus.auth import (
    Credentials,
    TokenHash,
    TokenKey,
    brokers_entry,
    check_token,
    check_user_name,
    new_token,
    toml_string,
    users_entry,
)
from meshbus.cli.common import Parsed

USER_NAME = Parsed("NAME", check_user_name)
ALLOW_ALL = click.option(
    "--allow-all",
    is_flag=True,
    help="Grant the user every permission in the printed entry (for development); "
    "without it the entry grants nothing, each permission an empty list to fill in.",
)


def _login_name() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name: a container without a passwd entry
        return "meshbus"


@click.command()
@click.option(
    "--user",
    type=USER_NAME,
    default=_login_name,
    show_default="your login name",
    help="The user the key pair is for: its name in the broker's config.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    help="The credentials file to write (default: USER.creds); never overwritten.",
)
@ALLOW_ALL
@click.option(
    "--broker",
    is_flag=True,
    help="The key pair of a broker named USER (its --broker-key): print its [[brokers]] "
    "entry, for the config of every broker of the mesh, instead of a [[users]] entry.",
)
def keygen(user: str, out: str | None, allow_all: bool, broker: bool) -> None:
    """Make an Ed25519 key pair for signing in to a broker.

    Writes the private key to a credentials file readable by you only (mode
    0600): give it to the client with --creds FILE, MESHBUS_CREDS=FILE or
    meshbus.connect(credentials=FILE), or to a broker with --broker-key FILE.
    Prints the [[users]] entry (with --broker the [[brokers]] entry), with the
    public key, to paste into the broker's config file (--config).
    """
    path = out or f"{user}.creds"
    credentials = Credentials.generate(user)
    try:
        credentials.write(path)
    except FileExistsError:
        raise click.ClickException(
            f"{path} already exists; keygen never overwrites a credentials file "
            "(remove it, or give another --out)"
        ) from None
    except OSError as exc:
        raise click.ClickException(f"cannot write {path}: {exc.strerror or exc}") from None
    click.echo(
        f"wrote the private key of user {user!r} to {path} (mode 0600; keep it private). "
        "Add this entry to the broker's config file:",
        err=True,
    )
    public_key = credentials.public_key
    assert public_key is not None  # a key pair, just made
    entry = (
        brokers_entry(user, public_key)
        if broker
        else users_entry(user, public_key=public_key, allow_all=allow_all)
    )
    click.echo(entry, nl=False)


@click.command("hash-token")
@click.option(
    "--generate",
    is_flag=True,
    help="Make a strong random token, print it once (on stderr), and hash it.",
)
@click.option(
    "--user",
    type=USER_NAME,
    default=None,
    help="Print the [[users]] entry of this user, its token_hash made for that name (a "
    "user's token is hashed with its name). Without it: the scrypt token_hash line of "
    "--monitor-token-hash.",
)
@ALLOW_ALL
def hash_token(generate: bool, user: str | None, allow_all: bool) -> None:
    """Hash a token for the broker's config: reads the token from stdin (one line),
    or makes one with --generate, and prints the [[users]] entry of --user NAME, or
    without --user the token_hash line of --monitor-token-hash.

    Tokens are for development: a key pair (`meshbus keygen`) is a secret the broker
    never holds. A user's token never crosses the wire either, only a proof bound to
    the broker's challenge. The client's credentials file holds user = "NAME" and
    token = "TOKEN".
    """
    if generate:
        token = new_token()
        click.echo(
            f"token = {toml_string(token)}  # for the client's credentials file; shown once",
            err=True,
        )
    else:
        if sys.stdin.isatty():
            token = click.prompt("token", hide_input=True, err=True)
        else:
            token = sys.stdin.readline().rstrip("\r\n")
        try:
            check_token(token)
        except ValueError as exc:
            raise click.ClickException(f"the token read from stdin: {exc}") from None
    if user is None:
        click.echo(f"token_hash = {toml_string(str(TokenHash.of(token)))}")
    else:
        token_key = str(TokenKey.of(user, token))
        click.echo(users_entry(user, token_hash=token_key, allow_all=allow_all), nl=False)
