"""``meshbus top`` run for real: brokers with connectors and traffic, the live view in a
terminal of its own under tmux (read with capture-pane, typed at with send-keys), and
``--once`` read from a pipe.

The screen is read until it shows what is expected, never after a guessed sleep. A
shell around the command prints its exit code and whether the terminal's settings
(``stty -g``) are those it had before, once it has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import sys
from collections.abc import AsyncIterator, Callable

import pytest

import meshbus
from tests.conftest import BrokerProcess, start_broker, start_mesh, stop_all
from tests.integration.test_cli import run_cli

SCREEN_TIMEOUT = 10.0
# Around the command in the pane: its exit code and whether it left the terminal as it
# found it, then a shell that stays, so that the pane can still be read. The shell is in
# the command's process group, so Ctrl-C reaches it too: it traps it to live on (a
# handler, not ignoring it, which the command would inherit).
_WRAPPER = (
    'trap : INT; before=$(stty -g); "$@"; code=$?; '
    '[ "$(stty -g)" = "$before" ] && terminal=restored || terminal=changed; '
    'echo "top exited $code, terminal $terminal"; exec sleep 120'
)
_sockets = itertools.count()


def _tmux_binary() -> str:
    found = shutil.which("tmux")
    if found is None:
        pytest.skip("tmux is missing: `make tmux` installs it (Debian)")
    return found


class Terminal:
    """A command in a terminal of its own: a private tmux server (-L), so no user's tmux
    configuration or sessions are involved; the server inherits this process's
    environment (PYTHONPATH), being started by the first call."""

    def __init__(self) -> None:
        self._tmux = [_tmux_binary(), "-L", f"meshbus-top-{os.getpid()}-{next(_sockets)}"]
        self._tmux += ["-f", "/dev/null"]

    async def _call(self, *args: str) -> str:
        process = await asyncio.create_subprocess_exec(
            *self._tmux,
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await process.communicate()
        assert process.returncode == 0, f"tmux {' '.join(args)}: {err.decode()}"
        return out.decode()

    async def start(self, *argv: str, width: int, height: int) -> None:
        size = ("-x", str(width), "-y", str(height))
        await self._call("new-session", "-d", "-s", "top", *size, "sh", "-c", _WRAPPER, "sh", *argv)

    async def screen(self) -> str:
        return await self._call("capture-pane", "-p", "-t", "top")

    async def keys(self, *keys: str) -> None:
        await self._call("send-keys", "-t", "top", *keys)

    async def resize(self, width: int, height: int) -> None:
        await self._call("resize-window", "-t", "top", "-x", str(width), "-y", str(height))

    async def wait_for(self, shows: Callable[[str], bool], what: str) -> str:
        """The screen once ``shows`` it; fails with the last screen after SCREEN_TIMEOUT."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SCREEN_TIMEOUT
        while True:
            screen = await self.screen()
            if shows(screen):
                return screen
            if loop.time() > deadline:
                pytest.fail(f"the screen did not show {what} within {SCREEN_TIMEOUT} s:\n{screen}")
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        with contextlib.suppress(AssertionError):  # no server: it never started
            await self._call("kill-server")


@contextlib.asynccontextmanager
async def terminal() -> AsyncIterator[Terminal]:
    term = Terminal()
    try:
        yield term
    finally:
        await term.close()


def top_argv(broker: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "meshbus", "top", "--broker", broker, *args]


def fields(screen: str, first: str) -> list[str] | None:
    """The words of the line that starts with the word ``first`` (a broker's row, or
    the total's), None if there is none."""
    for line in screen.splitlines():
        words = line.split()
        if words and words[0] == first:
            return words
    return None


def broker_shows(screen: str, name: str, state: str, connectors: int) -> bool:
    """Whether ``name``'s row has that state and connector count:
    NAME ADDRESS STATE CONN SVCS NATS IN/S OUT/S PEND DROPS LAG P99 OWN."""
    row = fields(screen, name)
    return row is not None and row[2] == state and row[3] == str(connectors)


def msgs_in(row: list[str] | None) -> float:
    return float(row[6]) if row is not None and row[6] != "-" else 0.0


@contextlib.asynccontextmanager
async def connectors(
    brokers: list[BrokerProcess], counts: list[int]
) -> AsyncIterator[list[list[meshbus.Connector]]]:
    """``counts[i]`` connectors linked to ``brokers[i]``, closed at the end."""
    opened: list[list[meshbus.Connector]] = []
    try:
        for i, (broker, count) in enumerate(zip(brokers, counts, strict=True)):
            opened.append(
                [await meshbus.connect(broker.address, server=f"top{i}") for _ in range(count)]
            )
        yield opened
    finally:
        for conn in itertools.chain.from_iterable(opened):
            await conn.close()


@contextlib.asynccontextmanager
async def traffic(sender: meshbus.Connector, receiver: meshbus.Connector) -> AsyncIterator[None]:
    """About 200 messages a second from a service of ``sender`` to one of ``receiver``
    (read and thrown away) while the block runs, for a minute at most."""
    source, sink = await sender.register(), await receiver.register()

    async def send() -> None:
        for _ in range(600):
            for _ in range(20):
                await source.send(sink.address, b"top")
            await asyncio.sleep(0.1)

    async def drain() -> None:
        while True:
            await sink.recv()

    tasks = [asyncio.create_task(send()), asyncio.create_task(drain())]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_live_view_of_a_mesh_follows_it_and_q_quits() -> None:
    brokers = await start_mesh(3)
    try:
        async with (
            connectors(brokers, [1, 2, 3]) as conns,
            terminal() as term,
        ):
            async with traffic(conns[0][0], conns[2][0]):
                await term.start(
                    *top_argv(brokers[0].address, "--interval", "0.3"), width=160, height=40
                )

                def mesh_shown(screen: str) -> bool:
                    return (
                        all(
                            broker_shows(screen, b.name, "running", count)
                            for b, count in zip(brokers, [1, 2, 3], strict=True)
                        )
                        and msgs_in(fields(screen, brokers[0].name)) > 0
                        and msgs_in(fields(screen, brokers[2].name)) > 0
                    )

                screen = await term.wait_for(mesh_shown, "three brokers with 1, 2, 3 connectors")
                total = fields(screen, "total")
                assert total is not None
                assert total[1:4] == ["3", "brokers", "6"], screen
                # The traffic goes from the first broker straight to the third.
                assert msgs_in(fields(screen, brokers[1].name)) == 0, screen
            brokers[2].process.kill()

            def killed_shown(screen: str) -> bool:
                # Its connectors fail over to the others: their counts change meanwhile.
                rows = [fields(screen, b.name) or [] for b in brokers]
                unreachable = [brokers[2].name, brokers[2].address, "unreachable"] + ["-"] * 10
                return rows[2] == unreachable and all(row[2:3] == ["running"] for row in rows[:2])

            await term.wait_for(killed_shown, f"{brokers[2].name} unreachable, the others running")
            await term.keys("q")
            await term.wait_for(
                lambda s: "top exited 0, terminal restored" in s, "top exit 0 after q"
            )
    finally:
        await stop_all(brokers)


async def test_a_small_terminal_is_told_so_then_ctrl_c_quits() -> None:
    broker = await start_broker()
    try:
        async with connectors([broker], [2]), terminal() as term:
            await term.start(*top_argv(broker.address, "--interval", "0.3"), width=40, height=10)
            await term.wait_for(
                lambda s: "terminal is too small for meshbus top" in " ".join(s.split()),
                "that the terminal is too small",
            )
            await term.resize(160, 40)
            await term.wait_for(
                lambda s: broker_shows(s, broker.name, "running", 2), "the broker, 2 connectors"
            )
            await term.keys("C-c")
            await term.wait_for(
                lambda s: "top exited 0, terminal restored" in s, "top exit 0 after Ctrl-C"
            )
    finally:
        await broker.stop()


async def test_once_prints_one_table_with_rates_for_scripts() -> None:
    brokers = await start_mesh(2)
    try:
        async with connectors(brokers, [2, 1]) as conns, traffic(conns[0][0], conns[1][0]):
            result = await run_cli(
                "top", "--once", "--broker", brokers[1].address, "--interval", "0.5"
            )
        assert result.code == 0, result.err
        lines = result.out.splitlines()
        assert lines[0].split() == [
            "BROKER",
            "ADDRESS",
            "STATE",
            "CONN",
            "SVCS",
            "NATS",
            "IN/S",
            "OUT/S",
            "PEND",
            "DROPS",
            "LAG",
            "P99",
            "OWN",
        ]
        assert len(lines) == 4, result.out  # header, two brokers, total: no screen codes
        for broker, count in zip(brokers, [2, 1], strict=True):
            row = fields(result.out, broker.name)
            assert row is not None, result.out
            assert row[1:6] == [broker.address, "running", str(count), "1", "0"], result.out
            # About 200 a second: well above nothing, well below a miscounted interval.
            assert 50 < msgs_in(row) < 1000, result.out
        assert fields(result.out, "total")[1:4] == ["2", "brokers", "3"]  # type: ignore[index]
    finally:
        await stop_all(brokers)


async def test_without_a_terminal_or_a_broker_it_says_what_to_do() -> None:
    piped = await run_cli("top", "--broker", "127.0.0.1:1")
    assert piped.code == 2
    assert "use --once" in piped.err
    nobody = await run_cli("top", "--once", "--broker", "127.0.0.1:1")
    assert nobody.code == 1
    assert nobody.err.startswith("Error: could not connect to broker 127.0.0.1:1")
