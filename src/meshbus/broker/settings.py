"""A setting declared once, as a dataclass field: its type, default, range, help and key.

A setting is a field made with ``setting(...)``: its annotation is its type (an enum for
a choice; ``list[str]`` for a repeatable one), its default is the default, and the
``Setting`` in its metadata holds the rest: the help text, the key (the flag's long name
and the config file's key), the range of a number, and for a text what it must be. The
declarations are in meshbus.broker.config; from them come the flags of ``meshbus
broker`` (meshbus.cli.broker), the config file's keys and the checks of their values
(meshbus.broker.config_file), the check of a config built in code (``check_fields``),
and the table of settings in docs/operations.md (``settings_table``).

Values are checked here rather than by click, so the broker does not depend on the CLI
and a config file or a config built in code is held to the same rules as a flag. The
CLI gives click the same rules (its range, its choices), for --help and for the
command line; the messages here are click's words, so a bad value reads the same as a
flag and in a config file (tests/unit/cli/test_broker_flags.py holds them to that).
"""

from __future__ import annotations

import enum
import os
import stat
import typing
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any, Literal

from meshbus.errors import InvalidArgument

_METADATA = "meshbus.setting"

# A flag's text that means true or false, as click reads a boolean.
_BOOLEANS = {
    **dict.fromkeys(("1", "true", "t", "yes", "y", "on"), True),
    **dict.fromkeys(("0", "false", "f", "no", "n", "off"), False),
}


class BadSetting(InvalidArgument):
    """A setting's value the broker cannot use: the message names the setting (its key)
    and what it takes -- the choices of a choice, the range of a number."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class _Invalid(ValueError):
    """What is wrong with one value, before it is known which setting's it is."""


@dataclass(frozen=True)
class Setting:
    """What a field's annotation and default do not say about a setting.

    ``key`` is the long flag name and the config file's key (default: the field's name,
    dashed). A number's range is ``min``/``max``, each bound included unless ``*_open``.
    A text is ``path`` (a file or a directory, checked as click checks a path), or is
    checked, and possibly converted, by ``parse`` (a ValueError says what is wrong), and
    is shown as ``metavar``."""

    help: str
    key: str = ""
    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False
    path: Literal["", "file", "directory"] = ""
    parse: Callable[[str], Any] | None = None
    metavar: str = "TEXT"


def setting(
    default: Any,
    *,
    help: str,
    key: str = "",
    min: float | None = None,
    max: float | None = None,
    min_open: bool = False,
    max_open: bool = False,
    path: Literal["", "file", "directory"] = "",
    parse: Callable[[str], Any] | None = None,
    metavar: str = "TEXT",
) -> Any:
    """A dataclass field that is a setting (its default is ``default``; a list default is
    copied for each instance)."""
    declared = Setting(help, key, min, max, min_open, max_open, path, parse, metavar)
    if isinstance(default, list):
        return field(default_factory=list, metadata={_METADATA: declared})
    return field(default=default, metadata={_METADATA: declared})


@dataclass(frozen=True)
class Declared:
    """One setting as declared: its field's name, type and default, and its ``Setting``."""

    name: str
    type: Any
    default: Any
    setting: Setting

    @property
    def key(self) -> str:
        return self.setting.key or self.name.replace("_", "-")

    @property
    def help(self) -> str:
        return self.setting.help

    @property
    def multiple(self) -> bool:
        """A repeatable setting: its value is a list."""
        return typing.get_origin(self.type) is list

    @property
    def choices(self) -> tuple[enum.Enum, ...]:
        """The members of a choice's enum; none for any other setting."""
        if isinstance(self.type, type) and issubclass(self.type, enum.Enum):
            return tuple(self.type)
        return ()

    @property
    def range_text(self) -> str:
        """A number's range as click shows it (``x>=1``, ``0<=x<=1``); "" for none."""
        low, high = self.setting.min, self.setting.max
        if low is None and high is None:
            return ""
        if low is None:
            return f"x{'<' if self.setting.max_open else '<='}{high}"
        if high is None:
            return f"x{'>' if self.setting.min_open else '>='}{low}"
        return (
            f"{low}{'<' if self.setting.min_open else '<='}x"
            f"{'<' if self.setting.max_open else '<='}{high}"
        )

    def from_text(self, text: str) -> Any:
        """The value of a flag's text (one item of a repeatable one). BadSetting when it
        does not fit."""
        try:
            return self._parse(text)
        except _Invalid as exc:
            raise BadSetting(self.key, f"{self.key} = {text!r}: {exc}") from None

    def from_config(self, value: object) -> Any:
        """The value of a config file's TOML value: read as the text the flag would get
        on the command line (a list for a repeatable setting, whose one value may also
        stand alone), and checked as the flag is. BadSetting names the key."""
        items = value if isinstance(value, list) and self.multiple else [value]
        if not all(isinstance(item, str | int | float) for item in items):
            kind = "a list of values" if self.multiple else "a string or a number"
            raise BadSetting(self.key, f"{self.key} is {kind}, as --{self.key} takes")
        try:
            parsed = [self._parse(str(item)) for item in items]
        except _Invalid as exc:
            raise BadSetting(self.key, f"{self.key} = {value!r}: {exc}") from None
        return parsed if self.multiple else parsed[0]

    def check(self, value: Any) -> Any:
        """A value given in code, as the field holds it: a choice's text becomes its
        enum member, and a number must be one, in its range. BadSetting otherwise."""
        try:
            if self.choices:
                return value if isinstance(value, self.type) else self._choice(value)
            if self.type is int or self.type is float:
                return self._in_range(self._number(value))
        except _Invalid as exc:
            raise BadSetting(self.key, f"{self.key} = {value!r}: {exc}") from None
        return value

    def _parse(self, text: str) -> Any:
        if self.choices:
            return self._choice(text)
        if self.type is bool:
            truth = _BOOLEANS.get(text.strip().lower())
            if truth is None:
                raise _Invalid(
                    f"{text!r} is not a valid boolean. Recognized values: "
                    f"{', '.join(sorted(_BOOLEANS))}"
                )
            return truth
        if self.type is int or self.type is float:
            try:
                number = self.type(text)
            except ValueError:
                raise _Invalid(self._not_a_number(text)) from None
            return self._in_range(number)
        if self.setting.path:
            _check_path(text, self.setting.path)
        if self.setting.parse is not None:
            try:
                return self.setting.parse(text)
            except ValueError as exc:
                raise _Invalid(str(exc)) from None
        return text

    def _choice(self, value: object) -> enum.Enum:
        for member in self.choices:
            if member.value == value:
                return member
        choices = ", ".join(repr(member.value) for member in self.choices)
        raise _Invalid(f"{value!r} is not one of {choices}.")

    def _not_a_number(self, value: object) -> str:
        kind = "integer" if self.type is int else "float"
        return f"{value!r} is not a valid {kind} range."

    def _number(self, value: object) -> float:
        kinds = int if self.type is int else int | float
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise _Invalid(self._not_a_number(value))
        return value

    def _in_range(self, number: float) -> float:
        low, high = self.setting.min, self.setting.max
        below = low is not None and (number <= low if self.setting.min_open else number < low)
        above = high is not None and (number >= high if self.setting.max_open else number > high)
        if below or above:
            raise _Invalid(f"{number} is not in the range {self.range_text}.")
        return number


def _check_path(text: str, kind: Literal["file", "directory"]) -> None:
    """What click checks of a path that need not exist: not the other kind, readable."""
    try:
        mode = os.stat(text).st_mode
    except OSError:
        return
    name = kind.title()
    if kind == "file" and stat.S_ISDIR(mode):
        raise _Invalid(f"{name} {text!r} is a directory.")
    if kind == "directory" and stat.S_ISREG(mode):
        raise _Invalid(f"{name} {text!r} is a file.")
    if not os.access(text, os.R_OK):
        raise _Invalid(f"{name} {text!r} is not readable.")


def declared_settings(cls: type) -> tuple[Declared, ...]:
    """The settings a dataclass declares, in its fields' order (fields made without
    ``setting`` are not settings)."""
    hints = typing.get_type_hints(cls)
    return tuple(
        Declared(each.name, hints[each.name], _default(each), each.metadata[_METADATA])
        for each in fields(cls)
        if _METADATA in each.metadata
    )


def _default(each: Field[Any]) -> Any:
    return each.default_factory() if callable(each.default_factory) else each.default


def check_fields(instance: object) -> None:
    """Hold every setting of a dataclass instance to its declaration (``Declared.check``):
    for ``__post_init__``, so a config built in code is checked as a flag is."""
    for declared in declared_settings(type(instance)):
        value = getattr(instance, declared.name)
        checked = declared.check(value)
        if checked is not value:
            setattr(instance, declared.name, checked)


def settings_table(*classes: type) -> str:
    """The Markdown table of the settings ``classes`` declare: flag, default, what it
    takes, and its help. docs/operations.md holds it (tests/unit/cli/test_broker_flags.py
    checks that it is this one)."""
    rows = ["| flag | default | takes | meaning |", "|---|---|---|---|"]
    for cls in classes:
        for declared in declared_settings(cls):
            cells = (
                f"`--{declared.key}`",
                _shown_default(declared),
                _takes(declared),
                declared.help.replace("|", "\\|"),
            )
            rows.append(f"| {' | '.join(cells)} |")
    return "\n".join(rows) + "\n"


def _shown_default(declared: Declared) -> str:
    default = declared.default
    if isinstance(default, enum.Enum):
        return f"`{default.value}`"
    if default in ("", None, []) or isinstance(default, bool):
        return "--"
    return f"`{default}`"


def _takes(declared: Declared) -> str:
    if declared.choices:
        return ", ".join(f"`{member.value}`" for member in declared.choices)
    if declared.type is bool:
        return "a flag"
    if declared.type is int or declared.type is float:
        kind = "an integer" if declared.type is int else "a number"
        return f"{kind}, `{declared.range_text}`" if declared.range_text else kind
    if declared.setting.path:
        return f"a {declared.setting.path}"
    repeated = ", repeatable" if declared.multiple else ""
    return f"`{declared.setting.metavar}`{repeated}"
