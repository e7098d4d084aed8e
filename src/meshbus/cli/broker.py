"""``meshbus broker``: its flags, and running it.

The flags are made from the settings meshbus.broker.config declares (``StartSettings``,
then ``BrokerConfig``): each one's name, type, default, range or choices and help come
from its declaration, and the command hands the values to ``BrokerConfig`` by field
name. Written out here: --config and --check-config (meshbus.cli.config), a file of
settings rather than one; its keys are the flags' long names (click's ``default_map``),
and its tables the users and the brokers of the mesh (docs/security.md).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import click

from meshbus.broker.config import (
    BrokerConfig,
    Declared,
    PartitionHandling,
    StartSettings,
    declared_settings,
)
from meshbus.broker.config_file import ConfigTables, reread_users
from meshbus.cli.common import Parsed
from meshbus.cli.config import check_config_file, flag_default, read_config_file
from meshbus.errors import InvalidArgument
from meshbus.util import parse_hostport

# What --partition-handling offers; bench chaos passes it on to its brokers.
PARTITION_HANDLING = tuple(choice.value for choice in PartitionHandling)


def _click_type(declared: Declared) -> click.ParamType[Any]:
    """The click type of a setting's flag: click checks the command line by the same
    declaration the config file is checked by, and shows it in --help."""
    setting = declared.setting
    if declared.choices:
        return click.Choice([choice.value for choice in declared.choices])
    if declared.type is int:
        # An integer's bounds are integers (tests/unit/cli/test_broker_flags.py).
        low, high = (None if bound is None else int(bound) for bound in (setting.min, setting.max))
        return click.IntRange(low, high, setting.min_open, setting.max_open)
    if declared.type is float:
        return click.FloatRange(setting.min, setting.max, setting.min_open, setting.max_open)
    if setting.path:
        return click.Path(file_okay=setting.path == "file", dir_okay=setting.path == "directory")
    if setting.parse is not None:
        return Parsed(setting.metavar, setting.parse)
    return click.STRING


def _option(declared: Declared) -> click.Option:
    """The flag of one setting. A setting with no default ("", none) is no flag given;
    every other default is shown."""
    decls = [f"--{declared.key}", declared.name]
    if declared.type is bool:
        return click.Option(decls, is_flag=True, help=declared.help)
    if declared.multiple:
        return click.Option(decls, type=_click_type(declared), multiple=True, help=declared.help)
    shown = declared.default not in ("", None)
    return click.Option(
        decls,
        type=_click_type(declared),
        default=flag_default(declared.default) if shown else None,
        show_default=shown or None,
        help=declared.help,
    )


def _values(cls: type, flags: dict[str, Any]) -> dict[str, Any]:
    """The values of the flags of ``cls``'s settings, as its fields hold them: a repeated
    flag's is a list, and a flag not given (None) is the setting's default."""
    values: dict[str, Any] = {}
    for declared in declared_settings(cls):
        value = flags[declared.name]
        if declared.multiple:
            value = list(value)
        elif value is None:
            value = declared.default
        values[declared.name] = value
    return values


_CONFIG = click.Option(
    ["--config", "tables"],
    type=click.Path(dir_okay=False),
    default=None,
    is_eager=True,
    callback=read_config_file,
    help="A TOML file of settings: its keys are the long flag names below (listen = "
    '"0.0.0.0:7400", max-connectors = 100, seed = [...]), a flag given here overrides '
    "the file; [[users]], who may connect, and [[brokers]], the brokers of the mesh "
    "(docs/security.md). SIGHUP reloads its users and their permissions.",
)
_CHECK_CONFIG = click.Option(
    ["--check-config"],
    type=click.Path(dir_okay=False),
    default=None,
    is_eager=True,
    expose_value=False,
    callback=check_config_file,
    help="Check a config file as --config reads it, then exit: 0 and 'FILE: ok', or 1 and "
    "every error with its line.",
)


@click.command(
    params=[
        _CONFIG,
        _CHECK_CONFIG,
        *(
            _option(declared)
            for cls in (StartSettings, BrokerConfig)
            for declared in declared_settings(cls)
        ),
    ]
)
def broker(tables: ConfigTables, **flags: Any) -> None:
    """Run a broker in the foreground until SIGINT or SIGTERM.

    Prints one line once it takes connectors (after joining the mesh, with
    --seed): `meshbus broker NAME listening on HOST:PORT`. SIGTERM (or
    `meshbus drain`) drains it first: its connectors move to other brokers of
    the mesh; a second signal stops it at once. SIGHUP reloads the --config
    file's users and permissions (not its flags; docs/security.md, "Reloading").
    """
    import uvloop

    from meshbus.auth import Credentials
    from meshbus.broker.run import START_ERRORS, serve
    from meshbus.errors import TLSError

    start = StartSettings(**_values(StartSettings, flags))
    host, port = parse_hostport(start.listen)
    config = BrokerConfig(
        host=host,
        port=port,
        users=tables.users,
        brokers=tables.brokers,
        **_values(BrokerConfig, flags),
    )
    if bool(config.tls_cert) != bool(config.tls_key):
        raise click.UsageError("--tls-cert and --tls-key go together: give both, or neither")
    if config.tls_verify_clients and not (config.tls_cert and config.tls_ca):
        raise click.UsageError(
            "--tls-verify-clients needs --tls-cert, --tls-key and --tls-ca (the CA that "
            "signs the clients' certificates)"
        )
    if not start.allow_insecure_key_files:
        try:
            _check_secrets(tables, start.broker_key, config.tls_key)
        except InvalidArgument as exc:
            raise click.ClickException(str(exc)) from None
    try:
        config.broker_key = Credentials.load(start.broker_key) if start.broker_key else None
    except InvalidArgument as exc:
        raise click.BadParameter(str(exc), param_hint="'--broker-key'") from None
    if config.data_dir:
        os.makedirs(config.data_dir, exist_ok=True)
    if config.brokers and not (config.broker_key and config.name):
        raise click.UsageError(
            "this broker's config lists [[brokers]], the only brokers its mesh trusts: "
            "give it --name and --broker-key FILE, its key pair for that name "
            "(meshbus keygen --broker --user NAME writes one)"
        )
    try:
        reread = (
            functools.partial(
                reread_users,
                tables.path,
                tables.brokers,
                check_mode=not start.allow_insecure_key_files,
            )
            if tables.path
            else None
        )
        uvloop.run(serve(config, reread))
    except TLSError as exc:  # a ConnectionError too, so before OSError
        raise click.ClickException(str(exc)) from exc
    except OSError as exc:
        raise click.ClickException(
            f"cannot listen on {start.listen}: {exc.strerror or exc}"
        ) from exc
    except START_ERRORS as exc:
        raise click.ClickException(str(exc)) from exc


def _check_secrets(tables: ConfigTables, broker_key: str, tls_key: str) -> None:
    """The broker's secrets are its owner's only: its key pair and TLS key (no other user
    may read or change them), a config file of users (none may change it; with token
    hashes, none may read it either). InsecureFile names the first that is not."""
    from meshbus.private_files import check_private

    if broker_key:
        check_private(broker_key, "the broker key (--broker-key)")
    if tls_key:
        check_private(tls_key, "the TLS key (--tls-key)")
    tables.check_private()
