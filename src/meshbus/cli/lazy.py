"""A click group whose commands live in other modules, imported when one is looked up.

A process starts with the imports of the one command it runs: ``meshbus broker``
does not import ``top``'s screen or the report's Spark job (a tenth of a second on
every broker start and every command of a script).
"""

from __future__ import annotations

import importlib
from typing import Any

import click


class LazyGroup(click.Group):
    """The commands defined on the group itself, and those of ``elsewhere`` (a command's
    name: ``module:attribute``), imported on demand."""

    def __init__(self, *args: Any, elsewhere: dict[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.elsewhere = elsewhere

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.elsewhere])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.elsewhere:
            return super().get_command(ctx, cmd_name)
        module, _, attribute = self.elsewhere[cmd_name].partition(":")
        command = getattr(importlib.import_module(module), attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"{self.elsewhere[cmd_name]} is not a click command")
        return command
