"""The subject-interest table: which subscriptions want a message on a subject (NATS's
"sublist"), with a bounded cache of what each published subject matched.

A plain table with no I/O. ``S`` is whatever the caller subscribes with (anything
hashable; the NATS listener uses its per-connection subscriptions); the table never
looks inside it. A subscription is to a subject *pattern*: tokens separated by ``.``,
where a token ``*`` matches any one token and a last token ``>`` matches one or more.
A subscription is plain, or in a queue group (a name): a match returns every plain
subscription and, per queue group, its members -- whoever delivers picks one member of
each group per message (NATS's queue semantics; docs/nats.md).

Designed for what comes next (docs/nats.md, "Not yet"): another broker's interest is
an entry like a local one (``S`` then names the peer), so a message's one lookup gives
its local subscribers, its queue groups' members wherever they are -- the member picked
at the origin -- and the brokers to forward it to.

Subjects are bytes, as they came off the wire: the table is byte-exact and never
decodes them. What a valid subject is, both ends check alike (meshbus.protocol.subjects).

``version`` moves with every insert and remove that changed the table, so that a caller
may keep what it worked out from a match for as long as the version stays (the NATS
router does, for a run of messages on one subject).

The cache. A publisher tends to use few subjects many times, so what a subject matched
is kept (at most ``cache_size`` subjects; the least recently used go first). A change that could
alter a cached answer drops it: inserting or removing a literal subject drops that
subject's entry; a pattern with wildcards drops every cached subject it matches. Nothing
else changes what a subject matches, so the cache is never stale
(tests/unit/broker/core/test_subjects.py holds it to a brute-force matcher).

Subjects seen once. The reply subject of every request is new (``_INBOX.<id>.<n>``,
which its requester subscribes to as ``_INBOX.<id>.*`` or ``.>``): cached by subject,
each would be a walk of the table, an entry made and one pushed out that a publisher
may still use. So where the table holds no literal token at a subject's last level --
nothing under the nodes its other tokens lead to but ``*`` and ``>`` -- the match does
not depend on the last token, and it is cached by the subject up to its last ``.``
(``_prefixes``; the ``.`` kept, so that ``a.b`` and the one token ``a`` never share a
key): one entry answers every reply to ``_INBOX.<id>.``, and the subject cache keeps
what is published again. A change drops the prefix entries it may alter as it drops
subjects: those of the subjects it matches, the last token left open.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from meshbus.errors import InvalidArgument
from meshbus.protocol.subjects import is_literal, is_valid_queue, is_valid_subject

__all__ = [
    "DEFAULT_CACHE_SIZE",
    "Interest",
    "InvalidSubject",
    "SubjectTable",
    "is_literal",
    "is_valid_queue",
    "is_valid_subject",
    "pattern_matches",
]

S = TypeVar("S", bound=Hashable)

DEFAULT_CACHE_SIZE = 1024
_SEPARATOR = b"."
_ONE = b"*"
_REST = b">"


class InvalidSubject(InvalidArgument):
    """A subject or pattern the table cannot take: empty, an empty token, whitespace,
    or a ``>`` that is not the last token."""


def pattern_matches(pattern: list[bytes], subject: list[bytes]) -> bool:
    """Whether the tokens of a pattern match those of a published subject."""
    for i, token in enumerate(pattern):
        if token == _REST:
            return len(subject) > i
        if i >= len(subject) or (token != _ONE and token != subject[i]):
            return False
    return len(pattern) == len(subject)


# Not frozen: a frozen dataclass takes three times as long to make, and one is made per
# subject matched anew (every reply subject of a request). It is a value all the same:
# nothing changes one once it is made; the cache hands the same one out.
@dataclass(slots=True)
class Interest(Generic[S]):
    """What one subject matched: the plain subscriptions, and the members of each queue
    group (name, members)."""

    plain: tuple[S, ...]
    queues: tuple[tuple[bytes, tuple[S, ...]], ...]

    def __bool__(self) -> bool:
        return bool(self.plain or self.queues)


_NOTHING: Interest[object] = Interest((), ())


class _Node(Generic[S]):
    """One token of a path: the literal tokens after it, the ``*`` and ``>`` after it,
    and the subscriptions whose pattern ends here."""

    __slots__ = ("children", "one", "plain", "queues", "rest")

    def __init__(self) -> None:
        self.children: dict[bytes, _Node[S]] = {}
        self.one: _Node[S] | None = None
        self.rest: _Node[S] | None = None
        self.plain: dict[S, None] = {}
        self.queues: dict[bytes, dict[S, None]] = {}

    def is_empty(self) -> bool:
        return not (self.children or self.one or self.rest or self.plain or self.queues)

    def child(self, token: bytes) -> _Node[S] | None:
        if token == _ONE:
            return self.one
        if token == _REST:
            return self.rest
        return self.children.get(token)

    def add_child(self, token: bytes) -> _Node[S]:
        node: _Node[S] = _Node()
        if token == _ONE:
            self.one = node
        elif token == _REST:
            self.rest = node
        else:
            self.children[token] = node
        return node

    def drop_child(self, token: bytes) -> None:
        if token == _ONE:
            self.one = None
        elif token == _REST:
            self.rest = None
        else:
            del self.children[token]


class SubjectTable(Generic[S]):
    """Subscriptions by subject pattern (``insert``, ``remove``) and what a published
    subject matches (``match``), cached."""

    def __init__(self, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._root: _Node[S] = _Node()
        self._count = 0
        self._cache: dict[bytes, Interest[S]] = {}
        self._prefixes: dict[bytes, Interest[S]] = {}
        self._cache_size = cache_size
        self.version = 0
        self.cache_hits = 0
        self.cache_misses = 0

    def __len__(self) -> int:
        """Subscriptions in the table."""
        return self._count

    @property
    def cached(self) -> int:
        """Subjects whose match is cached."""
        return len(self._cache)

    @property
    def cached_prefixes(self) -> int:
        """Subject prefixes whose match, whatever the last token, is cached."""
        return len(self._prefixes)

    def insert(self, subject: bytes, queue: bytes, sub: S) -> None:
        """Add ``sub`` to ``subject`` (a pattern), in queue group ``queue`` (empty: a
        plain subscription). InvalidSubject for a subject the table cannot take; adding
        a subscription that is there already changes nothing."""
        if not is_valid_subject(subject):
            raise InvalidSubject(f"invalid subject {subject!r}")
        node = self._root
        for token in subject.split(_SEPARATOR):
            node = node.child(token) or node.add_child(token)
        subs = node.queues.setdefault(queue, {}) if queue else node.plain
        if sub in subs:
            return
        subs[sub] = None
        self._count += 1
        self.version += 1
        self._invalidate(subject)

    def remove(self, subject: bytes, queue: bytes, sub: S) -> bool:
        """Take ``sub`` off ``subject`` (as it was inserted); whether it was there."""
        if not is_valid_subject(subject):
            return False
        path: list[tuple[_Node[S], bytes]] = []
        node = self._root
        for token in subject.split(_SEPARATOR):
            path.append((node, token))
            found = node.child(token)
            if found is None:
                return False
            node = found
        subs = node.queues.get(queue) if queue else node.plain
        if subs is None or sub not in subs:
            return False
        del subs[sub]
        if queue and not subs:
            del node.queues[queue]
        self._count -= 1
        self.version += 1
        # Prune the nodes left empty, from the end of the path back.
        for parent, token in reversed(path):
            if not node.is_empty():
                break
            parent.drop_child(token)
            node = parent
        self._invalidate(subject)
        return True

    def match(self, subject: bytes) -> Interest[S]:
        """The subscriptions a message published on ``subject`` goes to. A subject with
        an empty token matches nothing (nats-server delivers it nowhere)."""
        cache = self._cache
        found = cache.get(subject)
        if found is not None:
            self.cache_hits += 1
            # The most recently used last: what a flood of one-off subjects (the reply
            # subjects of requests) pushes out is what nobody asked for since.
            del cache[subject]
            cache[subject] = found
            return found
        prefix = subject[: subject.rfind(_SEPARATOR) + 1]
        if len(prefix) < len(subject):
            prefixes = self._prefixes
            found = prefixes.get(prefix)
            if found is not None:
                self.cache_hits += 1
                del prefixes[prefix]
                prefixes[prefix] = found
                return found
        self.cache_misses += 1
        tokens = subject.split(_SEPARATOR)
        if not all(tokens):
            return _NOTHING  # type: ignore[return-value]
        interest, by_prefix = self._collect(tokens)
        if by_prefix:
            cache, key = self._prefixes, prefix
        else:
            key = subject
        if len(cache) >= self._cache_size:
            cache = self._evict(cache)
        cache[key] = interest
        return interest

    def _evict(self, cache: dict[bytes, Interest[S]]) -> dict[bytes, Interest[S]]:
        """Make room in ``cache`` (the subjects' or the prefixes'): the less recently
        used half goes, in one copy of the rest (that cache from now on) -- taking the
        oldest one at a time would walk past the holes that every removal from the front
        of a dict leaves."""
        keep = dict(itertools.islice(cache.items(), len(cache) - self._cache_size // 2, None))
        if cache is self._cache:
            self._cache = keep
        else:
            self._prefixes = keep
        return keep

    def _collect(self, tokens: list[bytes]) -> tuple[Interest[S], bool]:
        """What the subject of ``tokens`` matches, and whether any subject that differs
        from it in the last token only matches the same (no literal token of the table's
        was looked up for the last)."""
        # Level by level, not recursive (a subject of 2,000 tokens fits in a control
        # line): the nodes the tokens so far lead to, and those where a subscription
        # matches -- a ``>`` on the way, or where the last token leads.
        ends: list[_Node[S]] = []
        nodes = [self._root]
        last = len(tokens) - 1
        by_prefix = True
        for level, token in enumerate(tokens):
            if level == last:
                by_prefix = not any(node.children for node in nodes)
            following: list[_Node[S]] = []
            for node in nodes:
                if node.rest is not None:
                    ends.append(node.rest)
                if node.one is not None:
                    following.append(node.one)
                child = node.children.get(token)
                if child is not None:
                    following.append(child)
            if not following:
                break
            nodes = following
        else:
            ends += nodes
        plain: list[S] = []
        queues: dict[bytes, list[S]] = {}
        for node in ends:
            if node.plain:
                plain += node.plain
            if node.queues:
                for name, members in node.queues.items():
                    queues.setdefault(name, []).extend(members)
        if not queues:
            interest = Interest(tuple(plain), ()) if plain else _NOTHING
            return interest, by_prefix  # type: ignore[return-value]
        return Interest(
            tuple(plain), tuple([(name, tuple(members)) for name, members in queues.items()])
        ), by_prefix

    def _invalidate(self, pattern: bytes) -> None:
        """Drop the cached answers a change to ``pattern`` may have made wrong."""
        if self._prefixes:
            self._invalidate_prefixes(pattern)
        cache = self._cache
        if not cache:
            return
        if is_literal(pattern):
            cache.pop(pattern, None)
            return
        tokens = pattern.split(_SEPARATOR)
        for subject in [s for s in cache if pattern_matches(tokens, s.split(_SEPARATOR))]:
            del cache[subject]

    def _invalidate_prefixes(self, pattern: bytes) -> None:
        """Drop the prefix entries a change to ``pattern`` may have made wrong: those of
        which some subject ``<prefix><token>`` matches it. The pattern's own token at
        that level is such a token when it has one (a ``*`` or ``>`` there matches any);
        past its end, any token will do, as only a ``>`` before can match."""
        if is_literal(pattern):
            # It matches itself only: the entry of its own prefix.
            self._prefixes.pop(pattern[: pattern.rfind(_SEPARATOR) + 1], None)
            return
        tokens = pattern.split(_SEPARATOR)
        stale: list[bytes] = []
        for prefix in self._prefixes:
            subject = prefix.split(_SEPARATOR)  # its last item, b"", the open token
            level = len(subject) - 1
            subject[level] = tokens[level] if level < len(tokens) else _ONE
            if pattern_matches(tokens, subject):
                stale.append(prefix)
        for prefix in stale:
            del self._prefixes[prefix]
