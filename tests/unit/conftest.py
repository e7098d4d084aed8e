"""Every test here runs on a SimLoop (fake time, no I/O: see meshbus.testing) with
``random`` seeded, so each run takes the same course -- except those marked
``real_loop``, which need sockets of their own (an HTTP server, a TLS handshake)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator, Mapping

import pytest

from meshbus.testing import FakeClock, FakeNetwork, SimLoop, running_sim_loop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.get_closest_marker("real_loop") is not None:
        return {"real": asyncio.new_event_loop}
    return {"sim": SimLoop}


@pytest.fixture(autouse=True)
def seeded_random() -> Iterator[None]:
    """The broker's own random choices (claim back-off, anycast picks) the same each run."""
    state = random.getstate()
    random.seed(20240601)
    yield
    random.setstate(state)


@pytest.fixture
async def clock() -> FakeClock:
    return running_sim_loop().clock


@pytest.fixture
async def network() -> FakeNetwork:
    return FakeNetwork()
