"""How ``meshbus stat`` shows a broker's answer: Rich tables built from the plain dict
``conn.stat()`` returns.

Apart from the command (``cli_admin``) because it is presentation only -- no click, no
connection -- and a page of its own: one table per part of the answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshbus.cli.common import plain_row

if TYPE_CHECKING:
    from rich.console import RenderableType

# Every text of an answer is the broker's data, and rich reads markup in what it prints:
# each one goes through escape (or plain_row), so a name like [[brokers]] stays as it is.


def stat_renderables(data: dict[str, Any], *, brief: bool = False) -> list[RenderableType]:
    """What ``meshbus stat`` prints for a ``conn.stat()`` answer, in order: the full view
    (a table per part), or ``brief``: the headline, the mesh and a few totals."""
    from rich.markup import escape
    from rich.text import Text

    headline = Text(_headline(data))  # a Text is never read as markup
    name = str(data.get("name", "?"))
    headline.stylize("bold", len("broker "), len("broker ") + len(name))
    renderables: list[RenderableType] = [headline, _mesh_table(data)]
    nats: dict[str, Any] = data.get("nats") or {}
    if brief:
        renderables.append(escape(_totals(data)))
        if nats.get("listen"):
            renderables.append(escape(_nats_line(nats)))
        return renderables
    renderables += [
        _peers_table(data),
        _links_table(data, "connector"),
        _links_table(data, "operator"),
    ]
    if nats.get("listen"):
        renderables += [escape(_nats_line(nats)), _nats_table(nats)]
    users: dict[str, dict[str, dict[str, Any]]] = data.get("users") or {}
    if users:
        renderables.append(_quotas_table(users))
    if "groups" in data:
        renderables.append(_groups_table(data["groups"]))
    renderables.append(_counters_table(data))
    return renderables


def _state(entry: dict[str, Any]) -> str:
    return "draining" if entry.get("draining") else "ready" if entry.get("ready") else "joining"


def _operator_links(data: dict[str, Any]) -> int:
    return sum(1 for link in data.get("links", []) if link.get("role") == "operator")


def _headline(data: dict[str, Any]) -> str:
    """This broker in one line. Its connector count leaves out the operators' links (this
    command's among them): they take no connector's place, and the line says so."""
    operators = _operator_links(data)
    return (
        f"broker {data.get('name', '?')!s} on {data.get('address', '?')}, {_state(data)}, "
        f"up {data.get('uptime_s', 0)} s: {data.get('connectors', 0)} connectors "
        f"(capacity {data.get('capacity', '?')}) and {operators} operator "
        f"link{'' if operators == 1 else 's'} (this command's among them), "
        f"{data.get('services', 0)} services, {data.get('routes', 0)} routes"
    )


def _trust(data: dict[str, Any]) -> str:
    """Whether a process must prove it is one of the mesh's brokers to link
    (docs/security.md)."""
    return "only its [[brokers]]" if data.get("mesh_trust") else "any broker (no proof)"


def _totals(data: dict[str, Any]) -> str:
    """The brief view's last lines: the peers, and the traffic counters summed up."""
    counters: dict[str, Any] = data.get("counters", {})
    dropped = sum(v for k, v in counters.items() if k.startswith("dropped_") and isinstance(v, int))
    peers = ", ".join(data.get("peers", [])) or "none"
    return (
        f"broker links: {peers}; this broker links to {_trust(data)}\n"
        f"messages: {counters.get('msgs_in', '?')} in, {counters.get('msgs_out', '?')} out, "
        f"{dropped} dropped; requests: {counters.get('requests', '?')}, "
        f"{counters.get('timeouts', '?')} timed out, {counters.get('pending', '?')} pending"
    )


def _nats_line(nats: dict[str, Any]) -> str:
    """The NATS listener in two lines: its clients, their traffic, what went wrong
    (docs/nats.md, "What stat and /metrics show")."""
    errors = ", ".join(f"{k} {v}" for k, v in sorted(nats.get("errors", {}).items()) if v)
    state = " (lame duck mode)" if nats.get("lame_duck") else ""
    return (
        f"NATS clients on {nats.get('listen', '?')}{state}: {nats.get('clients', '?')} "
        f"connected, {nats.get('subscriptions', '?')} subscriptions; messages "
        f"{nats.get('msgs_in', '?')} in, {nats.get('msgs_out', '?')} out; bytes "
        f"{nats.get('bytes_in', '?')} in, {nats.get('bytes_out', '?')} out; "
        f"{nats.get('slow_consumers', '?')} slow consumers\n"
        f"NATS errors: {errors or 'none'}; connect_urls: "
        f"{', '.join(nats.get('connect_urls', [])) or 'none'}"
    )


def _nats_table(nats: dict[str, Any]) -> RenderableType:
    from rich.table import Table

    conns = nats.get("connections", [])
    table = Table(title=f"NATS clients: {len(conns)}", title_justify="left")
    for column in ("id", "name", "lang", "user"):
        table.add_column(column, overflow="fold")
    table.add_column("remote", no_wrap=True)
    for column in ("subs", "msgs in/out", "bytes in/out", "unsent bytes"):
        table.add_column(column, justify="right")
    for conn in conns:
        plain_row(
            table,
            conn.get("id", ""),
            conn.get("name") or "-",
            conn.get("lang") or "-",
            conn.get("user") or "-",
            conn.get("remote", ""),
            conn.get("subscriptions", "?"),
            f"{conn.get('msgs_in', '?')}/{conn.get('msgs_out', '?')}",
            f"{conn.get('bytes_in', '?')}/{conn.get('bytes_out', '?')}",
            conn.get("pending_bytes", "?"),
        )
    return table


def _mesh_table(data: dict[str, Any]) -> RenderableType:
    from rich.table import Table

    mesh = Table(title="mesh", title_justify="left")
    for column in ("broker", "address", "nats", "slot", "connectors", "capacity", "state"):
        mesh.add_column(column, justify="right" if column in ("connectors", "capacity") else "left")
    for b in data.get("mesh", []):
        plain_row(
            mesh,
            b.get("name", "") + (" (this)" if b.get("name") == data.get("name") else ""),
            b.get("address", ""),
            b.get("nats") or "-",
            b.get("slot", ""),
            b.get("connectors", ""),
            b.get("capacity", ""),
            _state(b),
        )
    return mesh


def _peers_table(data: dict[str, Any]) -> RenderableType:
    from rich.markup import escape
    from rich.table import Table

    title = escape(f"broker links: this broker links to {_trust(data)}")
    peers = Table(title=title, title_justify="left")
    for column in ("peer", "address", "our id for it", "its id for us", "dialled by"):
        peers.add_column(column)
    peers.add_column("msgs in/out", justify="right")
    for p in data.get("peer_links", []):
        plain_row(
            peers,
            p.get("name", ""),
            p.get("address", ""),
            p.get("tag_in", ""),
            p.get("tag_out", ""),
            data.get("name", "?") if p.get("dialled") else p.get("name", ""),
            f"{p.get('msgs_in', '?')}/{p.get('msgs_out', '?')}",
        )
    return peers


def _links_table(data: dict[str, Any], role: str) -> RenderableType:
    """The links of ``role``: "connector" (the headline's count) or "operator" (this
    command's, and any other stat, drain or stream command's)."""
    from rich.table import Table

    shown = [link for link in data.get("links", []) if link.get("role", "connector") == role]
    title = f"{role} links: {len(shown)}"
    if role == "operator":
        title += " (this command's among them; not counted as connectors)"
    links = Table(title=title, title_justify="left")
    for column in ("id", "name", "user"):
        links.add_column(column, overflow="fold")
    links.add_column("peer", no_wrap=True)
    links.add_column("state")
    links.add_column("services", no_wrap=True)
    links.add_column("msgs in/out", justify="right")
    links.add_column("bytes in/out", justify="right")
    for link in shown:
        services = link.get("services", [])
        plain_row(
            links,
            link.get("id", ""),
            link.get("name", ""),
            link.get("user") or "-",
            link.get("peer", ""),
            link.get("state", ""),
            "\n".join(services) or "-" if isinstance(services, list) else services,
            f"{link.get('msgs_in', '?')}/{link.get('msgs_out', '?')}",
            f"{link.get('bytes_in', '?')}/{link.get('bytes_out', '?')}",
        )
    return links


def _quotas_table(users: dict[str, dict[str, dict[str, Any]]]) -> RenderableType:
    """What each user holds on this broker, out of its quota ([users.quotas])."""
    from rich.table import Table

    quotas = Table(title="users: used / quota", title_justify="left")
    keys = list(next(iter(users.values())))
    quotas.add_column("user", overflow="fold")
    for key in keys:
        quotas.add_column(key, justify="right")
    for user, figures in sorted(users.items()):
        plain_row(
            quotas,
            user,
            *(
                f"{figures[key]['used']} / "
                f"{'-' if figures[key]['quota'] is None else figures[key]['quota']}"
                for key in keys
            ),
        )
    return quotas


def _groups_table(groups: dict[str, list[str]]) -> RenderableType:
    from rich.table import Table

    table = Table(title="groups", title_justify="left")
    table.add_column("group")
    table.add_column("members", justify="right")
    table.add_column("member addresses")
    for group, members in sorted(groups.items()):
        plain_row(table, group, len(members), ", ".join(members))
    return table


def _counters_table(data: dict[str, Any]) -> RenderableType:
    from rich.table import Table

    counters = Table(title="counters", title_justify="left")
    counters.add_column("counter")
    counters.add_column("value", justify="right")
    for name, value in {**data.get("counters", {}), **data.get("mesh_counters", {})}.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in sorted(value.items())) or "-"
        plain_row(counters, name, value)
    return counters
