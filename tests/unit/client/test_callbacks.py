"""Callbacks: what ``add`` returns removes that handler, once, and nothing else."""

from __future__ import annotations

from collections.abc import Callable

from meshbus.client.callbacks import Callbacks

Handler = Callable[[str], object]


def call_all(callbacks: Callbacks[Handler], value: str) -> None:
    for handler in callbacks.handlers:
        handler(value)


def test_handlers_are_called_in_order_until_removed() -> None:
    got: list[str] = []
    callbacks: Callbacks[Handler] = Callbacks()
    assert callbacks.handlers == ()
    remove_a = callbacks.add(lambda v: got.append(f"a{v}"))
    callbacks.add(lambda v: got.append(f"b{v}"))
    assert len(callbacks.handlers) == 2
    call_all(callbacks, "1")
    remove_a()
    call_all(callbacks, "2")
    assert got == ["a1", "b1", "b2"]


def test_removing_twice_removes_once() -> None:
    """The same handler added twice: each remover takes out one of them, and only once."""
    got: list[str] = []
    callbacks: Callbacks[Handler] = Callbacks()
    remove_first = callbacks.add(got.append)
    callbacks.add(got.append)
    remove_first()
    remove_first()
    call_all(callbacks, "x")
    assert got == ["x"]


def test_a_handler_may_remove_itself_while_called() -> None:
    got: list[str] = []
    callbacks: Callbacks[Handler] = Callbacks()

    def once(value: str) -> None:
        got.append(f"once {value}")
        remove()

    remove = callbacks.add(once)
    callbacks.add(lambda v: got.append(f"always {v}"))
    call_all(callbacks, "1")
    call_all(callbacks, "2")
    assert got == ["once 1", "always 1", "always 2"]
    assert len(callbacks.handlers) == 1
