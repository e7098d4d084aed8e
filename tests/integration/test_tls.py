"""TLS on every link: connectors, operators (the CLI) and broker-to-broker links.

Certificates are made for each test by trustme, in ``tmp_path``: a CA, a broker
certificate for 127.0.0.1 and localhost, and, where a test needs them, a second CA
nobody trusts, a certificate for another name, an expired one, a client's.
"""

from __future__ import annotations

import asyncio
import datetime
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

import meshbus
from meshbus.private_files import write_private
from meshbus.protocol import ControlFrame, ControlType, encode_control
from meshbus.protocol.control import ROLE_BROKER, Error, Hello
from meshbus.protocol.layout import ErrorCode
from meshbus.tls import TLSOption
from tests.conftest import BrokerProcess, start_broker, start_mesh, stop_all
from tests.integration.helpers import (
    IO_TIMEOUT,
    RawLink,
    broker_key,
    launch_broker,
    recv_n,
    start_broker_process,
)

_LOOPBACK = ("127.0.0.1", "localhost")


@dataclass
class Pem:
    """One certificate and its key, as files."""

    cert: Path
    key: Path

    def broker_args(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key)]


def _write(cert: trustme.LeafCert, directory: Path, name: str) -> Pem:
    pem = Pem(directory / f"{name}.crt", directory / f"{name}.key")
    for blob in cert.cert_chain_pems:
        blob.write_to_path(str(pem.cert), append=True)
    write_private(pem.key, cert.private_key_pem.bytes())
    return pem


@dataclass
class Certs:
    directory: Path
    ca: trustme.CA
    ca_file: Path
    broker: Pem

    def issue(self, name: str, *identities: str, **options: datetime.datetime) -> Pem:
        return _write(self.ca.issue_cert(*identities, **options), self.directory, name)

    def client_context(self) -> ssl.SSLContext:
        """A client's context with a certificate from the CA (for mutual TLS)."""
        client = self.issue("client", "client.example")
        context = ssl.create_default_context(cafile=str(self.ca_file))
        context.load_cert_chain(str(client.cert), str(client.key))
        return context


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    return Certs(tmp_path, ca, ca_file, _write(ca.issue_cert(*_LOOPBACK), tmp_path, "broker"))


async def _roundtrip(address: str, tls: TLSOption) -> None:
    """A send and a request between two services of one connector, over ``tls``."""
    async with await meshbus.connect(address, server="tls", tls=tls) as conn:
        first, second = await conn.register(), await conn.register()
        await first.send(second.address, b"over tls")
        assert [m.payload for m in await recv_n(second, 1)] == [b"over tls"]


# -- it works ----------------------------------------------------------------------------


async def test_a_connector_sends_and_receives_over_tls(certs: Certs) -> None:
    broker = await start_broker(*certs.broker.broker_args())
    try:
        await _roundtrip(broker.address, str(certs.ca_file))
        await _roundtrip(broker.address, certs.ca_file)  # an os.PathLike
        await _roundtrip(broker.address, ssl.create_default_context(cafile=str(certs.ca_file)))
    finally:
        assert await broker.stop() == 0


async def test_a_tls_connector_is_closed_when_close_returns(certs: Certs) -> None:
    """A program whose loop ends right after ``close()`` (``uvloop.run``, as the CLI and
    ``meshbus report`` run) must find the TLS socket closed: uvloop refuses to close a
    loop with an open socket (EBUSY), and TLS says goodbye in frames of its own."""
    import uvloop

    broker = await start_broker(*certs.broker.broker_args())

    async def connect_and_close() -> None:
        conn = await meshbus.connect(broker.address, server="tls", tls=str(certs.ca_file))
        await conn.register()
        await conn.close()

    try:
        for _ in range(5):
            await asyncio.to_thread(uvloop.run, connect_and_close())
    finally:
        assert await broker.stop() == 0


async def test_a_mesh_all_over_mutual_tls_carries_a_message_across_brokers(
    certs: Certs,
) -> None:
    # --tls-verify-clients: each broker's dial to its peers must show its own certificate.
    args = [*certs.broker.broker_args(), "--tls-ca", str(certs.ca_file), "--tls-verify-clients"]
    brokers = await start_mesh(3, *args)
    try:
        tls = certs.client_context()
        async with (
            await meshbus.connect(brokers[0].address, server="a", tls=tls, failover=False) as a,
            await meshbus.connect(brokers[2].address, server="c", tls=tls, failover=False) as c,
        ):
            assert (a.broker_name, c.broker_name) == (brokers[0].name, brokers[2].name)
            sender, receiver = await a.register(), await c.register()
            await receiver.join(meshbus.Multicast("tls.mesh"))
            await sender.send(meshbus.Multicast("tls.mesh"), b"across")
            assert [m.payload for m in await recv_n(receiver, 1)] == [b"across"]
            stat = await c.stat()
            assert sorted(stat["peers"]) == sorted(b.name for b in brokers[:2])
    finally:
        assert await stop_all(brokers) == [0, 0, 0]


async def test_a_mesh_over_tls_whose_brokers_prove_themselves_with_keys(certs: Certs) -> None:
    """TLS and mesh trust together: each link is TLS, and each broker also proves itself
    with its key pair before its peer links to it."""
    keys = [broker_key(certs.directory, name) for name in ("a", "b")]
    config = certs.directory / "mesh.toml"
    config.write_text("".join(key.entry for key in keys))
    args = [*certs.broker.broker_args(), "--tls-ca", str(certs.ca_file), "--config", str(config)]
    first = await start_broker(*args, *keys[0].args)
    brokers = [first]
    try:
        brokers.append(await start_broker(*args, *keys[1].args, "--seed", first.address))
        tls = str(certs.ca_file)
        async with (
            await meshbus.connect(first.address, server="a", tls=tls, failover=False) as a,
            await meshbus.connect(brokers[1].address, server="b", tls=tls, failover=False) as b,
        ):
            sender, receiver = await a.register(), await b.register()
            await sender.send(receiver.address, b"tls and keys")
            assert [m.payload for m in await recv_n(receiver, 1)] == [b"tls and keys"]
            data = await b.stat()
            assert (data["peers"], data["mesh_trust"]) == (["a"], True)
    finally:
        assert await stop_all(brokers) == [0, 0]


async def test_a_peer_broker_with_another_cas_certificate_cannot_join(certs: Certs) -> None:
    """Without --tls-verify-clients too, a broker with --tls-ca takes a peer broker only
    with a certificate that CA signed: one that trusts the mesh's CA but shows its own
    CA's certificate does not join."""
    mesh_ca = ["--tls-ca", str(certs.ca_file)]
    member = await start_broker(*certs.broker.broker_args(), *mesh_ca)
    try:
        stranger = _write(trustme.CA().issue_cert(*_LOOPBACK), certs.directory, "stranger")
        intruder = await start_broker_process(
            "--listen", "127.0.0.1:0", *stranger.broker_args(), *mesh_ca,
            "--seed", member.address, "--join-timeout", "1.5",
        )  # fmt: skip
        out, err = await asyncio.wait_for(intruder.communicate(), 30)
        assert intruder.returncode == 1, (out, err)
        assert b"listening on" not in out
        assert b"could not join the mesh" in err
        async with await meshbus.connect(member.address, tls=certs.ca_file) as conn:
            assert (await conn.stat())["peers"] == []
    finally:
        assert await member.stop() == 0


async def test_a_peer_broker_hello_without_a_certificate_is_refused(certs: Certs) -> None:
    """A process that says HELLO as a broker over TLS without a client certificate is
    refused with CERTIFICATE_REQUIRED before anything of the mesh goes out."""
    member = await start_broker(*certs.broker.broker_args(), "--tls-ca", str(certs.ca_file))
    try:
        host, port = member.address.rsplit(":", 1)
        context = ssl.create_default_context(cafile=str(certs.ca_file))
        reader, writer = await asyncio.open_connection(host, int(port), ssl=context)
        raw = RawLink(reader, writer)
        await raw.send(encode_control(ControlType.HELLO, Hello(role=ROLE_BROKER, name="x"), 1))
        (refusal,) = await raw.read_until_closed()
        assert isinstance(refusal, ControlFrame)
        assert isinstance(refusal.body, Error)
        assert refusal.body.code == ErrorCode.CERTIFICATE_REQUIRED
        assert "--tls-ca" in refusal.body.message
    finally:
        assert await member.stop() == 0


async def test_a_connector_keeps_tls_through_a_redirect_and_a_failover(certs: Certs) -> None:
    # One connector each; after b's crash a takes two (--capacity-boost).
    args = [*certs.broker.broker_args(), "--tls-ca", str(certs.ca_file)]
    a, b = await start_mesh(2, *args, "--max-connectors", "1", "--capacity-boost", "2")
    try:
        async with (
            await meshbus.connect(a.address, server="first", tls=certs.ca_file) as first,
            await meshbus.connect(a.address, server="second", tls=certs.ca_file) as second,
        ):
            assert (first.broker_name, second.broker_name) == (a.name, b.name)  # redirected
            receiver, sender = await first.register(), await second.register()
            b.process.kill()
            await b.process.wait()
            await sender.send(receiver.address, b"after failover")
            assert [m.payload for m in await recv_n(receiver, 1)] == [b"after failover"]
            assert (second.failovers, second.broker_name) == (1, a.name)
    finally:
        await stop_all([a, b])


async def test_the_cli_stat_talks_to_a_tls_broker(certs: Certs) -> None:
    broker = await start_broker(*certs.broker.broker_args())
    try:
        process = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "meshbus", "stat", "--json", "--brief"],
            *["--broker", broker.address, "--tls-ca", str(certs.ca_file)],
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == 0, err.decode()
        assert f'"name": "{broker.name}"' in out.decode()
    finally:
        assert await broker.stop() == 0


# -- mutual TLS --------------------------------------------------------------------------


async def test_mutual_tls_refuses_a_client_without_a_certificate_and_takes_one_with(
    certs: Certs,
) -> None:
    broker = await start_broker(
        *certs.broker.broker_args(), "--tls-ca", str(certs.ca_file), "--tls-verify-clients"
    )
    try:
        with pytest.raises(meshbus.TLSError, match="requires a client certificate"):
            await meshbus.connect(broker.address, tls=certs.ca_file, failover=False)
        await _roundtrip(broker.address, certs.client_context())
    finally:
        assert await broker.stop() == 0


# -- what a client is told ---------------------------------------------------------------


async def _connect_error(address: str, tls: TLSOption) -> str:
    with pytest.raises(meshbus.MeshbusError) as caught:
        await meshbus.connect(address, tls=tls, failover=False, timeout=IO_TIMEOUT)
    return f"{type(caught.value).__name__}: {caught.value}"


async def test_a_broker_signed_by_an_unknown_ca_is_refused(certs: Certs) -> None:
    stranger = certs.directory / "stranger.pem"
    trustme.CA().cert_pem.write_to_path(str(stranger))
    broker = await start_broker(*certs.broker.broker_args())
    try:
        error = await _connect_error(broker.address, stranger)
        assert error.startswith("TLSError: ")
        assert "signed by a CA this client does not trust" in error
        assert "--tls-ca" in error
        # The system's CAs do not know a test CA either.
        assert "does not trust" in await _connect_error(broker.address, True)
    finally:
        assert await broker.stop() == 0


async def test_a_name_mismatch_names_the_host_dialled(certs: Certs) -> None:
    elsewhere = certs.issue("elsewhere", "broker.example")
    broker = await start_broker(*elsewhere.broker_args())
    try:
        error = await _connect_error(broker.address, certs.ca_file)
        assert error.startswith("TLSError: ")
        assert "is not valid for '127.0.0.1', the host dialled" in error
    finally:
        assert await broker.stop() == 0


async def test_an_expired_broker_certificate_is_refused(certs: Certs) -> None:
    past = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    expired = certs.issue(
        "expired", *_LOOPBACK, not_before=past - datetime.timedelta(days=30), not_after=past
    )
    broker = await start_broker(*expired.broker_args())
    try:
        error = await _connect_error(broker.address, certs.ca_file)
        assert error.startswith("TLSError: ")
        assert "has expired; the broker needs a new one" in error
    finally:
        assert await broker.stop() == 0


async def test_a_tls_client_is_told_a_plain_broker_does_not_speak_tls(
    certs: Certs, broker: BrokerProcess
) -> None:
    error = await _connect_error(broker.address, certs.ca_file)
    assert error.startswith("TLSError: ")
    assert "does not speak TLS" in error


async def test_a_plain_client_is_told_a_tls_broker_may_require_tls(certs: Certs) -> None:
    broker = await launch_broker(*certs.broker.broker_args())
    try:
        error = await _connect_error(broker.address, None)
        assert "closed the link during the handshake" in error
        assert "may require TLS" in error
    finally:
        broker.process.terminate()
        code, _, err = await broker.finish()
    assert code == 0
    # The broker logged the failed handshake as one line, and no traceback.
    failures = [line for line in err.splitlines() if "TLS handshake failed" in line]
    assert len(failures) == 1, err
    assert "does not speak TLS" in failures[0]
    assert "Traceback" not in err


# -- the handshake is bounded ------------------------------------------------------------


async def test_a_stalled_tls_handshake_is_closed_by_the_handshake_timeout(
    certs: Certs,
) -> None:
    broker = await launch_broker(
        *certs.broker.broker_args(), "--handshake-timeout", "1", "--heartbeat-interval", "0.1"
    )
    host, port = broker.address.rsplit(":", 1)
    try:
        silent = await asyncio.open_connection(host, int(port))
        half = await asyncio.open_connection(host, int(port))
        # The first bytes of a ClientHello (a handshake record of 512 bytes), then nothing.
        half[1].write(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
        loop = asyncio.get_running_loop()
        started = loop.time()
        for reader, writer in (silent, half):
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the broker
            writer.close()
        assert loop.time() - started < 5
        # The broker is none the worse for it.
        await _roundtrip(broker.address, certs.ca_file)
    finally:
        broker.process.terminate()
        code, _, err = await broker.finish()
    assert code == 0
    timeouts = [line for line in err.splitlines() if "no TLS handshake within 1 s" in line]
    assert len(timeouts) == 2, err
    assert "Traceback" not in err


async def test_tls_handshakes_in_progress_count_against_max_handshaking(certs: Certs) -> None:
    broker = await start_broker(*certs.broker.broker_args(), "--max-handshaking", "1")
    host, port = broker.address.rsplit(":", 1)
    try:
        _, stalled = await asyncio.open_connection(host, int(port))
        await asyncio.sleep(0.2)  # accepted, in its TLS handshake
        reader, writer = await asyncio.open_connection(host, int(port))
        # Refused at once, not at the end of its own handshake timeout (5 s).
        assert await asyncio.wait_for(reader.read(), 2) == b""
        writer.close()
        stalled.close()
    finally:
        assert await broker.stop() == 0


# -- the broker's own files --------------------------------------------------------------


@pytest.mark.parametrize("missing", ["--tls-cert", "--tls-key", "--tls-ca"])
async def test_a_broker_with_a_missing_tls_file_exits_naming_it(certs: Certs, missing: str) -> None:
    files = {
        "--tls-cert": str(certs.broker.cert),
        "--tls-key": str(certs.broker.key),
        "--tls-ca": str(certs.ca_file),
    }
    files[missing] = str(certs.directory / "nowhere.pem")
    args = [arg for pair in files.items() for arg in pair]
    process = await start_broker_process("--listen", "127.0.0.1:0", *args)
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 1
    assert out == b""
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert "nowhere.pem" in lines[0]
    assert "No such file" in lines[0]


async def test_a_broker_whose_key_does_not_match_its_certificate_exits_naming_both(
    certs: Certs,
) -> None:
    other = certs.issue("other", *_LOOPBACK)
    process = await start_broker_process(
        "--listen", "127.0.0.1:0", "--tls-cert", str(certs.broker.cert), "--tls-key", str(other.key)
    )
    _, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 1
    assert err.decode().strip().splitlines() == [
        f"Error: the TLS key {other.key} does not belong to the certificate {certs.broker.cert}"
    ]


async def test_a_client_certificate_names_its_user_under_mutual_tls(certs: Certs) -> None:
    """A user proved by a client certificate (its common name) is not challenged; a
    verified certificate that names no user is, and without credentials it is refused."""
    config = certs.directory / "broker.toml"
    config.write_text(
        broker_key(certs.directory, "b1").settings
        + '[[users]]\nname = "alice"\ncertificate = "alice.example"\n'
        '[users.permissions]\noperator = ["stat-detail"]\n'
    )
    broker = await start_broker(
        *certs.broker.broker_args(),
        "--tls-ca",
        str(certs.ca_file),
        "--tls-verify-clients",
        "--config",
        str(config),
    )

    def context_for(common_name: str) -> ssl.SSLContext:
        pem = certs.issue(common_name, f"{common_name}", common_name=common_name)
        context = ssl.create_default_context(cafile=str(certs.ca_file))
        context.load_cert_chain(str(pem.cert), str(pem.key))
        return context

    try:
        async with await meshbus.connect(
            broker.address, operator=True, tls=context_for("alice.example")
        ) as op:
            links = (await op.stat())["links"]
            assert [link["user"] for link in links if link["role"] == "operator"] == ["alice"]
        with pytest.raises(meshbus.AuthenticationFailed, match="credentials"):
            await meshbus.connect(broker.address, tls=context_for("bob.example"), failover=False)
    finally:
        assert await broker.stop() == 0


# -- meshbus certs -----------------------------------------------------------------------


async def test_a_broker_with_the_certificates_of_meshbus_certs_takes_tls_clients(
    tmp_path: Path,
) -> None:
    """``meshbus certs`` (not trustme): its CA and broker certificate, for a loopback
    name and addresses, and a client certificate that names a user under mutual TLS."""
    out = tmp_path / "certs"
    process = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "meshbus", "certs", "localhost", "127.0.0.1", "::1"],
        *["--out", str(out), "--client", "alice"],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    printed, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err.decode()
    assert "not for production" in err.decode()
    assert f"--tls-cert {out / 'broker.crt'} --tls-key {out / 'broker.key'}" in printed.decode()
    for name in ("ca.pem", "broker.crt", "broker.key", "alice.crt", "alice.key"):
        assert ((out / name).stat().st_mode & 0o777) == 0o600, name
    config = tmp_path / "broker.toml"
    config.write_text(
        '[[users]]\nname = "alice"\ncertificate = "alice"\n'
        '[users.permissions]\nsend = ["*"]\njoin = ["*"]\nregister = ["*"]\n'
    )
    broker = await start_broker(
        *["--tls-cert", str(out / "broker.crt"), "--tls-key", str(out / "broker.key")],
        *["--tls-ca", str(out / "ca.pem"), "--tls-verify-clients", "--config", str(config)],
    )
    try:
        context = ssl.create_default_context(cafile=str(out / "ca.pem"))
        context.load_cert_chain(str(out / "alice.crt"), str(out / "alice.key"))
        for host in _LOOPBACK:  # the certificate names both: either is checked and taken
            await _roundtrip(f"{host}:{broker.port}", context)
        with pytest.raises(meshbus.TLSError, match="requires a client certificate"):
            await meshbus.connect(broker.address, tls=out / "ca.pem", failover=False)
    finally:
        assert await broker.stop() == 0
