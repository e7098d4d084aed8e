"""The JSON of the NATS client protocol's handshake: a client's CONNECT
(``read_connect``), the server's INFO (``encode_info``), as typed msgspec structs.

Apart from the parser (meshbus.protocol.nats) because that one is compiled by mypyc
(meshbus.compiled) and msgspec's structs are classes mypyc does not compile: they stay
here, in a module the interpreter runs, read once a connection and not per message.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "MAX_CLIENT_PROTOCOL",
    "ConnectCredentials",
    "ConnectOptions",
    "ServerInfo",
    "encode_info",
    "read_connect",
]

# The protocol version of CONNECT's "protocol": 0 (the original), 1 (async INFO).
MAX_CLIENT_PROTOCOL = 1


class ConnectOptions(msgspec.Struct, frozen=True):
    """The options of a client's CONNECT that the server acts on (its credentials are
    ``ConnectCredentials``; the others -- tls_required, ... -- are read past). The
    defaults are nats-server's before any CONNECT: a client that never sends one
    (telnet) gets +OK for each operation."""

    verbose: bool = True
    pedantic: bool = True
    echo: bool = True
    headers: bool = False
    no_responders: bool = False
    protocol: int = 0
    name: str = ""
    lang: str = ""
    version: str = ""


class ConnectCredentials(msgspec.Struct, frozen=True):
    """The credentials one CONNECT carries (empty: not given): ``user`` and ``password``
    (``pass`` on the wire), ``auth_token``, or an nkey (``nkey``, the user's public key)
    with ``sig``, its signature of the INFO's nonce; ``jwt`` is read, never accepted.
    Each is at most a control line long."""

    user: str = ""
    password: str = msgspec.field(default="", name="pass")
    auth_token: str = ""
    nkey: str = ""
    sig: str = ""
    jwt: str = ""


class _ConnectFields(msgspec.Struct):
    """What one CONNECT says: only the fields it names replace the options in force;
    the credentials are its own."""

    verbose: bool | msgspec.UnsetType = msgspec.UNSET
    pedantic: bool | msgspec.UnsetType = msgspec.UNSET
    echo: bool | msgspec.UnsetType = msgspec.UNSET
    headers: bool | msgspec.UnsetType = msgspec.UNSET
    no_responders: bool | msgspec.UnsetType = msgspec.UNSET
    protocol: int | msgspec.UnsetType = msgspec.UNSET
    name: str | msgspec.UnsetType = msgspec.UNSET
    lang: str | msgspec.UnsetType = msgspec.UNSET
    version: str | msgspec.UnsetType = msgspec.UNSET
    user: str = ""
    password: str = msgspec.field(default="", name="pass")
    auth_token: str = ""
    nkey: str = ""
    sig: str = ""
    jwt: str = ""


_OPTION_FIELDS = ConnectOptions.__struct_fields__
_CONNECT_DECODER = msgspec.json.Decoder(_ConnectFields)


def read_connect(text: bytes, options: ConnectOptions) -> tuple[ConnectOptions, ConnectCredentials]:
    """A CONNECT's JSON: the fields it names laid over ``options``, and its
    credentials. ``msgspec.DecodeError`` when it is no JSON object or a known field has
    the wrong type."""
    given = _CONNECT_DECODER.decode(text)
    changes = {
        name: value
        for name in _OPTION_FIELDS
        if (value := getattr(given, name)) is not msgspec.UNSET
    }
    credentials = ConnectCredentials(
        user=given.user,
        password=given.password,
        auth_token=given.auth_token,
        nkey=given.nkey,
        sig=given.sig,
        jwt=given.jwt,
    )
    return msgspec.structs.replace(options, **changes), credentials


class ServerInfo(msgspec.Struct):
    """The INFO a server sends first (and again, as an async INFO, when what it says
    changes): the fields clients read (nats.go, nats.py, ...). ``version`` is the
    nats-server version whose client protocol the server speaks; ``go`` is where
    nats-server names the runtime it was built with (its Go version), here the
    server's own -- clients only show it, but nats-core refuses an INFO without it,
    as without ``host`` and ``port``. The optional fields
    are left out when unset or false, as nats-server leaves them out:
    ``connect_urls`` (the other servers a client may reconnect to), ``auth_required``
    (CONNECT must carry credentials), ``tls_required`` (the client starts TLS right
    after this INFO), ``tls_verify`` (and shows a certificate), ``nonce`` (what an
    nkey signs), ``ldm`` (lame duck mode: the server is going away, reconnect
    elsewhere)."""

    server_id: str
    server_name: str
    version: str
    go: str
    host: str
    port: int
    max_payload: int
    client_id: int
    client_ip: str
    proto: int = MAX_CLIENT_PROTOCOL
    headers: bool = True
    connect_urls: list[str] | msgspec.UnsetType = msgspec.UNSET
    auth_required: bool | msgspec.UnsetType = msgspec.UNSET
    tls_required: bool | msgspec.UnsetType = msgspec.UNSET
    tls_verify: bool | msgspec.UnsetType = msgspec.UNSET
    nonce: str | msgspec.UnsetType = msgspec.UNSET
    ldm: bool | msgspec.UnsetType = msgspec.UNSET


_INFO_ENCODER = msgspec.json.Encoder()


def encode_info(info: ServerInfo) -> bytes:
    return b"INFO " + _INFO_ENCODER.encode(info) + b"\r\n"
