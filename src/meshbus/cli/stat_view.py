"""How ``meshbus stat`` shows a broker's answer: Rich tables built from the plain dict
``conn.stat()`` returns.

Apart from the command (``cli_admin``) because it is presentation only -- no click, no
connection -- and a page of its own: one table per part of the answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import RenderableType


def stat_renderables(data: dict[str, Any]) -> list[RenderableType]:
    """Rich tables for a ``conn.stat()`` answer, in the order they are printed."""
    from rich.table import Table

    state = "draining" if data.get("draining") else "ready" if data.get("ready") else "joining"
    title = (
        f"broker [bold]{data.get('name', '?')}[/] on {data.get('address', '?')}, {state}, "
        f"up {data.get('uptime_s', 0)} s: {data.get('connectors', 0)} connectors "
        f"(capacity {data.get('capacity', '?')}), {data.get('services', 0)} services, "
        f"{data.get('routes', 0)} routes"
    )
    mesh = Table(title="mesh", title_justify="left")
    for column in ("broker", "address", "slot", "connectors", "capacity", "state"):
        mesh.add_column(column, justify="right" if column in ("connectors", "capacity") else "left")
    for b in data.get("mesh", []):
        mesh.add_row(
            b.get("name", "") + (" (this)" if b.get("name") == data.get("name") else ""),
            b.get("address", ""),
            str(b.get("slot", "")),
            str(b.get("connectors", "")),
            str(b.get("capacity", "")),
            "draining" if b.get("draining") else "ready" if b.get("ready") else "joining",
        )
    # Whether a process must prove it is one of the mesh's brokers to link (docs/security.md).
    trust = "only its [[brokers]]" if data.get("mesh_trust") else "any broker (no proof)"
    peers = Table(title=f"broker links: this broker links to {trust}", title_justify="left")
    for column in ("peer", "address", "our id for it", "its id for us", "dialled by"):
        peers.add_column(column)
    peers.add_column("msgs in/out", justify="right")
    for p in data.get("peer_links", []):
        peers.add_row(
            p.get("name", ""),
            p.get("address", ""),
            str(p.get("tag_in", "")),
            str(p.get("tag_out", "")),
            data.get("name", "?") if p.get("dialled") else p.get("name", ""),
            f"{p.get('msgs_in', '?')}/{p.get('msgs_out', '?')}",
        )
    links = Table(title="connector links", title_justify="left")
    for column in ("id", "name", "user", "peer", "state"):
        links.add_column(column, overflow="fold")
    links.add_column("services", no_wrap=True)
    links.add_column("msgs in/out", justify="right")
    links.add_column("bytes in/out", justify="right")
    for link in data.get("links", []):
        services = link.get("services", [])
        links.add_row(
            str(link.get("id", "")),
            str(link.get("name", "")),
            link.get("user") or "-",
            str(link.get("peer", "")),
            str(link.get("state", "")),
            "\n".join(services) or "-" if isinstance(services, list) else str(services),
            f"{link.get('msgs_in', '?')}/{link.get('msgs_out', '?')}",
            f"{link.get('bytes_in', '?')}/{link.get('bytes_out', '?')}",
        )
    renderables: list[RenderableType] = [title, mesh, peers, links]
    users: dict[str, dict[str, dict[str, Any]]] = data.get("users") or {}
    if users:
        # What each user holds on this broker, out of its quota ([users.quotas]).
        quotas = Table(title="users: used / quota", title_justify="left")
        keys = list(next(iter(users.values())))
        quotas.add_column("user", overflow="fold")
        for key in keys:
            quotas.add_column(key, justify="right")
        for user, figures in sorted(users.items()):
            quotas.add_row(
                user,
                *(
                    f"{figures[key]['used']} / "
                    f"{'-' if figures[key]['quota'] is None else figures[key]['quota']}"
                    for key in keys
                ),
            )
        renderables.append(quotas)
    if "groups" in data:
        groups = Table(title="groups", title_justify="left")
        groups.add_column("group")
        groups.add_column("members", justify="right")
        groups.add_column("member addresses")
        for group, members in sorted(data["groups"].items()):
            groups.add_row(group, str(len(members)), ", ".join(members))
        renderables.append(groups)
    counters = Table(title="counters", title_justify="left")
    counters.add_column("counter")
    counters.add_column("value", justify="right")
    for name, value in {**data.get("counters", {}), **data.get("mesh_counters", {})}.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in sorted(value.items())) or "-"
        counters.add_row(name, str(value))
    renderables.append(counters)
    return renderables
