"""What ``meshbus stat`` prints, from a stat answer: data shown as it is (never read as
rich markup), a headline that agrees with the tables, and a brief view that is brief."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from meshbus.cli.stat_view import stat_renderables


def _answer(connectors: int = 1) -> dict[str, Any]:
    link = {
        "peer": "127.0.0.1:50000",
        "state": "open",
        "services": ["game01:5"],
        "msgs_in": 3,
        "msgs_out": 4,
        "bytes_in": 10,
        "bytes_out": 20,
    }
    links = [
        {**link, "id": i, "name": f"game{i}", "role": "connector", "user": "[red]eve[/]"}
        for i in range(connectors)
    ]
    links.append({**link, "id": 99, "name": "cli", "role": "operator", "user": None})
    return {
        "name": "b[bold]1",
        "address": "127.0.0.1:7400",
        "ready": True,
        "uptime_s": 2.0,
        "connectors": connectors,
        "capacity": 50,
        "services": connectors,
        "routes": connectors,
        "mesh_trust": True,
        "peers": ["b2"],
        "mesh": [{"name": "b[bold]1", "address": "127.0.0.1:7400", "slot": 1, "ready": True}],
        "peer_links": [{"name": "b2", "address": "127.0.0.1:7401", "dialled": True}],
        "links": links,
        "users": {"[i]ops": {"connectors": {"used": 1, "quota": None}}},
        "groups": {"multicast:[chat]": ["game01:5"]},
        "counters": {f"dropped_{i}": 1 for i in range(20)}
        | {"msgs_in": 7, "msgs_out": 8, "requests": 2, "timeouts": 1, "pending": 0},
        "mesh_counters": {"stalls": 0},
    }


def _printed(data: dict[str, Any], *, brief: bool = False) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    for renderable in stat_renderables(data, brief=brief):
        console.print(renderable)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines())


def test_text_from_the_broker_is_shown_as_it_is_never_as_markup() -> None:
    text = _printed(_answer())
    for shown in (
        "broker b[bold]1 on",
        "b[bold]1 (this)",
        "[red]eve[/]",
        "[i]ops",
        "multicast:[chat]",
        "this broker links to only its [[brokers]]",
    ):
        assert shown in text, shown
    assert "this broker links to only its [[brokers]]" in _printed(_answer(), brief=True)


def test_the_headline_counts_what_the_tables_list() -> None:
    text = _printed(_answer(connectors=2))
    assert "2 connectors (capacity 50) and 1 operator link" in text
    assert "\nconnector links: 2\n" in text
    assert "operator links: 1 (this command's among them" in text


def test_brief_is_a_few_lines_whatever_the_broker_holds() -> None:
    big = _answer(connectors=200)
    brief = _printed(big, brief=True).splitlines()
    assert len(brief) <= 12, brief
    assert len(brief) * 10 < len(_printed(big).splitlines())
    assert brief[-1] == "messages: 7 in, 8 out, 20 dropped; requests: 2, 1 timed out, 0 pending"


def _with_nats() -> dict[str, Any]:
    data = _answer()
    data["mesh"][0]["nats"] = "127.0.0.1:4222"
    data["nats"] = {
        "listen": "127.0.0.1:4222",
        "connect_urls": ["127.0.0.1:4222", "127.0.0.1:4223"],
        "lame_duck": False,
        "clients": 1,
        "subscriptions": 2,
        "msgs_in": 3,
        "bytes_in": 30,
        "msgs_out": 4,
        "bytes_out": 40,
        "slow_consumers": 1,
        "errors": {"slow-consumer": 1, "invalid-subject": 2, "stale-connection": 0},
        "connections": [
            {
                "id": 7,
                "remote": "127.0.0.1:5000",
                "name": "[b]orders",
                "lang": "python3",
                "user": None,
                "subscriptions": 2,
                "msgs_in": 3,
                "bytes_in": 30,
                "msgs_out": 4,
                "bytes_out": 40,
                "pending_bytes": 0,
            },
        ],
    }
    return data


def test_the_nats_listener_its_clients_and_errors() -> None:
    nats_line = (
        "NATS clients on 127.0.0.1:4222: 1 connected, 2 subscriptions; messages 3 in, 4 out; "
        "bytes 30 in, 40 out; 1 slow consumers\n"
        "NATS errors: invalid-subject 2, slow-consumer 1; connect_urls: 127.0.0.1:4222, "
        "127.0.0.1:4223"
    )
    brief = _printed(_with_nats(), brief=True)
    assert brief.endswith(nats_line)
    full = _printed(_with_nats())
    assert nats_line in full
    assert "NATS clients: 1" in full
    assert "[b]orders" in full  # a client's name shown as it is
    mesh_row = next(line for line in full.splitlines() if "(this)" in line)
    assert "127.0.0.1:4222" in mesh_row  # its nats column
    # A broker without --nats-listen says nothing of it.
    assert "NATS" not in _printed(_answer()) + _printed(_answer(), brief=True)
