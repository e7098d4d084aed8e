"""The connector's gate: changes run together, a copy of all services runs alone."""

from __future__ import annotations

import asyncio

import pytest

from meshbus.client.changes import Gate

# Waits on real timers, not on meshbus.testing's simulated loop (tests/unit/conftest.py).
pytestmark = pytest.mark.real_loop


async def test_changes_run_together_and_a_copy_waits_for_them() -> None:
    gate = Gate()
    log: list[str] = []
    release = asyncio.Event()

    async def change(name: str) -> None:
        async with gate.change():
            log.append(f"{name} in")
            await release.wait()
            log.append(f"{name} out")

    async def copy() -> None:
        async with gate.copy():
            log.append("copy")

    changes = [asyncio.create_task(change(n)) for n in ("a", "b")]
    await asyncio.sleep(0)
    copier = asyncio.create_task(copy())
    await asyncio.sleep(0)
    late = asyncio.create_task(change("late"))  # comes after the copy asked
    await asyncio.sleep(0.01)
    assert log == ["a in", "b in"], "two changes at once; the copy and later change wait"
    release.set()
    await asyncio.gather(*changes, copier, late)
    assert log.index("copy") > log.index("b out"), "the copy ran alone"
    assert log.index("late in") > log.index("copy"), "a waiting copy goes first"


async def test_a_copy_excludes_changes_until_done() -> None:
    gate = Gate()
    inside = asyncio.Event()
    finish = asyncio.Event()
    entered: list[str] = []

    async def copy() -> None:
        async with gate.copy():
            inside.set()
            await finish.wait()

    async def change() -> None:
        async with gate.change():
            entered.append("change")

    copier = asyncio.create_task(copy())
    await inside.wait()
    changer = asyncio.create_task(change())
    await asyncio.sleep(0.01)
    assert entered == []
    finish.set()
    await asyncio.gather(copier, changer)
    assert entered == ["change"]
