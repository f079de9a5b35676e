"""RangeSet and CursorState: unit tests plus a stateful test against a set-based model."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pigeon.broker import CursorState, RangeSet

# ------------------------------------------------------------------ RangeSet


def _members(rs: RangeSet) -> set[int]:
    return {x for s, e in rs for x in range(s, e)}


def _assert_canonical(rs: RangeSet) -> None:
    ranges = rs.ranges()
    for s, e in ranges:
        assert s < e, ranges
    for (_s1, e1), (s2, _e2) in itertools.pairwise(ranges):
        assert e1 < s2, f"ranges not sorted, disjoint and merged: {ranges}"


def test_rangeset_merges_overlapping_and_adjacent() -> None:
    rs = RangeSet()
    rs.add(10, 20)
    rs.add(30, 40)
    assert rs.ranges() == [(10, 20), (30, 40)]
    rs.add(20, 25)  # adjacent: merges
    assert rs.ranges() == [(10, 25), (30, 40)]
    rs.add(24, 30)  # bridges the gap
    assert rs.ranges() == [(10, 40)]
    rs.add(0, 5)
    rs.add(50, 60)
    rs.add(3, 55)  # swallows everything
    assert rs.ranges() == [(0, 60)]
    assert len(rs) == 1


def test_rangeset_ignores_empty_ranges() -> None:
    rs = RangeSet([(5, 5), (7, 3)])
    assert rs.ranges() == []
    assert rs.first() is None


def test_rangeset_constructor_normalises() -> None:
    rs = RangeSet([(30, 40), (0, 10), (5, 15), (15, 16)])
    assert rs.ranges() == [(0, 16), (30, 40)]


def test_rangeset_contains() -> None:
    rs = RangeSet([(0, 3), (10, 11)])
    assert [x in rs for x in (-1, 0, 2, 3, 9, 10, 11)] == [
        False,
        True,
        True,
        False,
        False,
        True,
        False,
    ]


def test_rangeset_remove_below() -> None:
    rs = RangeSet([(0, 5), (10, 20), (30, 40)])
    rs.remove_below(12)
    assert rs.ranges() == [(12, 20), (30, 40)]
    rs.remove_below(20)
    assert rs.ranges() == [(30, 40)]
    rs.remove_below(100)
    assert rs.ranges() == []


def test_rangeset_count_and_members_in() -> None:
    rs = RangeSet([(2, 5), (8, 10)])
    assert rs.count_in(0, 100) == 5
    assert rs.count_in(3, 9) == 3
    assert rs.count_in(5, 8) == 0
    assert rs.members_in(0, 100) == [2, 3, 4, 8, 9]
    assert rs.members_in(4, 9) == [4, 8]
    assert rs.members_in(10, 20) == []


@settings(max_examples=200)
@given(
    adds=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 40)), max_size=30),
    below=st.integers(0, 250),
    window=st.tuples(st.integers(0, 250), st.integers(0, 60)),
)
def test_rangeset_matches_a_set(
    adds: list[tuple[int, int]], below: int, window: tuple[int, int]
) -> None:
    rs = RangeSet()
    model: set[int] = set()
    for start, length in adds:
        rs.add(start, start + length)
        model |= set(range(start, start + length))
        _assert_canonical(rs)
        assert _members(rs) == model
    w0, wlen = window
    assert rs.count_in(w0, w0 + wlen) == len(model & set(range(w0, w0 + wlen)))
    assert rs.members_in(w0, w0 + wlen) == sorted(model & set(range(w0, w0 + wlen)))
    assert all((x in rs) == (x in model) for x in range(-2, 260))
    rs.remove_below(below)
    _assert_canonical(rs)
    assert _members(rs) == {x for x in model if x >= below}


# ------------------------------------------------------------------ CursorState


def test_new_cursor_has_nothing_acked() -> None:
    c = CursorState()
    assert c.mark_delete == 0
    assert not c.is_acked(0)
    assert c.acked_indexes(0, 3) == []
    assert not c.all_acked(0, 1)
    assert c.all_acked(0, 0)


def test_individual_acks_advance_mark_delete_when_contiguous() -> None:
    c = CursorState()
    c.ack(1)
    c.ack(2)
    assert c.mark_delete == 0  # 0 is still outstanding
    assert c.is_acked(1) and c.is_acked(2) and not c.is_acked(0)
    c.ack(0)
    assert c.mark_delete == 3
    assert c.acked.ranges() == []


def test_ack_range_and_batch_indexes() -> None:
    c = CursorState(mark_delete=100)
    # an entry of 5 messages at offsets 100..104: two of them acknowledged
    c.ack(101)
    c.ack(103)
    assert c.acked_indexes(100, 5) == [1, 3]
    assert not c.all_acked(100, 5)
    c.ack_range(100, 105)
    assert c.all_acked(100, 5)
    assert c.acked_indexes(100, 5) == [0, 1, 2, 3, 4]
    assert c.mark_delete == 105


def test_acks_below_mark_delete_change_nothing() -> None:
    c = CursorState(mark_delete=50)
    before = c.to_json()
    c.ack(10)
    c.ack_range(0, 50)
    c.ack_cumulative(20)
    assert c.to_json() == before


def test_ack_cumulative_swallows_individual_acks() -> None:
    c = CursorState()
    c.ack(5)
    c.ack(9)
    c.ack(11)
    c.ack_cumulative(9)
    assert c.mark_delete == 10
    assert c.acked.ranges() == [(11, 12)]
    c.ack(10)
    assert c.mark_delete == 12


def test_ack_cumulative_joins_following_acks() -> None:
    c = CursorState()
    c.ack_range(4, 8)
    c.ack_cumulative(3)
    assert c.mark_delete == 8


def test_reset_moves_both_ways() -> None:
    c = CursorState()
    c.ack_range(0, 10)
    c.ack(15)
    c.reset(5)  # seek back: 5.. are redelivered, even the acked 15
    assert c.mark_delete == 5
    assert not c.is_acked(5) and not c.is_acked(15) and c.is_acked(4)
    c.reset(1000)
    assert c.is_acked(999) and not c.is_acked(1000)


def test_acked_indexes_of_entry_straddling_mark_delete() -> None:
    c = CursorState(mark_delete=12)
    c.ack(14)
    assert c.acked_indexes(10, 6) == [0, 1, 4]
    assert c.acked_indexes(0, 3) == [0, 1, 2]
    assert c.acked_indexes(20, 3) == []


def test_json_round_trip() -> None:
    c = CursorState()
    c.ack_range(3, 6)
    c.ack(10)
    c.ack_cumulative(0)
    data = c.to_json()
    doc = json.loads(data)
    assert doc == {"mark_delete": 1, "acked": [[3, 6], [10, 11]]}
    restored = CursorState.from_json(data)
    assert restored.mark_delete == 1
    assert restored.acked.ranges() == [(3, 6), (10, 11)]


def test_from_json_normalises_a_stale_document() -> None:
    """A persisted document whose ranges overlap, touch the mark-delete or are
    unsorted still loads into a canonical state."""
    doc = {"mark_delete": 5, "acked": [[8, 9], [2, 7], [9, 12], [20, 21]]}
    c = CursorState.from_json(json.dumps(doc).encode())
    assert c.mark_delete == 7
    assert c.acked.ranges() == [(8, 12), (20, 21)]


def test_from_json_without_acked() -> None:
    c = CursorState.from_json(b'{"mark_delete": 42}')
    assert c.mark_delete == 42 and c.acked.ranges() == []


def test_the_subscription_type_is_stored_with_the_cursor() -> None:
    c = CursorState(4, sub_type="shared")
    c.reset(2)  # a seek keeps the type
    assert json.loads(c.to_json()) == {"mark_delete": 2, "acked": [], "type": "shared"}
    assert CursorState.from_json(c.to_json()).sub_type == "shared"
    # a document written before the type was stored still loads, without a type
    assert CursorState.from_json(b'{"mark_delete": 3, "acked": [[5, 6]]}').sub_type is None


# ------------------------------------------------------------------ stateful

offsets = st.integers(min_value=0, max_value=80)


class CursorMachine(RuleBasedStateMachine):
    """CursorState against a model: an explicit set of acknowledged offsets below a
    horizon plus "everything below ``floor`` is acked" (from cumulative acks/resets)."""

    HORIZON = 120

    @initialize(start=st.integers(0, 20))
    def start(self, start: int) -> None:
        self.cursor = CursorState(mark_delete=start)
        self.floor = start
        self.acked: set[int] = set()

    def model_acked(self, offset: int) -> bool:
        return offset < self.floor or offset in self.acked

    def model_mark_delete(self) -> int:
        m = self.floor
        while m in self.acked:
            m += 1
        return m

    @rule(offset=offsets)
    def ack(self, offset: int) -> None:
        self.cursor.ack(offset)
        self.acked.add(offset)

    @rule(start=offsets, length=st.integers(0, 12))
    def ack_range(self, start: int, length: int) -> None:
        self.cursor.ack_range(start, start + length)
        self.acked |= set(range(start, start + length))

    @rule(offset=offsets)
    def ack_cumulative(self, offset: int) -> None:
        self.cursor.ack_cumulative(offset)
        self.floor = max(self.floor, offset + 1)

    @rule(mark_delete=offsets)
    def reset(self, mark_delete: int) -> None:
        self.cursor.reset(mark_delete)
        self.floor = mark_delete
        self.acked = set()

    @rule()
    def restart(self) -> None:
        """The broker persists the cursor and a new owner loads it."""
        data = self.cursor.to_json()
        self.cursor = CursorState.from_json(data)
        assert self.cursor.to_json() == data

    @invariant()
    def mark_delete_agrees(self) -> None:
        assert self.cursor.mark_delete == self.model_mark_delete()

    @invariant()
    def is_acked_agrees(self) -> None:
        got = [self.cursor.is_acked(o) for o in range(self.HORIZON)]
        assert got == [self.model_acked(o) for o in range(self.HORIZON)]

    @invariant()
    def entries_agree(self) -> None:
        for first, count in ((0, 1), (0, 10), (5, 7), (30, 20), (60, 40), (95, 3)):
            expected = [i for i in range(count) if self.model_acked(first + i)]
            assert self.cursor.acked_indexes(first, count) == expected
            assert self.cursor.all_acked(first, count) == (len(expected) == count)

    @invariant()
    def ranges_are_canonical(self) -> None:
        _assert_canonical(self.cursor.acked)
        first = self.cursor.acked.first()
        # nothing at or below the mark-delete is kept individually
        assert first is None or first[0] > self.cursor.mark_delete


TestCursorStateMachine = CursorMachine.TestCase
TestCursorStateMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("mark_delete", [0, 7])
def test_machine_smoke(mark_delete: int) -> None:
    """A fixed run through every rule, so a broken machine fails loudly and fast."""
    m = CursorMachine()
    m.start(mark_delete)
    m.ack(9)
    m.ack_range(0, 9)
    m.ack_cumulative(3)
    m.restart()
    m.reset(2)
    m.mark_delete_agrees()
    m.is_acked_agrees()
    m.entries_agree()
    m.ranges_are_canonical()
