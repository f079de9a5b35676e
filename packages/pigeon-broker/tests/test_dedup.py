"""Deduplication (pushed vs persisted sequence ids): unit tests and a stateful test of a
producer, a broker and an in-order ledger against a model of what is stored."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pigeon.broker._dedup import Decision, Deduplication
from pigeon.core.errors import ServiceUnavailable


def test_a_resend_of_an_in_flight_batch_is_never_answered_as_a_duplicate() -> None:
    d = Deduplication()
    d.pushed("p", 0, 10)
    assert d.check("p", 0, 10) is Decision.IN_FLIGHT
    answers: list[tuple[object, object]] = []
    d.wait("p", 0, 10, lambda r, e: answers.append((r, e)))
    assert answers == []
    d.persisted("p", 0, 10, (7, 3, 100))
    assert answers == [((7, 3, 100), None)]  # the original's real position
    assert d.check("p", 0, 10) is Decision.DUPLICATE
    assert d.receipt("p", 0, 10) == (7, 3, 100)


def test_a_failed_append_makes_its_resend_new_again() -> None:
    d = Deduplication()
    d.pushed("p", 0, 5)
    d.pushed("p", 5, 5)
    answers: list[tuple[object, object]] = []
    d.wait("p", 5, 5, lambda r, e: answers.append((r, e)))
    d.persisted("p", 0, 5, (1, 0, 0))
    err = ServiceUnavailable("not stored")
    d.failed("p", 5, 5, err)
    assert answers == [(None, err)]
    assert d.check("p", 5, 5) is Decision.NEW
    assert d.persisted_sequence("p") == 4
    assert d.pushed_sequence("p") == 4


def test_duplicate_receipt_names_the_stored_original() -> None:
    d = Deduplication(recent_entries=2)
    for i in range(5):
        d.pushed("p", i * 10, 10)
        d.persisted("p", i * 10, 10, (1, i, i * 10))
    assert d.receipt("p", 40, 10) == (1, 4, 40)
    assert d.receipt("p", 30, 10) == (1, 3, 30)
    # forgotten (older than the window): still a duplicate, position unknown
    assert d.check("p", 0, 10) is Decision.DUPLICATE
    assert d.receipt("p", 0, 10) is None


def test_restore_and_replay_rebuild_the_persisted_state() -> None:
    d = Deduplication()
    d.restore({"p": 9})
    d.replay([("p", 10, 5, (3, 0, 50)), ("q", 0, 1, (3, 1, 55))])
    assert d.persisted_map() == {"p": 14, "q": 0}
    assert d.check("p", 10, 5) is Decision.DUPLICATE
    assert d.receipt("p", 10, 5) == (3, 0, 50)
    assert d.check("p", 15, 1) is Decision.NEW


class BrokerWithLedger(RuleBasedStateMachine):
    """A client sends batches (and resends its pending ones after a re-attach); the
    broker decides with Deduplication; the ledger stores in-flight appends in order or
    fails a suffix of them.  Checks: nothing is stored twice, nothing is acknowledged
    that is not stored, and every answer names the stored position."""

    def __init__(self) -> None:
        super().__init__()
        self.d = Deduplication(recent_entries=8)
        self.next_seq = 0
        self.client_pending: list[tuple[int, int]] = []  # (first, count), unanswered
        self.ledger: list[tuple[int, int, list]] = []  # in-flight appends (first, n, cbs)
        self.stored: list[tuple[int, int]] = []  # the log: (first, count)
        self.acked: dict[int, tuple[int, int, int]] = {}  # first -> receipt
        self.answers = 0
        self.fenced = False  # a send was not stored: sends refused until re-attach

    def _answer(self, first: int):  # type: ignore[no-untyped-def]
        def cb(receipt, error) -> None:  # type: ignore[no-untyped-def]
            self.answers += 1
            if error is None:
                assert receipt is not None
                self.acked[first] = receipt
                self.client_pending = [p for p in self.client_pending if p[0] != first]

        return cb

    def _send(self, first: int, count: int) -> None:
        if self.fenced:
            return  # refused with a retriable error: stays pending on the client
        decision = self.d.check("p", first, count)
        cb = self._answer(first)
        if decision is Decision.DUPLICATE:
            receipt = self.d.receipt("p", first, count)
            assert (first, count) in self.stored, "answered duplicate but never stored"
            if receipt is not None:
                cb(receipt, None)
            else:
                cb((-1, -1, -1), None)
        elif decision is Decision.IN_FLIGHT:
            assert any(f == first for f, _n, _c in self.ledger)
            self.d.wait("p", first, count, cb)
        else:
            self.d.pushed("p", first, count)
            self.ledger.append((first, count, [cb]))

    @rule(count=st.integers(1, 4))
    def send_new(self, count: int) -> None:
        first = self.next_seq
        self.next_seq += count
        self.client_pending.append((first, count))
        self._send(first, count)

    @rule()
    def reattach_and_resend(self) -> None:
        self.fenced = False
        for first, count in list(self.client_pending):
            self._send(first, count)

    @precondition(lambda self: self.ledger)
    @rule()
    def ledger_stores_next(self) -> None:
        first, count, cbs = self.ledger.pop(0)
        assert (first, count) not in self.stored, "stored twice"
        self.stored.append((first, count))
        receipt = (1, len(self.stored) - 1, first)
        self.d.persisted("p", first, count, receipt)
        for cb in cbs:
            cb(receipt, None)

    @precondition(lambda self: self.ledger)
    @rule(data=st.data())
    def ledger_fails_a_suffix(self, data: st.DataObject) -> None:
        k = data.draw(st.integers(0, len(self.ledger) - 1))
        failed, self.ledger = self.ledger[k:], self.ledger[:k]
        err = ServiceUnavailable("not stored")
        self.fenced = True
        for first, count, cbs in failed:
            self.d.failed("p", first, count, err)
            for cb in cbs:
                cb(None, err)

    @invariant()
    def acknowledged_means_stored(self) -> None:
        stored_firsts = {f for f, _n in self.stored}
        for first, receipt in self.acked.items():
            assert first in stored_firsts
            if receipt[1] >= 0:
                assert self.stored[receipt[1]][0] == first, "receipt names another entry"

    @invariant()
    def log_is_in_sequence_order_without_duplicates(self) -> None:
        firsts = [f for f, _n in self.stored]
        assert firsts == sorted(set(firsts)), f"log out of order or duplicated: {firsts}"


BrokerWithLedger.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_broker_with_ledger = BrokerWithLedger.TestCase
