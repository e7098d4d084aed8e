"""``meshbus broker --config`` and ``--check-config``: the config file
(meshbus.broker.config_file reads it) as click options.

The file's settings become the defaults of their flags (click's default_map), so a flag
on the command line wins; its tables are the value of ``--config``.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import click

from meshbus.broker.config_file import BadConfig, ConfigTables, read_config


def read_config_file(ctx: click.Context, param: click.Parameter, path: str | None) -> ConfigTables:
    """--config FILE: its settings become their flags' defaults (click's default_map), so
    a flag given on the command line wins. Its ``[[users]]`` and ``[[brokers]]`` are the
    value."""
    if path is None:
        return ConfigTables.empty()
    try:
        config = read_config(path)
    except BadConfig as exc:
        raise click.BadParameter(str(exc)) from None
    defaults = {name: flag_default(value) for name, value in config.settings.items()}
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return config.tables


def flag_default(value: Any) -> Any:
    """A setting's value as its flag's default: click.Choice would match an enum member
    by its name, and the flags' choices are the members' values."""
    return value.value if isinstance(value, Enum) else value


def check_config_file(ctx: click.Context, param: click.Parameter, path: str | None) -> None:
    """--check-config FILE: check it as --config would read it, print the verdict, exit."""
    if path is None:
        return
    try:
        config = read_config(path)
    except BadConfig as exc:
        click.echo(str(exc), err=True)
        ctx.exit(1)
    users, brokers = len(list(config.tables.users)), len(list(config.tables.brokers))
    click.echo(f"{path}: ok ({users} users, {brokers} brokers)")
    ctx.exit(0)
