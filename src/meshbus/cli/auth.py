"""The credential commands: ``keygen`` (a key pair) and ``hash-token`` (a token's hash).

Each prints, on stdout, exactly what goes into the broker's config file (so
``meshbus keygen >> broker.toml`` works), and everything meant for a person on
stderr; for a user, each also writes the client's credentials file (0600). The
permissions ``--allow`` grants are checked by the broker's own reader of config
files. docs/security.md tells the whole story.
"""

from __future__ import annotations

import difflib
import getpass
import itertools
import sys

import click

from meshbus.auth import (
    PERMISSION_KEYS,
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


def _grants(text: str) -> list[tuple[str, str]]:
    """``send=game*:*,request=anycast:login``: (permission, pattern) pairs. The
    permissions are checked here, the patterns with the entry (``_entry``)."""
    grants = []
    for item in text.split(","):
        key, equals, pattern = item.strip().partition("=")
        key, pattern = key.strip(), pattern.strip()
        if not equals or not key or not pattern:
            raise ValueError(f"{item.strip()!r} is not PERMISSION=PATTERN (e.g. send=game*:*)")
        if key not in PERMISSION_KEYS:
            close = difflib.get_close_matches(key, PERMISSION_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"unknown permission {key!r}{hint}; the permissions are "
                f"{', '.join(PERMISSION_KEYS)}"
            )
        grants.append((key, pattern))
    return grants


GRANTS = Parsed("PERMISSION=PATTERN[,...]", _grants)
ALLOW_ALL = click.option(
    "--allow-all",
    is_flag=True,
    help="Grant the user every permission in the printed entry (for development); "
    "without it (or --allow) the entry grants nothing, each permission an empty list to "
    "fill in.",
)
ALLOW = click.option(
    "--allow",
    "allow",
    type=GRANTS,
    multiple=True,
    help="Grant only these, e.g. --allow 'send=game*:*,request=anycast:login,"
    "streams.read=scores.*,operator=stat' (repeat for more). A permission is one of "
    f"{', '.join(PERMISSION_KEYS)}; a pattern as in the config file (docs/security.md, "
    '"Permissions"), checked as the broker checks it.',
)


def _entry(
    user: str,
    *,
    public_key: str | None = None,
    token_hash: str | None = None,
    allow_all: bool,
    allow: tuple[list[tuple[str, str]], ...],
) -> str:
    """The user's [[users]] entry as --allow-all or --allow grant, read back by the
    broker's own reader of config files: a pattern it would refuse is refused here."""
    from meshbus.broker.config_file import BadConfig, config_from_text

    if allow_all and allow:
        raise click.UsageError("--allow-all and --allow exclude each other")
    granted: dict[str, list[str]] = {}
    for key, pattern in itertools.chain.from_iterable(allow):
        granted.setdefault(key, []).append(pattern)
    entry = users_entry(
        user, public_key=public_key, token_hash=token_hash, allow_all=allow_all, allow=granted
    )
    try:
        config_from_text(entry, "the entry")
    except BadConfig as exc:
        raise click.BadParameter(
            "; ".join(message for _, message in exc.errors), param_hint="'--allow'"
        ) from None
    return entry


def _write_credentials(credentials: Credentials, path: str) -> None:
    try:
        credentials.write(path)
    except FileExistsError:
        raise click.ClickException(
            f"{path} already exists; a credentials file is never overwritten "
            "(remove it, or give another --out)"
        ) from None
    except OSError as exc:
        raise click.ClickException(f"cannot write {path}: {exc.strerror or exc}") from None


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
@ALLOW
@click.option(
    "--broker",
    is_flag=True,
    help="The key pair of a broker named USER (its --broker-key): print its [[brokers]] "
    "entry, for the config of every broker of the mesh, instead of a [[users]] entry.",
)
def keygen(
    user: str,
    out: str | None,
    allow_all: bool,
    allow: tuple[list[tuple[str, str]], ...],
    broker: bool,
) -> None:
    """Make an Ed25519 key pair for signing in to a broker.

    Writes the private key to a credentials file readable by you only (mode
    0600): give it to the client with --creds FILE, MESHBUS_CREDS=FILE or
    meshbus.connect(credentials=FILE), or to a broker with --broker-key FILE.
    Prints the [[users]] entry (with --broker the [[brokers]] entry), with the
    public key, to paste into the broker's config file (--config).
    """
    if broker and (allow_all or allow):
        raise click.UsageError("a broker has no permissions: --broker takes no --allow(-all)")
    path = out or f"{user}.creds"
    credentials = Credentials.generate(user)
    public_key = credentials.public_key
    assert public_key is not None  # a key pair, just made
    entry = (
        brokers_entry(user, public_key)
        if broker
        else _entry(user, public_key=public_key, allow_all=allow_all, allow=allow)
    )
    _write_credentials(credentials, path)
    click.echo(
        f"wrote the private key of user {user!r} to {path} (mode 0600; keep it private). "
        "Add this entry to the broker's config file:",
        err=True,
    )
    click.echo(entry, nl=False)


@click.command("hash-token")
@click.option(
    "--generate",
    is_flag=True,
    help="Make a strong random token instead of reading one (without --user it is "
    "printed once, on stderr).",
)
@click.option(
    "--user",
    type=USER_NAME,
    default=None,
    help="Print the [[users]] entry of this user, its token_hash made for that name (a "
    "user's token is hashed with its name), and write its credentials file. Without it: "
    "the scrypt token_hash line of --monitor-token-hash.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    help="With --user: the credentials file to write (default: USER.creds); never overwritten.",
)
@ALLOW_ALL
@ALLOW
def hash_token(
    generate: bool,
    user: str | None,
    out: str | None,
    allow_all: bool,
    allow: tuple[list[tuple[str, str]], ...],
) -> None:
    """Hash a token for the broker's config: reads the token from stdin (one line),
    or makes one with --generate, and prints the [[users]] entry of --user NAME, or
    without --user the token_hash line of --monitor-token-hash.

    With --user it also writes the client's credentials file (user = "NAME" and
    token = "TOKEN"), readable by you only (mode 0600), as keygen does: give it to
    the client with --creds FILE, MESHBUS_CREDS=FILE or
    meshbus.connect(credentials=FILE).

    Tokens are for development: a key pair (`meshbus keygen`) is a secret the broker
    never holds. A user's token never crosses the wire either, only a proof bound to
    the broker's challenge.
    """
    if user is None and (out or allow_all or allow):
        raise click.UsageError("--out, --allow and --allow-all are for a user's entry: give --user")
    if generate:
        token = new_token()
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
        if generate:
            click.echo(f"token = {toml_string(token)}  # for the bearer; shown once", err=True)
        click.echo(f"token_hash = {toml_string(str(TokenHash.of(token)))}")
        return
    entry = _entry(user, token_hash=str(TokenKey.of(user, token)), allow_all=allow_all, allow=allow)
    path = out or f"{user}.creds"
    _write_credentials(Credentials(user, token=token), path)
    click.echo(
        f"wrote the token of user {user!r} to {path} (mode 0600; keep it private). "
        "Add this entry to the broker's config file:",
        err=True,
    )
    click.echo(entry, nl=False)
