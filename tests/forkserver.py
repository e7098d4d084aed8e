"""Broker processes for the tests, forked from a process that has imported the broker.

A broker's start is mostly Python importing meshbus: ~0.22 s of CPU, and the suite
starts ~900 brokers on two cores. Each test worker keeps one *fork server* (this file
run as a program), which imports what ``python -m meshbus broker`` imports and then
forks a child per broker: the child takes the request's argv, environment, working
directory and standard streams, and runs ``python -m meshbus`` from there (runpy, as
the interpreter would). It is a real process -- its own pid, port, signals, exit code,
killed with -9 or paused with SIGSTOP like any other -- and what it runs is the broker's
own ``main``; only the imports were done once, before the fork.

``launch`` stands in for ``asyncio.create_subprocess_exec`` and hands back an
``asyncio.subprocess.Process`` whose pid, signals, ``wait``, ``returncode`` and pipes
behave as a spawned child's. Exit codes follow ``Popen``: ``-N`` for a signal. The fork
server reaps its children and reports each exit on the request's connection.

What is not forked, but exec'd as before: a command that is not ``python -m meshbus``
with this interpreter, or a call with arguments other than the standard streams and
``env``. A fork server imports under one environment (``MESHBUS_NO_EXTENSIONS`` picks
the pure-Python leg at import), so each distinct environment gets its own (at most
``_MOST_SERVERS``; past that, exec). ``MESHBUS_TESTS_EXEC_BROKERS=1`` turns it off.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable, Mapping
from typing import Any

_MOST_SERVERS = 4
_REQUEST_LIMIT = 1 << 20
_STD = (0, 1, 2)


# -- the fork server (a program of its own) -------------------------------------------


def _preload() -> None:
    """What a broker imports by the time it prints its ready line."""
    import concurrent.futures.thread  # noqa: F401  (asyncio's default executor)
    import encodings.idna  # noqa: F401
    import runpy  # noqa: F401

    import meshbus.broker.run
    import meshbus.cli.broker
    import meshbus.cli.main  # noqa: F401

    try:
        import uvloop  # noqa: F401
    except ImportError:
        pass


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One request: a 4-byte length, then JSON; the three standard streams ride along."""
    head, fds, _flags, _addr = socket.recv_fds(conn, 4, 3)
    size = int.from_bytes(head, "big") if len(head) == 4 else -1
    if not 0 <= size <= _REQUEST_LIMIT or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError("malformed fork request")
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("truncated fork request")
        body += chunk
    return json.loads(body), fds


def _become(request: dict[str, Any], fds: list[int]) -> Callable[[], None]:
    """In the forked child: take the request's streams, environment and directory; the
    caller then runs meshbus as ``python -m meshbus`` would, outside the server's loop."""
    for target, fd in zip(_STD, fds, strict=True):
        os.dup2(fd, target)
    os.closerange(3, 1 << 16)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # `python -m` puts the working directory first

    def run() -> None:
        import runpy

        sys.argv = ["-m", *request["args"]]
        runpy.run_module("meshbus", run_name="__main__", alter_sys=True)

    return run


def serve(listener: socket.socket) -> Callable[[], None] | None:
    """Fork a child per request until stdin closes (the test worker is gone). Returns in
    a forked child only: what it is to run."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, its connection)
    while True:
        for key, _ in selector.select():
            if key.fileobj is sys.stdin:
                return None
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    # Let go of the server's sockets without closing them from Python
                    # later (their numbers will be the broker's): _become closes them all.
                    selector.close()
                    for held in (listener, conn, *(c for _, c in children.values())):
                        held.detach()
                    return _become(request, fds)
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, conn)
                selector.register(pidfd, selectors.EVENT_READ)
                _answer(conn, pid)
                continue
            pidfd = key.fd
            selector.unregister(pidfd)
            os.close(pidfd)
            pid, conn = children.pop(pidfd)
            _, status = os.waitpid(pid, 0)
            _answer(conn, os.waitstatus_to_exitcode(status))
            conn.close()


def _answer(conn: socket.socket, number: int) -> None:
    try:
        conn.sendall(b"%d\n" % number)
    except OSError:  # the test that asked is gone; the child runs on regardless
        pass


def _main() -> None:
    _preload()
    # The listening socket (its fd is the argument) was bound and listening before this
    # started: a request made while the imports run waits in its backlog.
    run = serve(socket.socket(fileno=int(sys.argv[1])))
    if run is not None:
        run()


# -- the test worker's side ------------------------------------------------------------


class _ForkServer:
    """One running fork server, for one environment; it ends with the test worker."""

    def __init__(self, env: Mapping[str, str]) -> None:
        folder = tempfile.mkdtemp(prefix="meshbus-forkserver-")
        self.path = os.path.join(folder, "socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(self.path)
            listener.listen(128)
            self.process = subprocess.Popen(
                [sys.executable, __file__, str(listener.fileno())],
                stdin=subprocess.PIPE,
                pass_fds=(listener.fileno(),),
                env=dict(env),
            )
        atexit.register(self.close)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait()
        os.unlink(self.path)
        os.rmdir(os.path.dirname(self.path))

    async def fork(
        self, args: list[str], env: Mapping[str, str], streams: tuple[Any, Any, Any]
    ) -> asyncio.subprocess.Process:
        loop = asyncio.get_running_loop()
        sent: list[int] = []
        readers: dict[int, int] = {}  # child's fd -> our read end, for each PIPE
        try:
            for std, spec in zip(_STD, streams, strict=True):
                sent.append(_child_end(std, spec, readers))
            body = json.dumps({"args": args, "env": dict(env), "cwd": os.getcwd()}).encode()
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.setblocking(False)
            try:
                await loop.sock_connect(conn, self.path)
                socket.send_fds(conn, [len(body).to_bytes(4, "big")], sent)
                await loop.sock_sendall(conn, body)
                pid = int(await _line(loop, conn))
            except BaseException:
                conn.close()
                raise
        except BaseException:
            for fd in readers.values():
                os.close(fd)
            raise
        finally:
            for fd in sent:
                os.close(fd)
        return await _Forked.start(loop, pid, conn, readers)


def _child_end(std: int, spec: Any, readers: dict[int, int]) -> int:
    """The fd the child gets as its ``std`` stream (ours to close once sent)."""
    if spec is None:
        return os.dup(std)
    if spec == subprocess.PIPE:
        read_end, write_end = os.pipe()
        readers[std] = read_end
        return write_end
    if spec == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR)
    return os.dup(spec if isinstance(spec, int) else spec.fileno())


async def _line(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await loop.sock_recv(conn, 64)
        if not chunk:
            raise ConnectionError("the tests' fork server closed the connection")
        data += chunk
    return data


class _Forked:
    """What ``asyncio.subprocess.Process`` asks of its transport, for a forked child: the
    exit code comes from the fork server, which reaped it."""

    def __init__(
        self, pid: int, exited: asyncio.Future[int], pipes: dict[int, asyncio.BaseTransport]
    ) -> None:
        self._pid = pid
        self._exited = exited
        self._pipes = pipes

    @classmethod
    async def start(
        cls, loop: asyncio.AbstractEventLoop, pid: int, conn: socket.socket, readers: dict[int, int]
    ) -> asyncio.subprocess.Process:
        streams: dict[int, asyncio.StreamReader] = {}
        pipes: dict[int, asyncio.BaseTransport] = {}
        for std, fd in readers.items():
            reader = streams[std] = asyncio.StreamReader(limit=2**16, loop=loop)
            pipes[std], _ = await loop.connect_read_pipe(
                lambda reader=reader: asyncio.StreamReaderProtocol(reader, loop=loop),
                os.fdopen(fd, "rb", buffering=0),
            )
        exited: asyncio.Future[int] = loop.create_future()
        loop.create_task(_report_exit(loop, conn, exited))
        protocol = types.SimpleNamespace(stdin=None, stdout=streams.get(1), stderr=streams.get(2))
        return asyncio.subprocess.Process(cls(pid, exited, pipes), protocol, loop)  # type: ignore[arg-type]

    def get_pid(self) -> int:
        return self._pid

    def get_returncode(self) -> int | None:
        """None while it runs, and when its fork server went away before saying (``wait``
        raises that)."""
        exited = self._exited
        known = exited.done() and not exited.cancelled() and exited.exception() is None
        return exited.result() if known else None

    async def _wait(self) -> int:
        return await asyncio.shield(self._exited)

    def get_pipe_transport(self, fd: int) -> asyncio.BaseTransport | None:
        return self._pipes.get(fd)

    def send_signal(self, signum: int) -> None:
        if self.get_returncode() is not None:
            raise ProcessLookupError(f"process {self._pid} has exited")
        os.kill(self._pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


async def _report_exit(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, exited: asyncio.Future[int]
) -> None:
    try:
        code = int(await _line(loop, conn))
    except (ConnectionError, ValueError) as exc:
        if not exited.done():
            exited.set_exception(exc)
    else:
        if not exited.done():
            exited.set_result(code)
    finally:
        conn.close()


_servers: dict[frozenset[tuple[str, str]], _ForkServer] = {}
# Variables that change from test to test and that no import reads: a child gets them
# from its request all the same.
_PER_TEST = frozenset({"PYTEST_CURRENT_TEST"})


def _server_for(
    program: str, args: tuple[str, ...], env: dict[str, str], stdin: Any
) -> _ForkServer | None:
    if os.environ.get("MESHBUS_TESTS_EXEC_BROKERS") == "1":
        return None
    if program != sys.executable or args[:2] != ("-m", "meshbus") or stdin == subprocess.PIPE:
        return None
    key = frozenset(item for item in env.items() if item[0] not in _PER_TEST)
    server = _servers.get(key)
    if server is None or server.process.poll() is not None:
        if server is None and len(_servers) >= _MOST_SERVERS:
            return None
        server = _servers[key] = _ForkServer(env)
    return server


async def launch(
    program: str,
    *args: str,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    env: Mapping[str, str] | None = None,
) -> asyncio.subprocess.Process:
    """``asyncio.create_subprocess_exec(program, *args, ...)``, forked from a fork server
    when it is ``python -m meshbus ...`` (module docstring)."""
    environment = dict(os.environ if env is None else env)
    server = _server_for(program, args, environment, stdin)
    if server is None:
        return await asyncio.create_subprocess_exec(
            program, *args, stdin=stdin, stdout=stdout, stderr=stderr, env=environment
        )
    return await server.fork(list(args[2:]), environment, (stdin, stdout, stderr))


if __name__ == "__main__":
    _main()
