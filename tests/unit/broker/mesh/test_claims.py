"""The claim table on its own: the arbitration rule every broker applies."""

from __future__ import annotations

import itertools

from meshbus.broker.mesh.claims import ClaimTable, is_slot_key, slot_key

KEY = b"\x01" + b"game01".ljust(11, b"\x00") + (5).to_bytes(4, "big")
S1, S2, S3 = b"1" * 16, b"2" * 16, b"3" * 16


def test_free_key_is_granted_and_then_refused_to_another_session() -> None:
    table = ClaimTable("b")
    assert table.reserve(KEY, "a", S1, None)
    assert table.held_by(KEY, "a", S1)
    assert not table.reserve(KEY, "c", S2, None)
    assert table.reserve(KEY, "a", S1, None), "the same claimant may ask again"


def test_owned_key_is_refused_unless_the_session_is_the_owners() -> None:
    table = ClaimTable("b")
    assert not table.reserve(KEY, "a", S1, S2)
    assert table.reserve(KEY, "a", S1, S1), "a connector takes its own address back"
    assert not table.reserve(KEY, "a", b"", b""), "an empty session never matches"


def test_own_pending_claim_yields_to_a_smaller_name_only() -> None:
    table = ClaimTable("m")
    assert table.reserve(KEY, "m", S1, None)  # our own claim
    assert not table.reserve(KEY, "z", S2, None)  # larger name: refused
    assert table.reserve(KEY, "a", S3, None)  # smaller name: it wins here
    assert not table.held_by(KEY, "m", S1), "our own claim is lost"
    assert not table.reserve(KEY, "b", S2, None), "a granted reservation is final"


def test_release_and_drop_holder() -> None:
    table = ClaimTable("b")
    table.reserve(KEY, "a", S1, None)
    table.release(KEY, "c")  # not the holder: no effect
    assert table.held_by(KEY, "a", S1)
    table.release(KEY, "a")
    assert len(table) == 0
    table.reserve(KEY, "a", S1, None)
    table.reserve(slot_key(4), "a", S1, None)
    assert table.reserved_slots() == {4}
    assert table.drop_holder("a") == 2
    assert len(table) == 0


def test_slot_keys_are_not_addresses() -> None:
    key = slot_key(513)
    assert len(key) == 16
    assert is_slot_key(key)
    assert not is_slot_key(KEY)
    assert key[0] == 0  # no address has cast type 0


def _run_round(order: list[tuple[str, str]], names: list[str]) -> dict[str, bool]:
    """Brokers ``names`` each claim KEY for their own connector; ``order`` is the order in
    which events happen: ("x", "x") x reserves locally, ("x", "y") y arbitrates x's claim.
    Returns who won: granted by all peers and still holding its own reservation."""
    tables = {n: ClaimTable(n) for n in names}
    sessions = {n: n.encode() * 16 for n in names}
    denied = {n: False for n in names}
    for claimant, arbiter in order:
        ok = tables[arbiter].reserve(KEY, claimant, sessions[claimant][:16], None)
        if not ok:
            denied[claimant] = True
    return {n: not denied[n] and tables[n].held_by(KEY, n, sessions[n][:16]) for n in names}


def test_never_two_winners_in_any_interleaving() -> None:
    """Every order of the 9 events of three simultaneous claims: at most one winner.
    (Some orders have none -- the broker then retries after a random pause.)"""
    names = ["a", "b", "c"]
    events = [(c, a) for c in names for a in names]
    none_won = 0
    for order in itertools.permutations(events):
        # A claimant reserves locally before it asks the others.
        if any(order.index((c, c)) > order.index((c, a)) for c in names for a in names if a != c):
            continue
        winners = [n for n, won in _run_round(list(order), names).items() if won]
        assert len(winners) <= 1, (order, winners)
        none_won += not winners
    assert none_won > 0, "the all-lose case exists: that is why losers retry"
