"""``meshbus keygen`` and ``hash-token``: the entries they print with --allow, read back
by the broker's own reader of config files, the credentials file hash-token writes, and
the errors of a bad --allow (nothing written then)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from meshbus.auth import Credentials
from meshbus.broker.config_file import config_from_text
from meshbus.cli.auth import hash_token, keygen


def test_keygen_allow_grants_exactly_what_it_names(tmp_path: Path) -> None:
    creds = tmp_path / "carol.creds"
    result = CliRunner().invoke(
        keygen,
        ["--user", "carol", "--out", str(creds), "--allow", "send=game*:*,request=anycast:login",
         "--allow", "streams.read=scores.*", "--allow", "send=multicast:chat.*"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    entry = result.stdout
    permissions = tomllib.loads(entry)["users"][0]["permissions"]
    assert permissions == {
        "register": [],
        "send": ["game*:*", "multicast:chat.*"],
        "request": ["anycast:login"],
        "join": [],
        "streams": {"add": [], "delete": [], "read": ["scores.*"], "consume": []},
        "operator": [],
    }
    (user,) = config_from_text(entry, "pasted").tables.users
    assert user.permissions is not None
    assert user.permissions.send.allow == ("game*:*", "multicast:chat.*")
    assert (creds.stat().st_mode & 0o777) == 0o600


@pytest.mark.parametrize(
    ("allow", "message"),
    [
        ("sned=x", "unknown permission 'sned' (did you mean 'send'?)"),
        ("send", "'send' is not PERMISSION=PATTERN"),
        ("request=login", "permissions.request pattern 'login': address 'login' has no ':'"),
        ("operator=stats", "permissions.operator pattern 'stats': it matches none of the rights"),
        ("join=game01:1", "permissions.join pattern 'game01:1': only multicast and anycast"),
    ],
)
def test_a_bad_allow_is_refused_and_nothing_is_written(
    tmp_path: Path, allow: str, message: str
) -> None:
    creds = tmp_path / "carol.creds"
    for command, args, stdin in (
        (keygen, ["--user", "carol", "--out", str(creds)], None),
        (hash_token, ["--user", "carol", "--out", str(creds)], "a-token\n"),
    ):
        result = CliRunner().invoke(command, [*args, "--allow", allow], input=stdin)
        assert result.exit_code == 2, result.output
        assert "Invalid value for '--allow'" in result.stderr
        assert message in result.stderr
        assert not creds.exists()


def test_allow_all_and_allow_exclude_each_other(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        keygen, ["--user", "c", "--out", str(tmp_path / "c"), "--allow-all", "--allow", "send=*"]
    )
    assert result.exit_code == 2
    assert "--allow-all and --allow exclude each other" in result.stderr


def test_hash_token_writes_the_credentials_file_of_the_user(tmp_path: Path) -> None:
    creds = tmp_path / "dan.creds"
    result = CliRunner().invoke(
        hash_token, ["--user", "dan", "--out", str(creds)], input="dans-token\n"
    )
    assert result.exit_code == 0, result.output
    assert f"wrote the token of user 'dan' to {creds}" in result.stderr
    assert (creds.stat().st_mode & 0o777) == 0o600
    loaded = Credentials.load(creds)
    (user,) = config_from_text(result.stdout, "pasted").tables.users
    assert (loaded.user, user.name) == ("dan", "dan")
    assert loaded.file_text() == Credentials("dan", token="dans-token").file_text()
    again = CliRunner().invoke(
        hash_token, ["--user", "dan", "--out", str(creds), "--generate"], input=""
    )
    assert again.exit_code == 1
    assert "already exists; a credentials file is never overwritten" in again.stderr
