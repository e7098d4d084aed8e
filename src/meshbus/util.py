"""Small helpers shared by the library and the CLI."""

from __future__ import annotations


def parse_hostport(text: str, *, default_port: int | None = None) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` for IPv6); ValueError names what is wrong."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        if default_port is None:
            raise ValueError(f"{text!r} is not HOST:PORT")
        host, port_text = text, str(default_port)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError(f"{text!r} has no host; expected HOST:PORT, e.g. 127.0.0.1:7400")
    try:
        port = int(port_text, 10)
    except ValueError:
        raise ValueError(f"{text!r}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{text!r}: port {port} is out of range 0..65535")
    return host, port
