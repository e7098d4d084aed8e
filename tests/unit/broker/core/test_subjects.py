"""The subject-interest table (meshbus.broker.core.subjects): no invalid subject, wildcards,
queue groups, removal, and a cache that is never stale -- held to a brute-force matcher
by hypothesis over random sequences of inserts, removes and matches."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshbus.broker.core.subjects import Interest, InvalidSubject, SubjectTable


@pytest.mark.parametrize("subject", [b"", b"foo..bar", b"foo bar", b"a.>.b"])
def test_the_table_takes_no_invalid_subject(subject: bytes) -> None:
    table: SubjectTable[str] = SubjectTable()
    with pytest.raises(InvalidSubject):
        table.insert(subject, b"", "s")
    assert len(table) == 0


def test_wildcards_match_as_nats_does() -> None:
    table: SubjectTable[str] = SubjectTable()
    for sub in ("foo.bar", "foo.*", "foo.>", "*.bar", ">", "foo.bar.baz"):
        table.insert(sub.encode(), b"", sub)
    assert set(table.match(b"foo.bar").plain) == {"foo.bar", "foo.*", "foo.>", "*.bar", ">"}
    assert set(table.match(b"foo.bar.baz").plain) == {"foo.>", ">", "foo.bar.baz"}
    assert set(table.match(b"foo").plain) == {">"}  # foo.> needs one token after foo
    assert table.match(b"foo..bar") == Interest((), ())


def test_queue_groups_come_back_by_name() -> None:
    table: SubjectTable[str] = SubjectTable()
    table.insert(b"work.*", b"workers", "a")
    table.insert(b"work.one", b"workers", "b")
    table.insert(b"work.>", b"auditors", "c")
    table.insert(b"work.one", b"", "plain")
    interest = table.match(b"work.one")
    assert interest.plain == ("plain",)
    groups = {name: set(members) for name, members in interest.queues}
    assert groups == {b"workers": {"a", "b"}, b"auditors": {"c"}}


def test_insert_twice_counts_once_and_remove_prunes() -> None:
    table: SubjectTable[str] = SubjectTable()
    table.insert(b"a.b.c", b"", "s")
    table.insert(b"a.b.c", b"", "s")
    assert len(table) == 1
    assert table.remove(b"a.b.c", b"", "s")
    assert not table.remove(b"a.b.c", b"", "s")
    assert not table.remove(b"a.b", b"", "s")
    assert len(table) == 0
    assert table._root.is_empty()


def test_the_version_moves_with_every_change_and_only_then() -> None:
    table: SubjectTable[str] = SubjectTable()
    seen = [table.version]

    def moved() -> bool:
        seen.append(table.version)
        return seen[-1] != seen[-2]

    table.insert(b"a.*", b"", "s")
    assert moved()
    table.insert(b"a.*", b"", "s")  # there already
    assert not moved()
    table.insert(b"a.*", b"q", "s")  # the same sub in a queue group: another entry
    assert moved()
    table.match(b"a.b")
    assert not moved()
    assert not table.remove(b"a.*", b"other", "s")
    assert not table.remove(b"b", b"", "s")
    assert not moved()
    assert table.remove(b"a.*", b"q", "s")
    assert moved()
    with pytest.raises(InvalidSubject):
        table.insert(b"a..b", b"", "s")
    assert not moved()


def test_the_cache_is_dropped_by_a_change_that_concerns_it() -> None:
    table: SubjectTable[str] = SubjectTable()
    table.insert(b"a.b", b"", "x")
    assert table.match(b"a.b").plain == ("x",)
    assert table.match(b"a.c") == Interest((), ())
    assert table.cached == 2
    table.insert(b"a.*", b"", "y")  # matches both cached subjects
    assert table.cached == 0
    assert set(table.match(b"a.b").plain) == {"x", "y"}
    assert table.match(b"z") == Interest((), ())
    table.remove(b"a.b", b"", "x")  # a literal change: only its own entry goes
    assert table.cached == 1
    assert table.match(b"a.b").plain == ("y",)


def test_the_cache_is_bounded() -> None:
    table: SubjectTable[str] = SubjectTable(cache_size=4)
    table.insert(b">", b"", "all")
    table.insert(b"s.x", b"", "x")  # a literal at the last level: cached by subject
    for i in range(10):
        table.match(b"s.%d" % i)
    assert table.cached == 4
    assert table.match(b"s.9").plain == ("all",)
    assert table.cache_hits == 1


def test_the_prefixes_cached_are_bounded() -> None:
    table: SubjectTable[str] = SubjectTable(cache_size=4)
    table.insert(b"*.*", b"", "two")
    for i in range(10):
        assert table.match(b"p%d.r" % i).plain == ("two",)
    assert table.cached_prefixes == 4
    assert table.cached == 0
    assert table.match(b"p9.other").plain == ("two",)
    assert table.cache_hits == 1


def test_a_subject_in_use_stays_cached_through_a_flood_of_one_off_subjects() -> None:
    # The reply subjects of requests: each matched once, by the requesters' inbox pattern,
    # all by one entry of the inbox's prefix.
    table: SubjectTable[str] = SubjectTable(cache_size=8)
    table.insert(b"_INBOX.x.*", b"", "inbox")
    table.insert(b"svc", b"", "service")
    for i in range(100):
        assert table.match(b"svc").plain == ("service",)
        assert table.match(b"_INBOX.x.%d" % i).plain == ("inbox",)
    assert (table.cached, table.cached_prefixes) == (1, 1)
    assert table.cache_misses == 2
    assert table.cache_hits == 99 + 99


def test_a_literal_at_the_last_level_ends_the_prefix_entry() -> None:
    table: SubjectTable[str] = SubjectTable()
    table.insert(b"_INBOX.x.>", b"", "rest")
    table.insert(b"_INBOX.y.*", b"", "y")
    assert table.match(b"_INBOX.x.1").plain == ("rest",)
    assert table.match(b"_INBOX.y.1").plain == ("y",)
    assert table.cached_prefixes == 2
    table.insert(b"_INBOX.x.5", b"", "five")  # a subject of _INBOX.x.'s: only that entry goes
    assert table.cached_prefixes == 1
    assert set(table.match(b"_INBOX.x.5").plain) == {"rest", "five"}
    assert table.match(b"_INBOX.x.6").plain == ("rest",)
    assert table.cached_prefixes == 1  # _INBOX.x.'s answers now depend on the last token
    table.insert(b"_INBOX.*.*.z", b"", "longer")  # matches no subject of three tokens
    assert table.cached_prefixes == 1
    table.insert(b"_INBOX.>", b"", "all")
    assert table.cached_prefixes == 0
    assert set(table.match(b"_INBOX.y.2").plain) == {"y", "all"}


def test_one_token_and_an_empty_token_never_share_an_entry() -> None:
    table: SubjectTable[str] = SubjectTable()
    table.insert(b"*", b"", "one")
    assert table.match(b"a").plain == ("one",)
    assert table.cached_prefixes == 1
    assert table.match(b"b").plain == ("one",)
    assert not table.match(b".b")
    assert not table.match(b"b.")
    assert not table.match(b"a..b")


def test_a_long_subject_does_not_recurse() -> None:
    table: SubjectTable[str] = SubjectTable()
    subject = b".".join([b"t"] * 3000)
    table.insert(subject, b"", "deep")
    table.insert(b".".join([b"*"] * 3000), b"", "stars")
    assert set(table.match(subject).plain) == {"deep", "stars"}


# -- a brute-force model ----------------------------------------------------------------

TOKENS = st.sampled_from([b"a", b"b", b"c"])
PATTERN_TOKENS = st.sampled_from([b"a", b"b", b"c", b"*", b">"])


@st.composite
def patterns(draw: st.DrawFn) -> bytes:
    tokens = draw(st.lists(PATTERN_TOKENS, min_size=1, max_size=4))
    # '>' only last: the rest of a drawn '>' is cut off.
    if b">" in tokens:
        tokens = tokens[: tokens.index(b">") + 1]
    return b".".join(tokens)


subjects = st.lists(TOKENS, min_size=1, max_size=4).map(b".".join)


def brute_match(pattern: bytes, subject: bytes) -> bool:
    """Match by the rules alone, written the other way round from the table's."""
    p, s = pattern.split(b"."), subject.split(b".")
    if p[-1] == b">":
        head = p[:-1]
        return len(s) > len(head) and all(x in (b"*", y) for x, y in zip(head, s, strict=False))
    return len(p) == len(s) and all(x in (b"*", y) for x, y in zip(p, s, strict=True))


operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("insert"), patterns(), st.sampled_from([b"", b"q1", b"q2"]), st.integers(0, 5)
        ),
        st.tuples(
            st.just("remove"), patterns(), st.sampled_from([b"", b"q1", b"q2"]), st.integers(0, 5)
        ),
        st.tuples(st.just("match"), subjects, st.just(b""), st.just(0)),
    ),
    max_size=60,
)


@given(operations, st.integers(1, 8))
def test_matches_agree_with_brute_force_through_any_changes(
    ops: list[tuple[str, bytes, bytes, int]], cache_size: int
) -> None:
    table: SubjectTable[int] = SubjectTable(cache_size=cache_size)
    model: set[tuple[bytes, bytes, int]] = set()
    for op, subject, queue, sub in ops:
        if op == "insert":
            table.insert(subject, queue, sub)
            model.add((subject, queue, sub))
        elif op == "remove":
            assert table.remove(subject, queue, sub) == ((subject, queue, sub) in model)
            model.discard((subject, queue, sub))
        else:
            interest = table.match(subject)
            wanted = [(p, q, s) for p, q, s in model if brute_match(p, subject)]
            assert Counter(interest.plain) == Counter(s for _, q, s in wanted if not q)
            got_queues = {name: Counter(members) for name, members in interest.queues}
            want_queues: dict[bytes, Counter[int]] = {}
            for _, q, s in wanted:
                if q:
                    want_queues.setdefault(q, Counter())[s] += 1
            assert got_queues == want_queues
        assert len(table) == len(model)
