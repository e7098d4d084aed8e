"""What the integration suites share: raw protocol links, broker processes, receiving.

Test modules import it as ``from tests.integration.helpers import ...``; the fixtures built
on it (``conns``, ``raw_link``, ``healthy_pair``) are in ``conftest.py`` beside it, and the
``broker`` / ``mesh2`` / ``mesh3`` fixtures with ``start_broker`` / ``start_mesh`` in
``tests/conftest.py``.

* ``RawLink`` -- a bare asyncio socket that speaks the wire protocol by hand, for
  feeding the broker bad input and reading exactly what it answers;
* ``start_broker_process`` / ``launch_broker`` -- a broker process whose stdout *and*
  stderr are captured, for lifecycle tests that check what it prints;
* ``recv_n`` / ``recv_payloads`` / ``assert_next_is`` / ``Collector`` -- bounded receives
  on services, in the foreground or the background;
* ``Pair`` -- two connectors with one service each, to prove that other links keep
  working while one misbehaves;
* ``stat`` / ``wait_until`` / ``wait_routes`` / ``wait_members`` -- polling a mesh until
  every broker knows a change;
* ``BrokerKey`` / ``broker_key`` -- a broker's key pair, for a mesh that trusts only its
  brokers (every broker with users is one).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import meshbus
from meshbus.auth import Credentials, brokers_entry, toml_string
from meshbus.broker.process import broker_argv, child_env, nats_address_of, parse_ready_line
from meshbus.private_files import write_private
from meshbus.protocol import (
    ControlFrame,
    ControlType,
    Frame,
    FrameDecoder,
    encode_control,
    encode_data,
)
from meshbus.protocol.control import AddressBody, Empty, Hello, Register, Welcome
from tests import forkserver
from tests.conftest import BrokerProcess

# Generous bound for one network round trip on loopback; only hit when something is broken.
IO_TIMEOUT = 5.0


class RawLink:
    """A hand-driven protocol connection to a broker: bytes out, decoded frames in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder()
        self._correlation = 0

    @classmethod
    async def open(cls, address: str) -> RawLink:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, int(port)), IO_TIMEOUT
        )
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def next_correlation(self) -> int:
        self._correlation += 1
        return self._correlation

    async def read_frame(self, timeout: float = IO_TIMEOUT) -> Frame:
        """The next frame; AssertionError if the broker closes the link first."""
        async with asyncio.timeout(timeout):
            while True:
                frame = self.decoder.next_frame()
                if frame is not None:
                    return frame
                data = await self.reader.read(65536)
                if not data:
                    raise AssertionError(
                        f"broker closed the link; {self.decoder.buffered} bytes of a partial "
                        "frame were left unread"
                    )
                self.decoder.feed(data)

    async def read_control(self, timeout: float = IO_TIMEOUT) -> ControlFrame:
        frame = await self.read_frame(timeout)
        assert isinstance(frame, ControlFrame), f"expected a control frame, got {frame!r}"
        return frame

    async def read_until_closed(self, timeout: float = IO_TIMEOUT) -> list[Frame]:
        """Every frame the broker still sends, until it closes the link (read returns b"").

        Fails (TimeoutError) if the broker keeps the link open."""
        frames: list[Frame] = []
        async with asyncio.timeout(timeout):
            while True:
                try:
                    data = await self.reader.read(65536)
                except ConnectionResetError:
                    data = b""
                if not data:
                    break
                self.decoder.feed(data)
                while (frame := self.decoder.next_frame()) is not None:
                    frames.append(frame)
        assert self.decoder.buffered == 0, "broker closed the link in the middle of a frame"
        return frames

    async def hello(self, name: str = "raw") -> Welcome:
        await self.send(encode_control(ControlType.HELLO, Hello(name=name), 1))
        frame = await self.read_control()
        assert frame.type == ControlType.WELCOME, frame
        assert isinstance(frame.body, Welcome)
        return frame.body

    async def register(self, server: str = "raw", instance: int = 0) -> bytes:
        """Register a service; returns its 16-byte address."""
        correlation = self.next_correlation() + 100
        await self.send(
            encode_control(
                ControlType.REGISTER, Register(server=server, instance=instance), correlation
            )
        )
        frame = await self.read_control()
        # The broker pushes its list of brokers whenever the mesh changes (a peer lost a
        # moment ago, say): news, not the answer, which a connector reads past.
        while frame.type == ControlType.BROKERS and frame.correlation == 0:
            frame = await self.read_control()
        assert frame.type == ControlType.REGISTERED, frame
        assert frame.correlation == correlation
        assert isinstance(frame.body, AddressBody)
        return frame.body.address

    async def ping(self) -> None:
        correlation = self.next_correlation() + 1000
        await self.send(encode_control(ControlType.PING, Empty(), correlation))
        frame = await self.read_control()
        assert frame.type == ControlType.PONG, frame
        assert frame.correlation == correlation

    def abort(self) -> None:
        """Close with a TCP reset, as a crashed process would."""
        transport = self.writer.transport
        transport.abort()

    async def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), IO_TIMEOUT)
        except (ConnectionError, OSError):
            pass


def data_frame(
    dst: meshbus.Address | bytes, src: meshbus.Address | bytes, payload: bytes = b"", **kw: int
) -> bytes:
    """encode_data taking Address objects or raw 16-byte addresses."""
    raw_dst = dst if isinstance(dst, bytes) else dst.to_bytes()
    raw_src = src if isinstance(src, bytes) else src.to_bytes()
    return encode_data(raw_dst, raw_src, payload, **kw)


# -- receiving --------------------------------------------------------------------------


async def recv_n(service: meshbus.Service, n: int, timeout: float = IO_TIMEOUT) -> list:
    """Exactly the next ``n`` messages of ``service``; fails if they do not come in time."""
    messages = []
    async with asyncio.timeout(timeout):
        for _ in range(n):
            messages.append(await service.recv())
    return messages


async def recv_payloads(
    service: meshbus.Service, n: int, timeout: float = IO_TIMEOUT
) -> list[bytes]:
    return [m.payload for m in await recv_n(service, n, timeout)]


async def assert_next_is(
    service: meshbus.Service, payload: bytes, timeout: float = IO_TIMEOUT
) -> None:
    """The next message of ``service`` is ``payload``: nothing was queued before it."""
    message = await service.recv(timeout=timeout)
    assert message.payload == payload, (
        f"{service.address} expected {payload!r} next, got {message.payload!r} from {message.src}"
    )


# -- a healthy pair of connectors ----------------------------------------------------------


@dataclass
class Pair:
    """Two connectors with one service each: ``a`` sends to ``b``."""

    conn_a: meshbus.Connector
    conn_b: meshbus.Connector
    a: meshbus.Service
    b: meshbus.Service

    async def roundtrip(self, payload: bytes = b"ping") -> None:
        """One message a -> b, received; proves the path works now."""
        await self.a.send(self.b.address, payload)
        await assert_next_is(self.b, payload)


# -- broker processes with captured output ------------------------------------------------


@dataclass
class LaunchedBroker(BrokerProcess):
    """A broker whose ready line was read here, and whose stdout and stderr are captured."""

    ready_line: str = ""

    async def finish(self, timeout: float = 10.0) -> tuple[int, str, str]:
        """Wait for exit; returns (exit code, rest of stdout, stderr). Kills it on timeout."""
        try:
            out, err = await asyncio.wait_for(self.process.communicate(), timeout)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
            raise
        assert self.process.returncode is not None
        return self.process.returncode, out.decode(), err.decode()


async def start_broker_process(*args: str) -> asyncio.subprocess.Process:
    """``meshbus broker ARGS`` with stdout and stderr piped, not waited for: for tests of
    what a broker prints, or of one that must not start."""
    return await forkserver.launch(
        *broker_argv(*args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=child_env(),
    )


async def launch_broker(*args: str, listen: str = "127.0.0.1:0") -> LaunchedBroker:
    """Start a broker and wait for its ready line (stdout and stderr captured); an
    AssertionError with what it printed if it does not come up."""
    process = await start_broker_process("--listen", listen, *args)
    assert process.stdout is not None
    try:
        line = (await asyncio.wait_for(process.stdout.readline(), 20)).decode()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    ready = parse_ready_line(line)
    if ready is None:
        if line:  # it printed something else and may still be running
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        _, err = await process.communicate()
        raise AssertionError(f"broker did not print its ready line ({line!r}): {err.decode()!r}")
    return LaunchedBroker(process, ready[0], ready[1], nats_address_of(line), line)


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# -- a mesh of brokers ----------------------------------------------------------------------


async def stat(broker: BrokerProcess, detail: bool = True) -> dict[str, Any]:
    async with await meshbus.connect(broker.address, server="stat", operator=True) as conn:
        return await conn.stat(detail=detail)


async def wait_until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 10) -> None:
    """Poll ``check`` until it is true; fail naming ``what`` if it never is."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


async def wait_routes(brokers: list[BrokerProcess], address: meshbus.Address) -> None:
    """Until every broker's table holds ``address`` (a unicast)."""

    async def everywhere() -> bool:
        for b in brokers:
            if str(address) not in (await stat(b))["service_addresses"]:
                return False
        return True

    await wait_until(everywhere, f"{address} in every routing table")


async def wait_members(
    brokers: list[BrokerProcess], group: meshbus.Address, count: int, timeout: float = 10
) -> None:
    async def everywhere() -> bool:
        for b in brokers:
            if len((await stat(b))["groups"].get(str(group), [])) != count:
                return False
        return True

    await wait_until(everywhere, f"{count} members of {group} in every routing table", timeout)


# -- receiving in the background -------------------------------------------------------------

# The marker ``Collector.settle`` waits for.
END = b"end"
# How long every reliable message of a test may take to be acknowledged, failovers included.
ACK_TIMEOUT = 30.0


class Collector:
    """Receives a service's messages in the background, in arrival order."""

    def __init__(self, service: meshbus.Service) -> None:
        self.service = service
        self.messages: list[meshbus.Message] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            async for msg in self.service:
                self.messages.append(msg)
        except meshbus.ConnectionLost:
            pass  # its broker was killed and it does not fail over: it has what it got

    @property
    def payloads(self) -> list[bytes]:
        return [m.payload for m in self.messages]

    def of_group(self, group: str) -> list[meshbus.Message]:
        return [m for m in self.messages if m.group == group]

    async def wait_for(self, count: int, timeout: float = ACK_TIMEOUT) -> None:
        async def enough() -> bool:
            return len(self.messages) >= count

        await wait_until(enough, f"{count} messages at {self.service.address}", timeout)

    async def settle(self, sender: meshbus.Service) -> list[bytes]:
        """Everything received before an END marker that ``sender`` sends reliably now
        (after its own messages were acknowledged): nothing can trickle in behind it. The
        marker itself is taken out again."""
        await sender.send_reliable(self.service.address, END)

        async def ended() -> bool:
            return bool(self.messages) and self.messages[-1].payload == END

        await wait_until(ended, f"the end marker at {self.service.address}")
        assert [m.payload for m in self.messages].count(END) == 1, "the marker came twice"
        self.messages.pop()
        return self.payloads

    def stop(self) -> None:
        self.task.cancel()


def user_with(who: Credentials, permissions: str) -> str:
    """The [[users]] entry of ``who`` (a key pair) with ``permissions``, the lines of its
    [users.permissions] table."""
    return (
        f'[[users]]\nname = "{who.user}"\npublic_key = "{who.public_key}"\n'
        f"[users.permissions]\n{permissions}\n"
    )


# -- brokers' own keys (a mesh that trusts only its brokers) ---------------------------------


@dataclass
class BrokerKey:
    """A broker's key pair, written to ``path``."""

    name: str
    path: Path
    public_key: str

    @property
    def args(self) -> tuple[str, ...]:
        """The flags that give a broker this name and key."""
        return ("--name", self.name, "--broker-key", str(self.path))

    @property
    def settings(self) -> str:
        """The same as top-level lines of a config file (before any [[table]])."""
        return f"name = {toml_string(self.name)}\nbroker-key = {toml_string(str(self.path))}\n"

    @property
    def entry(self) -> str:
        """Its [[brokers]] entry."""
        return brokers_entry(self.name, self.public_key)


def broker_key(directory: Path, name: str) -> BrokerKey:
    """A new key pair for broker ``name``, in DIRECTORY/NAME.key."""
    credentials = Credentials.generate(name)
    path = directory / f"{name}.key"
    credentials.write(path)
    assert credentials.public_key is not None
    return BrokerKey(name, path, credentials.public_key)


@dataclass
class SecureBroker:
    """A broker with TLS and one user (see ``start_secure_broker``)."""

    process: BrokerProcess
    ca_file: Path  # the CA its certificate is signed by
    creds: Path  # the user's credentials file (a key pair)


async def start_secure_broker(directory: Path, user: str, *args: str) -> SecureBroker:
    """A broker with TLS -- a trustme CA and a certificate for 127.0.0.1, written to
    ``directory`` -- and one user allowed everything, signing in with a key pair."""
    import trustme

    from meshbus.auth import users_entry
    from tests.conftest import start_broker

    ca = trustme.CA()
    ca_file, cert_file, key_file = (directory / name for name in ("ca.pem", "b.crt", "b.key"))
    ca.cert_pem.write_to_path(str(ca_file))
    leaf = ca.issue_cert("127.0.0.1")
    leaf.cert_chain_pems[0].write_to_path(str(cert_file))
    write_private(key_file, leaf.private_key_pem.bytes())
    credentials = Credentials.generate(user)
    creds = directory / f"{user}.creds"
    credentials.write(creds)
    config = directory / "broker.toml"
    config.write_text(users_entry(user, public_key=credentials.public_key, allow_all=True))
    process = await start_broker(
        "--config", str(config), "--tls-cert", str(cert_file), "--tls-key", str(key_file), *args
    )
    return SecureBroker(process, ca_file, creds)


@contextlib.contextmanager
def disks_of_their_own(root: Path, names: list[str], size: str = "256m") -> Iterator[None]:
    """Each broker's data dir (``root``/NAME) on a file system of its own: a tmpfs of
    ``size``, which ``fill`` can fill. Mounting needs CAP_SYS_ADMIN (root in CI)."""
    mounted: list[Path] = []
    try:
        for name in names:
            path = root / name
            path.mkdir(parents=True)
            mount = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if mount.returncode:
                pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
            mounted.append(path)
        yield
    finally:
        for path in mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> Path:
    """Fill the file system ``path`` is on: a ballast file written until ENOSPC."""
    ballast = path / "ballast"
    chunk = bytes(1 << 16)
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return ballast
