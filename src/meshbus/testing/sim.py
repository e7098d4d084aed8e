"""Simulated time: one fake clock, and an asyncio event loop without I/O that runs on it."""

from __future__ import annotations

import asyncio
import selectors
from collections import deque
from typing import Any, TypeVar

P = TypeVar("P", bound=asyncio.BaseProtocol)

# Far from 0: "0" is "never" in some of the broker's bookkeeping (move_sent, boost_until).
CLOCK_START = 1000.0


class SimulationStalled(RuntimeError):
    """Nothing can run until time moves, and only the test moves time: the test awaits
    something that needs ``FakeNetwork.advance``, or that never comes."""


class NotSettled(RuntimeError):
    """Still busy after the turn limit of ``settle``: frames or callbacks feed each other
    without end."""


class CallbackFailed(RuntimeError):
    """A loop callback or a protocol callback raised. asyncio would log it and go on (and
    close the connection, for a protocol); a test should hear of it."""


# -- time ---------------------------------------------------------------------------------


class FakeClock:
    """A clock that moves only when told to; call it for the time, like time.monotonic."""

    def __init__(self, start: float = CLOCK_START) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time forward. Loop timers that fall due run at the next loop turn
        (``FakeNetwork.settle``); ``FakeNetwork.advance`` steps through them in order."""
        if seconds < 0:
            raise ValueError("time does not go back")
        self.now += seconds


class _NoIO(selectors.BaseSelector):
    """The selector of a loop with nothing to wait for but its own timers."""

    def __init__(self, loop: SimLoop) -> None:
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:
            return []
        loop = self._loop
        if timeout is not None and loop.auto_advance:
            loop.clock.advance(timeout)
            return []
        pending = "no timer at all" if timeout is None else f"the next timer in {timeout:g} s"
        raise SimulationStalled(
            f"nothing can run until time moves ({pending}); advance it "
            "(await network.advance(seconds)) or stop awaiting what never comes"
        )

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        raise NotImplementedError("a SimLoop has no file descriptors")

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        raise NotImplementedError("a SimLoop has no file descriptors")

    def get_map(self) -> dict[Any, selectors.SelectorKey]:
        return {}


class SimLoop(asyncio.BaseEventLoop):
    """An event loop with no I/O whose time is ``clock``.

    Callbacks run in the order they were scheduled, timers in the order they fall due,
    all on fake time. With ``auto_advance`` the clock jumps to the next timer when
    nothing else can run (a simulation's time); without it (tests) that is a
    ``SimulationStalled``."""

    # Attributes of BaseEventLoop that it does not declare to type checkers.
    _ready: deque[asyncio.Handle]
    _scheduled: list[asyncio.TimerHandle]

    def __init__(self, clock: FakeClock | None = None, *, auto_advance: bool = False) -> None:
        super().__init__()
        self.clock = clock or FakeClock()
        self.auto_advance = auto_advance
        self._selector = _NoIO(self)
        # What asyncio would only log: ``FakeNetwork.settle`` raises the first of them.
        self.failures: list[dict[str, Any]] = []
        self.set_exception_handler(lambda loop, context: self.failures.append(context))

    def time(self) -> float:
        return self.clock.now

    def _process_events(self, event_list: list[Any]) -> None:
        pass  # no I/O, so no events

    def _write_to_self(self) -> None:
        pass  # nothing blocks in select, so nothing needs waking

    def next_timer(self) -> float | None:
        """When the earliest live timer falls due; None if there is none."""
        live = [handle.when() for handle in self._scheduled if not handle.cancelled()]
        return min(live) if live else None

    def raise_failures(self) -> None:
        if self.failures:
            context = self.failures.pop(0)
            exc = context.get("exception")
            raise CallbackFailed(context.get("message", "a callback failed")) from exc

    def idle(self) -> bool:
        """No callback ready to run, and no timer due."""
        if any(not handle.cancelled() for handle in self._ready):
            return False
        due = self.next_timer()
        return due is None or due > self.time()


def running_sim_loop() -> SimLoop:
    loop = asyncio.get_running_loop()
    if not isinstance(loop, SimLoop):
        raise RuntimeError(
            "the fakes need a SimLoop (tests/unit/broker/conftest.py makes it the loop there)"
        )
    return loop
