"""What one user may do: a plain table of allow and deny patterns (docs/security.md,
"Permissions").

A user's ``permissions`` table in the broker's config file becomes a
``Permissions`` (``Permissions.from_table``); the sign-in hands it to the links
that user opens (``Link.permissions``). A link with None -- a broker without
users, a peer broker -- may do everything. With a ``Permissions``, everything
not allowed is denied.

Patterns are ``fnmatch.fnmatchcase`` patterns (``*``, ``?``, ``[seq]``,
``[!seq]``, case-sensitive) over the text form of what is checked: an address
(``game01:7``, ``multicast:chat.lobby``, ``anycast:login``), a server name, a
stream name, an operator right. A name is permitted when an allow pattern
matches it and no deny pattern does: deny wins.

The broker asks once per link and address, where a decision is made (the
forwarder's cache-miss path, the control dispatch), and answers for addresses
are memoised per ``Permissions`` (bounded), so a user's links share them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from fnmatch import translate

from meshbus.address import (
    BROADCAST_GROUP,
    SUBJECTS,
    Address,
    describe_address,
    server_name_bytes,
)
from meshbus.errors import InvalidArgument

REGISTER, SEND, REQUEST, JOIN, STREAMS, OPERATOR = (
    "register",
    "send",
    "request",
    "join",
    "streams",
    "operator",
)
# The operations of ``streams``, and the STREAM request ops (protocol.md §5.4) each covers.
STREAM_OPERATIONS = {
    "add": ("add",),
    "delete": ("delete",),
    "read": ("info", "list", "fetch"),
    "consume": ("consumer_add", "consumer_delete", "consumer_info", "next", "ack"),
}
_OPERATION_OF = {op: operation for operation, ops in STREAM_OPERATIONS.items() for op in ops}
# The rights of ``operator``: ``stat-detail`` also gives the brief ``stat`` (unless denied);
# ``consumers``: using and deleting every user's durable consumers, not only one's own.
STAT, STAT_DETAIL, DRAIN, TELEMETRY, CONSUMERS = (
    "stat",
    "stat-detail",
    "drain",
    "telemetry",
    "consumers",
)
OPERATOR_RIGHTS = (STAT, STAT_DETAIL, DRAIN, TELEMETRY, CONSUMERS)
# Streams whose names start so are the brokers' telemetry and traces
# (meshbus.broker.observe.telemetry): reading them takes the ``telemetry`` right, not ``streams``.
TELEMETRY_PREFIXES = ("telemetry.", "traces.")
_BROADCAST = BROADCAST_GROUP.to_bytes()
_KEYS = (REGISTER, SEND, REQUEST, JOIN, STREAMS, OPERATOR)
_WILDCARDS = re.compile(r"[*?\[]")
_MAX_PATTERN = 256
# Answers remembered per Permissions; past this many it starts over (a sender of many
# distinct destinations cannot grow it without limit).
MEMO_SIZE = 4096


class BadPermissions(InvalidArgument):
    """A ``permissions`` table the broker cannot use; the message names the user, the key
    and the pattern, and ``key`` is that key's path (``permissions.send.deny``)."""

    def __init__(self, message: str, key: str = "permissions") -> None:
        super().__init__(message)
        self.key = key


def _matcher(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    if not patterns:
        return lambda name: False
    match = re.compile("|".join(translate(p) for p in patterns)).match
    return lambda name: match(name) is not None


class Rule:
    """Allow and deny patterns over names: permitted when an allow pattern matches and no
    deny pattern does. No allow pattern: nothing is permitted."""

    __slots__ = ("_allowed", "_denied", "allow", "deny")

    def __init__(self, allow: Iterable[str] = (), deny: Iterable[str] = ()) -> None:
        self.allow = tuple(allow)
        self.deny = tuple(deny)
        self._allowed = _matcher(self.allow)
        self._denied = _matcher(self.deny)

    def permits(self, name: str) -> bool:
        return self._allowed(name) and not self._denied(name)

    def denies(self, name: str) -> bool:
        """A deny pattern matches ``name``."""
        return self._denied(name)

    def __repr__(self) -> str:
        return f"Rule(allow={list(self.allow)!r}, deny={list(self.deny)!r})"


_NOTHING = Rule()


class Permissions:
    """One user's permissions. Build it with ``from_table``; the broker asks ``may_*``."""

    def __init__(
        self,
        user: str,
        *,
        register: Rule = _NOTHING,
        send: Rule = _NOTHING,
        request: Rule = _NOTHING,
        join: Rule = _NOTHING,
        streams: Mapping[str, Rule] | None = None,
        operator: Rule = _NOTHING,
    ) -> None:
        """``register`` is over server names, ``send``, ``request`` and ``join`` over
        addresses, ``streams`` maps each of STREAM_OPERATIONS to a rule over stream names,
        ``operator`` is over OPERATOR_RIGHTS."""
        self.user = user
        self.register = register
        self.send = send
        self.request = request
        self.join = join
        self.streams = {operation: _NOTHING for operation in STREAM_OPERATIONS} | dict(
            streams or {}
        )
        self.operator = operator
        rights = {right for right in OPERATOR_RIGHTS if operator.permits(right)}
        if STAT_DETAIL in rights and not operator.denies(STAT):
            rights.add(STAT)
        self.rights = frozenset(rights)
        self._memo: dict[tuple[Rule, bytes], bool] = {}

    @classmethod
    def from_table(cls, table: Mapping[str, object], user: str) -> Permissions:
        """The permissions of ``user`` from its ``permissions`` table (an empty one for a
        user without: it may do nothing). BadPermissions names the user and the bad key
        or pattern."""
        if not isinstance(table, Mapping):
            raise BadPermissions(f"user {user!r}: permissions is a table, not {table!r}")
        _no_unknown_keys(table, _KEYS, user, "permissions")
        streams_table = table.get(STREAMS, {})
        if not isinstance(streams_table, Mapping):
            raise BadPermissions(
                f"user {user!r}: permissions.streams is a table of "
                f"{', '.join(STREAM_OPERATIONS)}, not {streams_table!r}",
                f"permissions.{STREAMS}",
            )
        _no_unknown_keys(streams_table, tuple(STREAM_OPERATIONS), user, "permissions.streams")

        def rule(key: str, check: Callable[[str], None]) -> Rule:
            return _rule(table.get(key, ()), f"permissions.{key}", user, check)

        return cls(
            user,
            register=rule(REGISTER, _check_server_pattern),
            send=rule(SEND, _check_address_pattern),
            request=rule(REQUEST, _check_address_pattern),
            join=rule(JOIN, _check_group_pattern),
            streams={
                operation: _rule(
                    streams_table.get(operation, ()),
                    f"permissions.{STREAMS}.{operation}",
                    user,
                    _check_name_pattern,
                )
                for operation in STREAM_OPERATIONS
            },
            operator=rule(OPERATOR, _check_right_pattern),
        )

    # -- the checks -------------------------------------------------------------------

    def may_register(self, server: str) -> bool:
        return self.register.permits(server)

    def may_send(self, dst: bytes) -> bool:
        """A message to a subject (``SUBJECTS``) passes here: its subject, in the frame's
        extension block, is checked where it is read (meshbus.broker.nats.services)."""
        return dst == SUBJECTS or self._permits(self.send, dst)

    def may_request(self, dst: bytes) -> bool:
        return self._permits(self.request, dst)

    def may_join(self, group: bytes) -> bool:
        """The broadcast group is open to all: every client service joins it, and who may
        send to it is ``send``'s to say."""
        return group == _BROADCAST or self._permits(self.join, group)

    def may_stream(self, op: str, stream: str) -> bool:
        """Whether the STREAM request ``op`` may name ``stream``. Reading a telemetry
        stream takes the ``telemetry`` right; an unknown op is never permitted."""
        operation = stream_operation(op)
        if operation is None:
            return False
        if operation in ("read", "consume") and stream.startswith(TELEMETRY_PREFIXES):
            return self.may_operate(TELEMETRY)
        return self.streams[operation].permits(stream)

    def may_capture(self, group: bytes) -> bool:
        """A stream may capture ``group`` for this user: it could join it and read the
        same messages."""
        return self.may_join(group)

    def may_operate(self, right: str) -> bool:
        return right in self.rights

    @property
    def may_open_operator_link(self) -> bool:
        """Whether the user has any use for an operator link (``meshbus stat``, ``drain``,
        ``top``, ``report``, ``stream``): an operator right, or a stream permission, since
        the stream commands go over an operator link too. A user with neither would only
        hold one of the broker's few --max-operators links."""
        return bool(self.rights) or any(rule.allow for rule in self.streams.values())

    def denial(self, action: str, permission: str) -> str:
        """The message of a refusal: ``action`` is what the user may not do ("send to
        multicast:admin"), ``permission`` the key that decides it ("send")."""
        return f"permission denied: user {self.user!r} may not {action} (permissions.{permission})"

    def _permits(self, rule: Rule, address: bytes) -> bool:
        memo = self._memo
        key = (rule, address)
        known = memo.get(key)
        if known is None:
            if len(memo) >= MEMO_SIZE:
                memo.clear()
            known = memo[key] = rule.permits(describe_address(address))
        return known

    def __repr__(self) -> str:
        return f"<Permissions of {self.user!r}>"


def stream_operation(op: str) -> str | None:
    """The operation of ``streams`` that covers the STREAM request ``op`` (None: no such
    op)."""
    return _OPERATION_OF.get(op)


# -- reading a table ------------------------------------------------------------------


def _no_unknown_keys(
    table: Mapping[str, object], known: tuple[str, ...], user: str, where: str
) -> None:
    for key in table:
        if key not in known:
            raise BadPermissions(
                f"user {user!r}: unknown key {where}.{key} (the keys are {', '.join(known)})",
                f"{where}.{key}",
            )


def _rule(value: object, where: str, user: str, check: Callable[[str], None]) -> Rule:
    """The rule at ``where``: a list of patterns (allowed), or ``{ allow, deny }``."""
    if isinstance(value, Mapping):
        _no_unknown_keys(value, ("allow", "deny"), user, where)
        deny = _patterns(value.get("deny", ()), user, f"{where}.deny", check)
        return Rule(_patterns(value.get("allow", ()), user, f"{where}.allow", check), deny)
    return Rule(_patterns(value, user, where, check))


def _patterns(value: object, user: str, where: str, check: Callable[[str], None]) -> list[str]:
    if not isinstance(value, (list, tuple)):
        raise BadPermissions(
            f"user {user!r}: {where} is a list of patterns, or a table "
            f"{{ allow = [...], deny = [...] }}; not {value!r}",
            where,
        )
    patterns: list[str] = []
    for pattern in value:
        if not isinstance(pattern, str) or not pattern or len(pattern) > _MAX_PATTERN:
            raise BadPermissions(
                f"user {user!r}: {where} has {pattern!r}; a pattern is a string of 1 to "
                f"{_MAX_PATTERN} characters",
                where,
            )
        try:
            check(pattern)
        except ValueError as exc:
            raise BadPermissions(
                f"user {user!r}: {where} pattern {pattern!r}: {exc}", where
            ) from None
        patterns.append(_canonical(pattern))
    return patterns


def _canonical(pattern: str) -> str:
    """Unicast addresses are matched in their short text form, ``server:instance``."""
    return pattern.removeprefix("unicast:")


def _literal(pattern: str) -> bool:
    return _WILDCARDS.search(pattern) is None


def _check_name_pattern(pattern: str) -> None:
    if "\x00" in pattern:
        raise ValueError("a pattern has no NUL")


def _check_address_pattern(pattern: str) -> None:
    """A pattern without wildcards is an address; one with them is taken as written."""
    _check_name_pattern(pattern)
    if _literal(pattern):
        Address.parse(pattern)


def _check_group_pattern(pattern: str) -> None:
    _check_address_pattern(pattern)
    if _literal(pattern) and not Address.parse(pattern).is_group:
        raise ValueError("only multicast and anycast addresses are groups")


def _check_server_pattern(pattern: str) -> None:
    _check_name_pattern(pattern)
    if ":" in pattern:
        raise ValueError("register takes server names, which have no ':'")
    if _literal(pattern):
        server_name_bytes(pattern)


def _check_right_pattern(pattern: str) -> None:
    if not any(_matcher((pattern,))(right) for right in OPERATOR_RIGHTS):
        raise ValueError(f"it matches none of the rights {', '.join(OPERATOR_RIGHTS)}")
