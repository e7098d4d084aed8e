"""The broker's config file (``meshbus broker --config``): reading it, checking it
(``--check-config``) and reading it again on SIGHUP, one way for all three.

Its top-level keys are the keys of the settings declared in meshbus.broker.config (the
long flag names of ``meshbus broker``); each value is read as the text its flag would
get, and checked as the flag is. Its tables are the users and the brokers of the mesh
(docs/security.md). Every error has its line (meshbus.broker.config_lines).
"""

from __future__ import annotations

import difflib
import re
import tomllib
from typing import Any, NamedTuple

from meshbus.broker.config import BrokerConfig, StartSettings
from meshbus.broker.config_lines import KeyLines
from meshbus.broker.security.users import BadEntries, UserTable
from meshbus.broker.settings import BadSetting, Declared, declared_settings
from meshbus.errors import InvalidArgument
from meshbus.private_files import WRITABLE_BY_OTHERS, check_private


class ConfigTables(NamedTuple):
    """The tables of a broker's config file (docs/security.md): ``[[users]]``, who may
    connect; ``[[brokers]]``, the brokers of the mesh; and the file they came from ("":
    no config file)."""

    users: UserTable
    brokers: UserTable
    path: str = ""

    @classmethod
    def empty(cls) -> ConfigTables:
        """No config file: no users, no brokers."""
        return cls(UserTable(), UserTable())

    def check_private(self) -> None:
        """A config file of users is its owner's: no other user may change it, nor read it
        when it holds token hashes (docs/security.md, "Files that hold secrets").
        InsecureFile says which and how to fix it; nothing to check without users."""
        if self.path and (self.users or self.brokers):
            hashes = any(user.token_hash is not None for user in self.users)
            what = "the config file, which holds token hashes," if hashes else "the config file"
            check_private(self.path, what, mask=0o077 if hashes else WRITABLE_BY_OTHERS)


class ConfigFile(NamedTuple):
    """What a broker's config file says: its settings' values (by field name, of
    StartSettings and BrokerConfig) and its tables."""

    settings: dict[str, Any]
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


def _settings_by_key() -> dict[str, Declared]:
    return {
        declared.key: declared
        for cls in (StartSettings, BrokerConfig)
        for declared in declared_settings(cls)
    }


def read_config(path: str) -> ConfigFile:
    """Read and check a broker's config file, as ``--config``, ``--check-config`` and a
    reload (SIGHUP) do. BadConfig lists every error with its line: a syntax error (TOML
    stops there), or each unknown key, bad setting value, bad user and bad broker."""
    try:
        with open(path, "rb") as file:
            raw = file.read()
    except OSError as exc:
        raise BadConfig(path, [(0, f"cannot read it: {exc.strerror or exc}")]) from None
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise BadConfig(path, [(1, f"is not valid TOML: {exc}")]) from None
    return config_from_text(text, path)


def config_from_text(text: str, path: str) -> ConfigFile:
    """``read_config`` of a file's text (``path`` names it in the errors): what
    ``meshbus keygen --allow`` checks the entry it prints with."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # Python 3.11's TOMLDecodeError has no line attribute; its message ends with one.
        at = re.search(r"at line (\d+)", str(exc))
        raise BadConfig(path, [(int(at[1]) if at else 1, f"is not valid TOML: {exc}")]) from None
    lines = KeyLines(text)
    errors: list[tuple[int, str]] = []
    by_key = _settings_by_key()
    settings: dict[str, Any] = {}
    for key, value in data.items():
        if key in (_USERS, _BROKERS):
            continue
        declared = by_key.get(key)
        if declared is None:
            close = difflib.get_close_matches(key, [*by_key, _USERS, _BROKERS], n=1)
            errors.append(
                (
                    lines.line_of(key),
                    f"unknown key {key!r}"
                    + (f" (did you mean {close[0]!r}?)" if close else "")
                    + "; the keys are the broker's long flag names "
                    f"(see meshbus broker --help), [[{_USERS}]] and [[{_BROKERS}]]",
                )
            )
            continue
        try:
            settings[declared.name] = declared.from_config(value)
        except BadSetting as exc:
            errors.append((lines.line_of(key), str(exc)))
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
    return ConfigFile(settings, ConfigTables(users, brokers, path), lines)


def reread_users(path: str, brokers: UserTable, *, check_mode: bool = True) -> UserTable:
    """What a reload (SIGHUP) applies: the users of the config file ``path``, read and
    checked as at start -- its mode too, unless ``check_mode`` is off
    (--allow-insecure-key-files). BadConfig for any error in the file, InsecureFile for a
    file others may change (or read, with token hashes), and BadConfig for a
    ``[[brokers]]`` that is not ``brokers`` any more (the mesh's brokers change with a
    restart: docs/security.md)."""
    config = read_config(path)
    if check_mode:
        config.tables.check_private()
    if not config.tables.brokers.same_as(brokers):
        message = (
            f"[[{_BROKERS}]] changed since the broker started: the mesh's brokers are read "
            "at start only; restart the broker for them (the users were not reloaded either)"
        )
        raise BadConfig(path, [(config.lines.line_of(_BROKERS), message)])
    return config.tables.users
