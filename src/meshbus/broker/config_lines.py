"""Where a key is in a TOML file: the line of ``users[2].permissions.send``.

``tomllib`` gives a line for a syntax error only; an error found in what it read (an
unknown key, a bad pattern) names a key path, and this finds its line in the file's
text, so ``meshbus broker --check-config`` can say ``broker.toml:14: ...``.

A key path is dotted TOML keys; an array of tables is indexed from 1, as the error
messages count (``users[2]`` is the second ``[[users]]``). The scan is line by line
and approximate, on purpose: it knows table headers (``[a.b]``, ``[[a]]``) and
``key = value`` lines with bare keys, not multi-line strings or quoted keys. A key
it cannot place -- inside an inline table or a multi-line array, or quoted -- gets
the line of the nearest enclosing key or table it found, and a path it knows
nothing of, line 1.
"""

from __future__ import annotations

import re

_BARE = r"[A-Za-z0-9_-]+"
_DOTTED = rf"{_BARE}(?:\s*\.\s*{_BARE})*"
_ARRAY_HEADER = re.compile(rf"\s*\[\[\s*({_DOTTED})\s*\]\]")
_TABLE_HEADER = re.compile(rf"\s*\[\s*({_DOTTED})\s*\]")
_KEY = re.compile(rf"\s*({_DOTTED})\s*=")
# The last step of a key path: ``[2]`` or ``.send`` (or the first key, ``users``).
_LAST_STEP = re.compile(r"(\[\d+\]|\.?[^.\[\]]+)$")


def _parts(dotted: str) -> list[str]:
    return [part.strip() for part in dotted.split(".")]


class KeyLines:
    """The line of every table and key of one file's text, found once."""

    def __init__(self, text: str) -> None:
        self._lines: dict[str, int] = {}
        counts: dict[str, int] = {}  # an array of tables' path -> its tables so far
        table = ""
        for number, line in enumerate(text.splitlines(), 1):
            if header := _ARRAY_HEADER.match(line):
                *parents, name = _parts(header[1])
                parent = self._resolve(parents, counts)
                path = f"{parent}.{name}" if parent else name
                counts[path] = counts.get(path, 0) + 1
                self._lines.setdefault(path, number)
                table = f"{path}[{counts[path]}]"
            elif header := _TABLE_HEADER.match(line):
                table = self._resolve(_parts(header[1]), counts)
            elif key := _KEY.match(line):
                path = ".".join([table, *_parts(key[1])] if table else _parts(key[1]))
                self._lines.setdefault(path, number)
                continue
            else:
                continue
            self._lines.setdefault(table, number)

    @staticmethod
    def _resolve(parts: list[str], counts: dict[str, int]) -> str:
        """A header's path, each array of tables in it standing for its last table
        (``[users.permissions]`` after the second ``[[users]]``: ``users[2].permissions``)."""
        path = ""
        for part in parts:
            path = f"{path}.{part}" if path else part
            if path in counts:
                path = f"{path}[{counts[path]}]"
        return path

    def line_of(self, key: str) -> int:
        """The line of ``key``, or of the nearest key or table around it; 1 if none."""
        while key:
            line = self._lines.get(key)
            if line is not None:
                return line
            key = _LAST_STEP.sub("", key)
        return 1
