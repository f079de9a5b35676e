"""ProducerLink: unit tests plus a stateful test against a model of the broker.

The model broker de-duplicates as PigeonMQ's does (a sequence id at or below the highest it
stored is answered ``duplicate`` with the stored position, or with none if it never stored
it: that is an acknowledged loss), stores the sends of one attachment in arrival order,
and after a send it did not store (a retriable failure or a permanent refusal) refuses the
rest of that attachment and may push ``closedByBroker``.  The state machine checks what
the producer promises: nothing is sent while not attached; sends of one attachment go out
in strictly increasing sequence order; a re-attach sends the oldest waiting batch first;
batches complete in order, exactly once; no batch is acknowledged that the broker did not
store; and once the faults heal, every batch completes.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pigeon.client._engine import PendingBatch
from pigeon.client._link import LinkState, ProducerLink
from pigeon.core.errors import (
    ConnectionClosed,
    InvalidArgument,
    MessageTooLarge,
    ServiceUnavailable,
    Timeout,
)

# ------------------------------------------------------------------ unit tests


class Recorder:
    def __init__(self) -> None:
        self.done: list[tuple[int, Any, BaseException | None]] = []

    def batch(self, seq: int, n: int = 1) -> PendingBatch:
        def callback(result: Any, error: BaseException | None) -> None:
            self.done.append((seq, result, error))

        return PendingBatch(seq, n, b"", callback)

    def outcomes(self) -> list[tuple[int, type]]:
        """(sequence id, type of the error or NoneType) of each completed batch, in order."""
        return [(seq, type(e)) for seq, _r, e in self.done]


def attached() -> tuple[Recorder, ProducerLink, int]:
    """A recorder and a link attached (its epoch)."""
    link = ProducerLink()
    epoch = link.begin_attach()
    link.attach_succeeded(epoch)
    return Recorder(), link, epoch


def test_nothing_is_sent_before_the_attach_and_everything_waiting_goes_first() -> None:
    rec = Recorder()
    link = ProducerLink()
    b0, b1 = rec.batch(0), rec.batch(1)
    assert link.submit(b0) is False  # detached: kept, not sent
    epoch = link.begin_attach()
    assert link.submit(b1) is False  # attaching: kept, not sent
    assert link.attach_succeeded(epoch) == [b0, b1]
    b2 = rec.batch(2)
    assert link.submit(b2) is True  # attached: sent now, after the older ones
    link.on_result(epoch, b0, (1, 0, 0, False), None)
    assert [seq for seq, _r, _e in rec.done] == [0]


def test_a_retriable_error_detaches_and_the_reattach_resends_all_from_the_oldest() -> None:
    rec, link, epoch = attached()
    batches = [rec.batch(i) for i in range(3)]
    assert all(link.submit(b) for b in batches)
    # The broker could not store batch 0: it may not have stored 1 and 2 either.
    assert link.on_result(epoch, batches[0], None, ServiceUnavailable("ledger closed")) is True
    assert link.state is LinkState.DETACHED
    assert link.submit(rec.batch(3)) is False  # nothing goes out on the old attachment
    # Retriable answers still arriving for the attachment that was left change nothing...
    assert link.on_result(epoch, batches[1], None, ConnectionClosed()) is False
    assert link.on_result(epoch, batches[2], None, ServiceUnavailable()) is False
    assert rec.done == []
    # ...and the re-attach sends every waiting batch, oldest first.
    epoch2 = link.begin_attach()
    assert [b.sequence_id for b in link.attach_succeeded(epoch2) or []] == [0, 1, 2, 3]


def test_receipts_complete_batches_in_order() -> None:
    rec, link, epoch = attached()
    b0, b1, b2 = rec.batch(0), rec.batch(1), rec.batch(2)
    for b in (b0, b1, b2):
        link.submit(b)
    link.on_result(epoch, b1, (1, 1, 1, False), None)  # stored, but 0 still waits
    assert rec.done == []
    link.on_result(epoch, b0, (1, 0, 0, False), None)
    assert [seq for seq, _r, _e in rec.done] == [0, 1]
    link.on_result(epoch, b1, (1, 1, 1, True), None)  # a duplicate receipt: ignored
    link.on_result(epoch, b2, None, MessageTooLarge("too big"))  # refused for good
    assert rec.outcomes() == [(0, type(None)), (1, type(None)), (2, MessageTooLarge)]
    assert len(link) == 0


def test_a_receipt_from_a_left_attachment_still_counts_and_is_not_resent() -> None:
    rec, link, epoch = attached()
    b0, b1 = rec.batch(0), rec.batch(1)
    link.submit(b0)
    link.submit(b1)
    assert link.detach(epoch) is True  # closedByBroker
    link.on_result(epoch, b1, (1, 1, 1, False), None)  # b1 was stored before the close
    epoch2 = link.begin_attach()
    assert link.attach_succeeded(epoch2) == [b0]
    link.on_result(epoch2, b0, (2, 0, 0, False), None)
    assert [seq for seq, _r, _e in rec.done] == [0, 1]


def test_a_permanent_refusal_counts_whichever_attachment_brings_it() -> None:
    rec, link, epoch = attached()
    b0, b1 = rec.batch(0), rec.batch(1)
    link.submit(b0)
    link.submit(b1)
    link.detach(epoch)
    link.on_result(epoch, b0, None, InvalidArgument("corrupt batch"))
    link.on_result(epoch, b1, (1, 0, 1, False), None)
    # Batch 1 is stored: sending 0 again would be answered "duplicate" (a loss).
    assert rec.outcomes() == [(0, InvalidArgument), (1, type(None))]
    assert link.attach_succeeded(link.begin_attach()) == []


def test_closed_by_broker_while_reattaching_concerns_the_left_attachment() -> None:
    link = ProducerLink()
    epoch = link.begin_attach()
    link.attach_succeeded(epoch)
    assert link.detach(epoch) is True
    epoch2 = link.begin_attach()
    assert link.detach(epoch2) is False  # arrived before producerCreated: the old one
    assert link.attach_succeeded(epoch2) == []
    assert link.state is LinkState.ATTACHED


def test_expiry_and_fail_all_keep_the_order_and_keep_receipts() -> None:
    rec, link, epoch = attached()
    batches = [rec.batch(i) for i in range(4)]
    for t, b in enumerate(batches):
        b.created = float(t)
        link.submit(b)
    link.on_result(epoch, batches[2], (1, 2, 2, False), None)
    assert link.expire(before=1.5, timeout=10.0) == 2  # 0 and 1 time out
    assert rec.outcomes() == [(0, Timeout), (1, Timeout), (2, type(None))]
    link.fail_all(ConnectionClosed("closed"))
    assert rec.outcomes()[-1] == (3, ConnectionClosed)
    assert len(link) == 0


def test_a_refused_batch_fails_in_its_turn_without_being_sent() -> None:
    rec, link, epoch = attached()
    b0, b1 = rec.batch(0), rec.batch(1)
    assert link.submit(b0) is True
    assert link.submit(b1, refused=MessageTooLarge("over the limit")) is False
    assert rec.done == []  # waits for the older batch
    link.on_result(epoch, b0, (1, 0, 0, False), None)
    assert rec.outcomes() == [(0, type(None)), (1, MessageTooLarge)]


# ------------------------------------------------------------------ model-based


class ProducerLinkMachine(RuleBasedStateMachine):
    """The link driven by random submits, attaches, answers, drops and timeouts."""

    def __init__(self) -> None:
        super().__init__()
        self.link = ProducerLink()
        self.now = 0.0
        self.next_seq = 0
        self.batches: list[PendingBatch] = []
        self.outcomes: dict[int, list[tuple[Any, BaseException | None]]] = {}
        self.completed_seqs: list[int] = []
        # connections: sends in flight per attachment, in the order they went out
        self.inflight: dict[int, deque[PendingBatch]] = {}
        self.last_sent: dict[int, int] = {}
        # the broker
        self.stored: dict[int, tuple[int, int]] = {}  # sequence id -> position
        self.last_stored = -1
        self.entries = 0
        self.refusing: set[int] = set()  # attachments the broker closed
        self.poison: set[int] = set()  # sequence ids the broker always refuses for good
        self.receipts: list[tuple[int, PendingBatch, Any]] = []

    # -- helpers --------------------------------------------------------------------

    def _callback(self, batch: PendingBatch) -> Any:
        def callback(result: Any, error: BaseException | None) -> None:
            seq = batch.sequence_id
            assert seq not in self.outcomes, f"batch {seq} completed twice"
            self.outcomes[seq] = [(result, error)]
            assert not self.completed_seqs or self.completed_seqs[-1] < seq, (
                f"batch {seq} completed after {self.completed_seqs[-1]}"
            )
            self.completed_seqs.append(seq)
            if error is None:
                for s in range(seq, seq + batch.num_messages):
                    assert s in self.stored, f"sequence {s} acknowledged but never stored"
                assert result[:2] == self.stored[seq], "receipt does not name the stored entry"

        return callback

    def _sent(self, epoch: int, batch: PendingBatch) -> None:
        assert self.link.state is LinkState.ATTACHED and epoch == self.link.epoch, (
            "sent on an attachment that is not attached"
        )
        last = self.last_sent.get(epoch, -1)
        assert batch.sequence_id > last, f"sent {batch.sequence_id} after {last} on {epoch}"
        self.last_sent[epoch] = batch.sequence_id
        self.inflight.setdefault(epoch, deque()).append(batch)

    def _answer(self, epoch: int, batch: PendingBatch, result: Any, error: Any) -> None:
        if self.link.on_result(epoch, batch, result, error):
            assert self.link.state is LinkState.DETACHED

    def _broker_receives(self, epoch: int, batch: PendingBatch, fail: bool) -> Any:
        """What the broker does with one send; returns (result, error)."""
        seq = batch.sequence_id
        if epoch in self.refusing:
            return None, ServiceUnavailable("producer closed: not stored")
        if seq <= self.last_stored:
            return (*self.stored.get(seq, (-1, -1)), 0, True), None
        # A send it does not store ends the attachment: the broker refuses the rest of
        # it and closes the producer (else a newer batch could be stored after an older
        # one was refused, and the older one, sent again, be answered "duplicate").
        if seq in self.poison:
            self.refusing.add(epoch)
            return None, MessageTooLarge("refused for good")
        if fail:
            self.refusing.add(epoch)
            return None, ServiceUnavailable("ledger failed")
        self.entries += 1
        for s in range(seq, seq + batch.num_messages):
            self.stored[s] = (epoch, self.entries)
        self.last_stored = seq + batch.num_messages - 1
        return (epoch, self.entries, 0, False), None

    # -- rules ----------------------------------------------------------------------

    @rule(n=st.integers(1, 3), poison=st.booleans(), unbuildable=st.booleans())
    def submit(self, n: int, poison: bool, unbuildable: bool) -> None:
        seq = self.next_seq
        self.next_seq += n
        batch = PendingBatch(seq, n, b"", lambda r, e: None, created=self.now)
        batch.callback = self._callback(batch)
        self.batches.append(batch)
        if poison and n == 3:  # now and then
            self.poison.add(seq)
        refused = InvalidArgument("could not build") if unbuildable and n == 2 else None
        if self.link.submit(batch, refused):
            self._sent(self.link.epoch, batch)

    @precondition(lambda self: self.link.state is LinkState.DETACHED)
    @rule()
    def begin_attach(self) -> None:
        self.link.begin_attach()

    @precondition(lambda self: self.link.state is LinkState.ATTACHING)
    @rule(ok=st.booleans())
    def attach_done(self, ok: bool) -> None:
        epoch = self.link.epoch
        if not ok:
            self.link.attach_failed(epoch)
            assert self.link.state is LinkState.DETACHED
            return
        waiting = [b for b in self.link.pending.values() if b.outcome is None]
        batches = self.link.attach_succeeded(epoch)
        assert batches == waiting, "a re-attach must resend every waiting batch, in order"
        if batches:
            oldest = min(b.sequence_id for b in waiting)
            assert batches[0].sequence_id == oldest, "first batch after re-attach not oldest"
        for b in batches or ():
            self._sent(epoch, b)

    @precondition(lambda self: any(self.inflight.values()))
    @rule(data=st.data(), fail=st.booleans())
    def broker_answers(self, data: st.DataObject, fail: bool) -> None:
        epoch = data.draw(st.sampled_from(sorted(e for e, q in self.inflight.items() if q)))
        batch = self.inflight[epoch].popleft()
        result, error = self._broker_receives(epoch, batch, fail and data.draw(st.booleans()))
        self._answer(epoch, batch, result, error)
        if error is None:
            self.receipts.append((epoch, batch, result))
        elif epoch in self.refusing and data.draw(st.booleans()):
            self.link.detach(epoch)  # closedByBroker (the producer must not rely on it)

    @precondition(lambda self: self.link.state is LinkState.ATTACHED)
    @rule(data=st.data(), errors_first=st.booleans())
    def connection_lost(self, data: st.DataObject, errors_first: bool) -> None:
        epoch = self.link.epoch
        queue = self.inflight.pop(epoch, deque())
        reached = data.draw(st.integers(0, len(queue)))  # the broker got these; answers lost
        for batch in list(queue)[:reached]:
            self._broker_receives(epoch, batch, fail=False)
        if not errors_first:
            self.link.detach(epoch)
        for batch in queue:
            self._answer(epoch, batch, None, ConnectionClosed("connection lost"))
        self.link.detach(epoch)
        assert self.link.state is LinkState.DETACHED

    @precondition(lambda self: self.link.state is LinkState.ATTACHED)
    @rule()
    def closed_by_broker(self) -> None:
        epoch = self.link.epoch
        self.refusing.add(epoch)
        assert self.link.detach(epoch) is True

    @precondition(lambda self: bool(self.receipts))
    @rule(data=st.data())
    def duplicate_receipt(self, data: st.DataObject) -> None:
        epoch, batch, result = data.draw(st.sampled_from(self.receipts))
        self._answer(epoch, batch, result, None)

    @rule(dt=st.floats(0.5, 5.0))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self.link.expire(self.now - 10.0, 10.0)

    # -- invariants -----------------------------------------------------------------

    @invariant()
    def pending_is_in_submission_order(self) -> None:
        seqs = [b.sequence_id for b in self.link.pending.values()]
        assert seqs == sorted(seqs)
        if seqs:
            head = next(iter(self.link.pending.values()))
            assert head.outcome is None, "a completed batch is still at the head"

    @invariant()
    def completed_batches_are_not_pending(self) -> None:
        for batch in self.link.pending.values():
            assert batch.sequence_id not in self.outcomes

    def teardown(self) -> None:
        """Heal everything: every batch then completes exactly once."""
        for _ in range(4 * len(self.batches) + 4):
            if not self.link.pending:
                break
            if self.link.state is LinkState.DETACHED:
                self.begin_attach()
            if self.link.state is LinkState.ATTACHING:
                self.attach_done(True)
            epoch = self.link.epoch
            for old in [e for e in self.inflight if e != epoch]:
                for batch in self.inflight.pop(old):
                    self._answer(old, batch, None, ConnectionClosed("gone"))
            queue = self.inflight.get(epoch, deque())
            while queue and self.link.state is LinkState.ATTACHED:
                batch = queue.popleft()
                result, error = self._broker_receives(epoch, batch, fail=False)
                self._answer(epoch, batch, result, error)
            if self.link.state is LinkState.ATTACHED:
                assert not self.link.pending, "attached, nothing in flight, yet batches wait"
        assert not self.link.pending, "batches still pending after the faults healed"
        assert sorted(self.outcomes) == [b.sequence_id for b in self.batches]


TestProducerLinkMachine = ProducerLinkMachine.TestCase
TestProducerLinkMachine.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


def test_the_model_catches_a_link_that_sends_a_newer_batch_first() -> None:
    """The model is sharp: sending a new batch before the waiting ones (what the old
    client did while it re-attached) gets an older one answered "duplicate" unstored."""
    machine = ProducerLinkMachine()
    machine.begin_attach()
    machine.attach_done(True)
    for _ in range(2):
        machine.submit(1, False, False)
    machine.closed_by_broker()
    machine.inflight.clear()  # refused on the closed attachment: not stored
    machine.begin_attach()
    epoch = machine.link.epoch
    batches = machine.link.attach_succeeded(epoch) or []
    with pytest.raises(AssertionError, match="acknowledged but never stored"):
        for b in reversed(batches):
            result, error = machine._broker_receives(epoch, b, fail=False)
            machine._answer(epoch, b, result, error)
