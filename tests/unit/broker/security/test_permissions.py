"""A user's permissions table (meshbus.broker.security.permissions): patterns, deny wins, a list or
a table, streams and operator rights, and the errors of a table the broker cannot use."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from meshbus.address import BROADCAST_GROUP, Anycast, Multicast, Unicast
from meshbus.broker.security.permissions import MEMO_SIZE, BadPermissions, Permissions, Rule
from meshbus.errors import InvalidArgument


def permissions(**table: object) -> Permissions:
    return Permissions.from_table(table, "game")


def unicast(server: str, instance: int) -> bytes:
    return Unicast(server, instance).to_bytes()


def multicast(name: str) -> bytes:
    return Multicast(name).to_bytes()


def test_patterns_match_the_text_form_of_addresses() -> None:
    game = permissions(
        send=["game*:*", "multicast:chat.*", "anycast:login", "unicast:login:1"],
    )
    assert game.may_send(unicast("game01", 65537))
    assert game.may_send(unicast("game", 7))
    assert game.may_send(multicast("chat.lobby"))
    assert game.may_send(Anycast("login").to_bytes())
    assert game.may_send(unicast("login", 1)), "unicast: written out or not, one address"
    assert not game.may_send(unicast("login", 2))
    assert not game.may_send(multicast("chat")), "chat.* needs the dot"
    assert not game.may_send(Anycast("login2").to_bytes())
    assert not game.may_send(multicast("game01")), "multicast:game01 starts with multicast:"


def test_matching_is_case_sensitive_and_has_sets() -> None:
    game = permissions(send=["multicast:room[0-3]", "anycast:?ogin"])
    assert game.may_send(multicast("room2"))
    assert not game.may_send(multicast("room4"))
    assert not game.may_send(multicast("Room2"))
    assert game.may_send(Anycast("login").to_bytes())
    assert game.may_send(Anycast("Login").to_bytes())


def test_deny_wins_over_allow() -> None:
    game = permissions(send={"allow": ["*"], "deny": ["multicast:admin*", "login:*"]})
    assert game.may_send(multicast("chat"))
    assert game.may_send(Anycast("admin").to_bytes()), "only multicast:admin* is denied"
    assert not game.may_send(multicast("admin"))
    assert not game.may_send(multicast("admin.ops"))
    assert not game.may_send(unicast("login", 1))


def test_a_list_allows_and_a_table_with_deny_only_allows_nothing() -> None:
    assert permissions(join=["multicast:chat"]).may_join(multicast("chat"))
    assert not permissions(join={"deny": ["multicast:x"]}).may_join(multicast("chat"))
    assert permissions(join={"allow": ["multicast:*"]}).may_join(multicast("chat"))


def test_each_permission_is_its_own() -> None:
    game = permissions(send=["*"])
    target = multicast("chat")
    assert game.may_send(target)
    assert not game.may_request(target)
    assert not game.may_join(target)
    assert not game.may_register("game01")
    other = permissions(request=["anycast:login"], join=["multicast:chat"], register=["game*"])
    assert other.may_request(Anycast("login").to_bytes())
    assert not other.may_send(Anycast("login").to_bytes())
    assert other.may_join(target)
    assert other.may_register("game01")
    assert not other.may_register("login")


def test_no_table_allows_nothing() -> None:
    nobody = permissions()
    assert not nobody.may_send(multicast("chat"))
    assert not nobody.may_request(unicast("login", 1))
    assert not nobody.may_join(multicast("chat"))
    assert not nobody.may_register("game01")
    for op in ("add", "delete", "info", "list", "fetch", "next", "ack", "consumer_add"):
        assert not nobody.may_stream(op, "scores")
    assert nobody.rights == frozenset()


def test_streams_per_operation() -> None:
    reader = permissions(
        streams={
            "read": ["scores.*"],
            "consume": {"allow": ["scores.*"], "deny": ["scores.secret"]},
            "add": ["tmp.*"],
        }
    )
    for op in ("info", "fetch", "list"):
        assert reader.may_stream(op, "scores.daily")
        assert not reader.may_stream(op, "orders")
    for op in ("consumer_add", "consumer_delete", "consumer_info", "next", "ack"):
        assert reader.may_stream(op, "scores.daily")
        assert not reader.may_stream(op, "scores.secret")
    assert reader.may_stream("add", "tmp.1")
    assert not reader.may_stream("add", "scores.daily")
    assert not reader.may_stream("delete", "tmp.1")
    assert not reader.may_stream("frobnicate", "tmp.1"), "an unknown op is never permitted"


def test_telemetry_streams_take_the_telemetry_right() -> None:
    everything = permissions(streams={"read": ["*"], "consume": ["*"], "delete": ["*"]})
    assert everything.may_stream("fetch", "scores")
    assert not everything.may_stream("fetch", "telemetry.a")
    assert not everything.may_stream("next", "traces.a")
    assert everything.may_stream("delete", "telemetry.a"), "add and delete: streams as any"
    watcher = permissions(operator=["telemetry"])
    assert watcher.may_stream("fetch", "telemetry.a")
    assert watcher.may_stream("list", "traces.a")
    assert not watcher.may_stream("fetch", "scores")


def test_operator_rights() -> None:
    assert permissions(operator=["stat"]).rights == {"stat"}
    assert permissions(operator=["stat-detail"]).rights == {"stat", "stat-detail"}
    assert permissions(operator={"allow": ["stat-detail"], "deny": ["stat"]}).rights == {
        "stat-detail"
    }
    assert permissions(operator=["*"]).rights == {
        "stat",
        "stat-detail",
        "drain",
        "telemetry",
        "consumers",
    }
    ops = permissions(operator={"allow": ["*"], "deny": ["drain"]})
    assert ops.may_operate("stat")
    assert ops.may_operate("telemetry")
    assert not ops.may_operate("drain")


class CountingRule(Rule):
    __slots__ = ("calls",)

    def __init__(self, allow: list[str]) -> None:
        super().__init__(allow)
        self.calls = 0

    def permits(self, name: str) -> bool:
        self.calls += 1
        return super().permits(name)


def test_answers_are_memoised_and_bounded() -> None:
    rule = CountingRule(["multicast:*"])
    game = Permissions("game", send=rule)
    target = multicast("chat")
    assert game.may_send(target)
    assert game.may_send(target)
    assert rule.calls == 1
    for i in range(MEMO_SIZE + 10):
        game.may_send(multicast(f"g{i}"))
    assert len(game._memo) <= MEMO_SIZE


def test_denial_names_the_user_the_action_and_the_permission() -> None:
    assert permissions().denial("send to multicast:admin", "send") == (
        "permission denied: user 'game' may not send to multicast:admin (permissions.send)"
    )


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ({"sned": ["*"]}, "unknown key permissions.sned"),
        ({"send": "*"}, "permissions.send is a list of patterns"),
        ({"send": {"allow": ["*"], "dney": []}}, "unknown key permissions.send.dney"),
        ({"send": [""]}, "permissions.send has ''"),
        ({"send": [7]}, "permissions.send has 7"),
        ({"send": ["x" * 300]}, "a pattern is a string of 1 to 256"),
        ({"send": ["multicst:chat"]}, "permissions.send pattern 'multicst:chat'"),
        ({"request": {"deny": ["login"]}}, "permissions.request.deny pattern 'login'"),
        ({"join": ["login:1"]}, "only multicast and anycast addresses are groups"),
        ({"register": ["login:1"]}, "register takes server names"),
        ({"register": ["multicast"]}, "permissions.register pattern 'multicast'"),
        ({"streams": ["x"]}, "permissions.streams is a table"),
        ({"streams": {"raed": ["x"]}}, "unknown key permissions.streams.raed"),
        ({"streams": {"read": ["a\x00"]}}, "permissions.streams.read pattern"),
        ({"operator": ["stats"]}, "permissions.operator pattern 'stats': it matches none"),
    ],
)
def test_a_bad_table_names_the_user_and_what_is_wrong(
    table: Mapping[str, object], words: str
) -> None:
    with pytest.raises(BadPermissions) as caught:
        Permissions.from_table(table, "game")
    assert str(caught.value).startswith("user 'game': ")
    assert words in str(caught.value)
    assert isinstance(caught.value, InvalidArgument)


def test_a_table_that_is_not_a_table() -> None:
    with pytest.raises(BadPermissions, match="user 'game': permissions is a table"):
        Permissions.from_table(["send"], "game")  # type: ignore[arg-type]


def test_a_rule_without_patterns_permits_nothing() -> None:
    assert not Rule().permits("anything")
    assert Rule(["a*"], ["ab"]).permits("ac")
    assert not Rule(["a*"], ["ab"]).permits("ab")


def test_the_broadcast_group_is_open_to_every_service() -> None:
    nobody = permissions()
    assert nobody.may_join(BROADCAST_GROUP.to_bytes()), "every client service joins it"
    assert not nobody.may_send(BROADCAST_GROUP.to_bytes()), "sending to it is send's"
