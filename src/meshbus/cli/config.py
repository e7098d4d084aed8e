"""The broker's config file (``meshbus broker --config``): reading it, checking it
(``--check-config``) and reading it again on SIGHUP, one way for all three.

Its top-level keys are the long names of the flags of ``meshbus broker`` (the
command is handed in: this module does not import it) and become their defaults
(click's default_map), so a flag on the command line wins; its tables are the users
and the brokers of the mesh (docs/security.md).
"""

from __future__ import annotations

import re
import tomllib
from typing import Any, NamedTuple

import click

from meshbus.broker.security.users import BadEntries, UserTable
from meshbus.cli.config_lines import KeyLines
from meshbus.errors import InvalidArgument


class ConfigTables(NamedTuple):
    """The tables of a broker's config file (docs/security.md): ``[[users]]``, who may
    connect; ``[[brokers]]``, the brokers of the mesh; and the file they came from ("":
    no config file)."""

    users: UserTable
    brokers: UserTable
    path: str = ""


class ConfigFile(NamedTuple):
    """What a broker's config file says: its flags' values (by option name, as click's
    default_map takes them) and its tables."""

    flags: dict[str, Any]
    tables: ConfigTables
    lines: KeyLines


class BadConfig(InvalidArgument):
    """Everything wrong in a broker's config file, one line each: ``FILE:LINE: what`` (or
    ``FILE: what`` for line 0, the file as a whole)."""

    def __init__(self, path: str, errors: list[tuple[int, str]]) -> None:
        super().__init__(
            "\n".join(
                f"{path}:{line}: {message}" if line else f"{path}: {message}"
                for line, message in errors
            )
        )
        self.errors = errors


_USERS = "users"
_BROKERS = "brokers"


def read_config(path: str, command: click.Command) -> ConfigFile:
    """Read and check a broker's config file, as ``--config``, ``--check-config`` and a
    reload (SIGHUP) do. BadConfig lists every error with its line: a syntax error (TOML
    stops there), or each unknown key, bad flag value, bad user and bad broker. The
    flags are ``command``'s (``meshbus broker``)."""
    try:
        with open(path, "rb") as file:
            raw = file.read()
    except OSError as exc:
        raise BadConfig(path, [(0, f"cannot read it: {exc.strerror or exc}")]) from None
    try:
        text = raw.decode()
        data = tomllib.loads(text)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        # Python 3.11's TOMLDecodeError has no line attribute; its message ends with one.
        at = re.search(r"at line (\d+)", str(exc))
        raise BadConfig(path, [(int(at[1]) if at else 1, f"is not valid TOML: {exc}")]) from None
    lines = KeyLines(text)
    errors: list[tuple[int, str]] = []
    ctx = click.Context(command)
    flags = {
        flag[2:]: option
        for option in command.params
        if isinstance(option, click.Option) and option.name and not option.is_eager
        for flag in option.opts
        if flag.startswith("--")
    }
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        if key in (_USERS, _BROKERS):
            continue
        option = flags.get(key)
        if option is None or option.name is None:
            errors.append(
                (
                    lines.line_of(key),
                    f"unknown key {key!r}; the keys are the broker's long flag names "
                    f"(see meshbus broker --help), [[{_USERS}]] and [[{_BROKERS}]]",
                )
            )
            continue
        try:
            defaults[option.name] = _flag_value(ctx, option, key, value)
        except click.BadParameter as exc:
            errors.append((lines.line_of(key), exc.message))
    tables: list[UserTable] = []
    for section, read in (
        (_USERS, UserTable.from_config),
        (_BROKERS, UserTable.brokers_from_config),
    ):
        try:
            tables.append(read(data.get(section, []), path))
        except BadEntries as exc:
            errors.extend(
                (lines.line_of(error.key), str(error).removeprefix(f"{path}: "))
                for error in exc.errors
            )
    if errors:
        raise BadConfig(path, sorted(errors))
    users, brokers = tables
    return ConfigFile(defaults, ConfigTables(users, brokers, path), lines)


def reread_users(path: str, brokers: UserTable, command: click.Command) -> UserTable:
    """What a reload (SIGHUP) applies: the users of the config file ``path``, read as at
    start. BadConfig for any error in the file, and for a ``[[brokers]]`` that is not
    ``brokers`` any more (the mesh's brokers change with a restart: docs/security.md)."""
    config = read_config(path, command)
    if not config.tables.brokers.same_as(brokers):
        message = (
            f"[[{_BROKERS}]] changed since the broker started: the mesh's brokers are read "
            "at start only; restart the broker for them (the users were not reloaded either)"
        )
        raise BadConfig(path, [(config.lines.line_of(_BROKERS), message)])
    return config.tables.users


def read_config_file(ctx: click.Context, param: click.Parameter, path: str | None) -> ConfigTables:
    """--config FILE: its top-level keys are the broker's long flag names, and become those
    flags' defaults (click's default_map), so a flag given on the command line wins. Its
    ``[[users]]`` and ``[[brokers]]`` are the value."""
    if path is None:
        return ConfigTables(UserTable(), UserTable())
    try:
        config = read_config(path, ctx.command)
    except BadConfig as exc:
        raise click.BadParameter(str(exc)) from None
    ctx.default_map = {**(ctx.default_map or {}), **config.flags}
    return config.tables


def check_config_file(ctx: click.Context, param: click.Parameter, path: str | None) -> None:
    """--check-config FILE: check it as --config would read it, print the verdict, exit."""
    if path is None:
        return
    try:
        config = read_config(path, ctx.command)
    except BadConfig as exc:
        click.echo(str(exc), err=True)
        ctx.exit(1)
    users, brokers = len(list(config.tables.users)), len(list(config.tables.brokers))
    click.echo(f"{path}: ok ({users} users, {brokers} brokers)")
    ctx.exit(0)


def _flag_value(ctx: click.Context, option: click.Option, key: str, value: object) -> Any:
    """A config value as the text the flag would get on the command line (a list for a
    repeatable flag; one value may stand alone), checked as click checks the flag.
    click.BadParameter, naming the key, when it does not fit."""
    items = value if isinstance(value, list) and option.multiple else [value]
    if not all(isinstance(item, str | int | float) for item in items):
        kind = "a list of values" if option.multiple else "a string or a number"
        raise click.BadParameter(f"{key} is {kind}, as --{key} takes")
    texts = [str(item) for item in items]
    text: str | list[str] = texts if option.multiple else texts[0]
    try:
        option.type_cast_value(ctx, text)
    except click.BadParameter as exc:
        raise click.BadParameter(f"{key} = {value!r}: {exc.message}") from None
    return text
