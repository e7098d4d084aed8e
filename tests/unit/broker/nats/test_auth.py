"""A user's permissions read for subjects (meshbus.broker.nats.auth.SubjectPermissions):
publish by ``send``, subscribe by ``join``, and a deny of ``join`` kept out of a wildcard
subscription."""

from __future__ import annotations

from meshbus.broker.nats.auth import MEMO_SIZE, SubjectPermissions
from meshbus.broker.security.permissions import Permissions


def permissions(**table: object) -> SubjectPermissions:
    return SubjectPermissions(Permissions.from_table(table, "bob"))


def test_publish_is_send_and_subscribe_is_join_of_the_multicast_name() -> None:
    perms = permissions(
        send=["multicast:orders.*"],
        join={"allow": ["multicast:orders.*"], "deny": ["multicast:orders.secret"]},
    )
    assert perms.may_publish(b"orders.new")
    assert perms.may_publish(b"orders.a.b")  # fnmatch's * takes dots too
    assert not perms.may_publish(b"billing.new")
    assert perms.may_subscribe(b"orders.*")
    assert perms.may_subscribe(b"orders.>")
    assert not perms.may_subscribe(b"orders.secret")
    assert not perms.may_subscribe(b">")
    assert perms.may_deliver(b"orders.new")
    assert not perms.may_deliver(b"orders.secret")


def test_no_permissions_permit_nothing() -> None:
    perms = permissions()
    assert not perms.may_publish(b"a")
    assert not perms.may_subscribe(b"a")
    assert perms.may_deliver(b"a")  # nothing denied: what was subscribed is delivered


def test_answers_stay_right_past_the_memo() -> None:
    perms = permissions(send=["multicast:ok.*"])
    for i in range(MEMO_SIZE + 10):
        assert perms.may_publish(b"ok.%d" % i)
        assert not perms.may_publish(b"no.%d" % i)


def test_subjects_that_are_not_utf8_are_checked_as_they_are() -> None:
    perms = permissions(send=["multicast:ok.*"])
    assert perms.may_publish(b"ok.\xff")
    assert not perms.may_publish(b"\xffok.x")
