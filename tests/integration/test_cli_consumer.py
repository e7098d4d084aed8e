"""``meshbus stream consumer``, run as real subprocesses against real brokers: a consumer's
whole life from the shell, a redelivery, another user's consumer, and clean errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import meshbus
from meshbus.auth import Credentials
from tests.conftest import BrokerProcess, start_broker
from tests.integration.helpers import user_with
from tests.integration.test_cli_stream import stream_cli


async def _publish(address: str, *payloads: bytes, creds: Path | None = None) -> None:
    async with await meshbus.connect(address, server="pub", credentials=creds) as conn:
        publisher = await conn.register()
        for payload in payloads:
            await publisher.send_reliable("multicast:jobs", payload)


async def test_add_next_ack_list_info_delete(broker: BrokerProcess) -> None:
    at = ("--broker", broker.address)
    assert (await stream_cli("add", "jobs", "--capture", "multicast:jobs", *at)).code == 0
    await _publish(broker.address, b"one", b"two [bold]x[/]", b"three")

    added = await stream_cli("consumer", "add", "jobs", "w1", "--max-deliver", "3", "--json", *at)
    assert added.code == 0, added.err
    assert json.loads(added.out) == {
        "stream": "jobs",
        "name": "w1",
        "ack_wait": 30.0,
        "max_deliver": 3,
        "start_seq": 0,
        "owner": "",  # a broker without users: nobody's
        "next_seq": 1,
        "ack_floor": 0,
        "pending": 0,
        "dropped": 0,
    }
    taken = await stream_cli("consumer", "next", "jobs", "w1", "--count", "2", "--json", *at)
    assert taken.code == 0, taken.err
    rows = [json.loads(line) for line in taken.out.splitlines()]
    assert [(r["seq"], r["payload"], r["delivery"]) for r in rows] == [
        (1, "one", 1),
        (2, "two [bold]x[/]", 1),
    ]
    acked = await stream_cli("consumer", "ack", "jobs", "w1", "1", "7", *at)
    assert (acked.code, acked.out) == (0, "acked 1 of 2 (1 was not waiting for an ack)\n")

    info = await stream_cli("consumer", "info", "jobs", "w1", "--json", *at)
    state = json.loads(info.out)
    assert (state["next_seq"], state["ack_floor"], state["pending"]) == (3, 1, 1)
    table = await stream_cli("consumer", "info", "jobs", "w1", *at)
    assert re.search(r"pending\s*│\s*1 ", table.out), table.out
    assert re.search(r"max deliver\s*│\s*3 ", table.out), table.out

    # --ack: taken and acknowledged, so nothing is pending after it but seq 2.
    rest = await stream_cli("consumer", "next", "jobs", "w1", "--count", "5", "--ack", *at)
    assert rest.code == 0, rest.err
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
    assert re.fullmatch(rf"#3 {stamp} \[pub:\d+ -> multicast:jobs\] three", rest.out.strip())
    none = await stream_cli("consumer", "next", "jobs", "w1", *at)
    assert (none.code, none.out) == (0, "")
    assert none.err == "no message waits for consumer w1 of stream jobs\n"

    assert (await stream_cli("consumer", "add", "jobs", "w2", *at)).code == 0
    listed = await stream_cli("consumer", "list", "jobs", "--json", *at)
    assert [(c["name"], c["pending"]) for c in json.loads(listed.out)] == [("w1", 1), ("w2", 0)]
    shown = await stream_cli("consumer", "list", "jobs", *at)
    assert re.search(r"w1\s*│\s*-\s*│\s*4\s*│\s*1\s*│\s*1\s*│\s*0", shown.out), shown.out
    stream_info = await stream_cli("info", "jobs", "--json", *at)
    assert json.loads(stream_info.out)["consumers"] == ["w1", "w2"]

    refused = await stream_cli("consumer", "delete", "jobs", "w1", *at)
    assert refused.code == 1
    assert refused.err.strip().endswith("[y/N]: Aborted!")
    deleted = await stream_cli("consumer", "delete", "jobs", "w1", "--yes", *at)
    assert (deleted.code, deleted.out) == (0, "deleted consumer w1 of stream jobs\n")
    gone = await stream_cli("consumer", "info", "jobs", "w1", *at)
    assert gone.code == 1
    assert gone.err.startswith("Error: no consumer named 'w1' on stream 'jobs'")


async def test_a_message_not_acked_comes_again(broker: BrokerProcess) -> None:
    at = ("--broker", broker.address)
    assert (await stream_cli("add", "jobs", "--capture", "multicast:jobs", *at)).code == 0
    await _publish(broker.address, b"retry me")
    added = await stream_cli("consumer", "add", "jobs", "w", "--ack-wait", "0.2", *at)
    assert added.code == 0, added.err
    first = await stream_cli("consumer", "next", "jobs", "w", "--json", *at)
    assert json.loads(first.out)["delivery"] == 1
    # Waits (polling) until the ack wait runs out and the message is due again.
    again = await stream_cli("consumer", "next", "jobs", "w", "--wait", "20", *at)
    assert again.code == 0, again.err
    assert re.match(r"#1 \S+ \(delivery 2\) \[pub:\d+ -> multicast:jobs\] retry me", again.out)


async def test_another_users_consumer_is_listed_by_name_only(tmp_path: Path) -> None:
    users = {name: Credentials.generate(name) for name in ("alice", "bob")}
    rights = 'streams = { add = ["*"], read = ["*"], consume = ["*"] }\njoin = ["*"]'
    config = tmp_path / "broker.toml"
    config.write_text("".join(user_with(who, rights) for who in users.values()))
    creds = {}
    for name, who in users.items():
        creds[name] = tmp_path / f"{name}.creds"
        who.write(creds[name])
    broker = await start_broker("--config", str(config))
    try:

        def as_user(name: str) -> tuple[str, ...]:
            return ("--broker", broker.address, "--creds", str(creds[name]))

        added = await stream_cli("add", "jobs", "--capture", "multicast:jobs", *as_user("alice"))
        assert added.code == 0, added.err
        made = await stream_cli("consumer", "add", "jobs", "mine", "--json", *as_user("alice"))
        assert json.loads(made.out)["owner"] == "alice"
        listed = await stream_cli("consumer", "list", "jobs", "--json", *as_user("bob"))
        assert listed.code == 0, listed.err
        (entry,) = json.loads(listed.out)
        assert (entry["name"], set(entry)) == ("mine", {"stream", "name", "error"})
        table = await stream_cli("consumer", "list", "jobs", *as_user("bob"))
        assert re.search(r"mine\s*│\s*another user's", table.out), table.out
        taken = await stream_cli("consumer", "next", "jobs", "mine", *as_user("bob"))
        assert taken.code == 1
        assert "permission denied: user 'bob' may not next consumer 'mine'" in taken.err
    finally:
        assert await broker.stop() == 0


async def test_errors_are_one_line_and_help_explains_each_command(broker: BrokerProcess) -> None:
    at = ("--broker", broker.address)
    cases = [
        (("consumer", "info", "nope", "w", *at), 1, "Error: no stream named 'nope'"),
        (("consumer", "add", "nope", "w", *at), 1, "Error: no stream named 'nope'"),
        (("consumer", "ack", "s", "w", "0", *at), 2, "Error: Invalid value for 'SEQS...': 0"),
        (("consumer", "ack", "s", "w", *at), 2, "Error: Missing argument 'SEQS...'"),
        (("consumer", "add", "s", "bad name", *at), 2, "Error: Invalid value for 'NAME'"),
        (("consumer", "add", "s", "w", "--ack-wait", "0", *at), 2, "Error: Invalid value"),
    ]
    for args, code, message in cases:
        result = await stream_cli(*args)
        assert result.code == code, (args, result)
        assert result.err.strip().splitlines()[-1].startswith(message), (args, result.err)
        assert result.out == "", (args, result.out)
    group = await stream_cli("consumer", "--help")
    for command in ("add", "ack", "delete", "info", "list", "next"):
        assert re.search(rf"^\s+{command}\s+\S", group.out, re.MULTILINE), group.out
    assert "consumer" in (await stream_cli("--help")).out
    taking = await stream_cli("consumer", "next", "--help")
    for option in ("--count", "--wait", "--ack", "--json"):
        assert option in taking.out
