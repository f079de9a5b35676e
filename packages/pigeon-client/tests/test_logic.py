"""ProducerLogic without I/O: the one seal path, the one batch-size guard, and the receipt
handler that turns a batch's receipt into its messages' MessageIds."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest

from pigeon.client._core import BatchCompletion, ProducerCore, Router
from pigeon.client._engine import PendingBatch
from pigeon.client._handles import codecs_of
from pigeon.client._logic import ProducerLogic
from pigeon.client._message import MessageId, receipt_message_id
from pigeon.core import PluginManager


class Recorder:
    def __init__(self) -> None:
        self.submitted: list[PendingBatch] = []
        self.timers: list[tuple[int, int]] = []
        self.done: list[int] = []

    def logic(
        self,
        *,
        max_message_size: int = 5 * 1024 * 1024,
        max_delay: float = 1.0,
        clock: Any = None,
    ) -> Any:
        core = ProducerCore(
            producer_name="p",
            codec=codecs_of(PluginManager()).by_name("none"),
            partition=-1,
            max_messages=1000,
            max_bytes=1 << 30,
            max_message_size=max_message_size,
            first_sequence_id=0,
        )
        logic = ProducerLogic(
            ["engine"],
            [core],
            Router("round_robin", 1),
            max_delay=max_delay,
            submit=lambda engine, batch: self.submitted.append(batch),
            start_timer=lambda index, generation: self.timers.append((index, generation)),
            clock=clock,
        )
        logic.callback_for = lambda c, s, p: BatchCompletion(c, s, p, self.done.append)
        return logic


@pytest.mark.parametrize("path", ["add_plain", "add"])
def test_a_batch_is_sealed_before_a_message_that_would_take_it_past_the_limit(path: str) -> None:
    rec = Recorder()
    logic = rec.logic(max_message_size=4096)
    for _ in range(40):
        if path == "add_plain":
            logic.add_plain(b"x" * 300, None, None, 0)
        else:
            logic.add(b"x" * 300, None, None, 0, 0, None)
    logic.seal_all()
    assert len(rec.submitted) > 1
    assert all(len(b.payload) <= 4096 for b in rec.submitted)
    assert sum(b.num_messages for b in rec.submitted) == 40
    # consecutive sequence ids across the batches
    firsts = [b.sequence_id for b in rec.submitted]
    assert firsts == [sum(b.num_messages for b in rec.submitted[:i]) for i in range(len(firsts))]


def test_the_timer_seals_only_the_batch_it_was_started_for() -> None:
    rec = Recorder()
    logic = rec.logic()
    logic.add_plain(b"a", None, None, 0)
    assert rec.timers == [(0, 1)]
    logic.seal_all()
    logic.add_plain(b"b", None, None, 0)
    assert rec.timers == [(0, 1), (0, 2)]
    logic.timer_fired(0, 1)  # the first batch was sealed already
    assert [b.num_messages for b in rec.submitted] == [1]
    logic.timer_fired(0, 2)
    assert [b.num_messages for b in rec.submitted] == [1, 1]
    logic.timer_fired(0, 2)
    assert len(rec.submitted) == 2


@pytest.mark.parametrize("path", ["add_plain", "add"])
def test_a_due_batch_leaves_with_the_next_message_though_its_timer_is_late(path: str) -> None:
    # the timer of a face on another thread starts late and an event loop's timer fires
    # late: a steady producer's batch must leave max_delay after its first message
    now = [100.0]
    rec = Recorder()
    logic = rec.logic(max_delay=0.001, clock=lambda: now[0])

    def add(value: bytes) -> None:
        if path == "add_plain":
            logic.add_plain(value, None, None, 0)
        else:
            logic.add(value, None, None, 0, 0, None)

    add(b"a")
    assert logic.cores[0].due == pytest.approx(100.001)
    now[0] += 0.0005
    add(b"b")
    assert rec.submitted == []  # not due yet
    now[0] += 0.0006
    add(b"c")  # due: the batch leaves now, with this message
    assert [b.num_messages for b in rec.submitted] == [3]
    add(b"d")  # opens the next batch, due max_delay from now
    assert rec.timers == [(0, 1), (0, 2)]
    assert logic.cores[0].due == pytest.approx(now[0] + 0.001)
    logic.timer_fired(0, 1)  # the late timer of the batch that left: nothing happens
    assert [b.num_messages for b in rec.submitted] == [3]


def test_without_a_clock_only_the_timer_seals_a_batch_that_is_not_full() -> None:
    rec = Recorder()
    logic = rec.logic(max_delay=0.001)
    for i in range(5):
        logic.add_plain(b"%d" % i, None, None, 0)
    assert rec.submitted == []
    logic.timer_fired(0, 1)
    assert [b.num_messages for b in rec.submitted] == [5]


def test_a_receipt_resolves_every_message_of_its_batch() -> None:
    rec = Recorder()
    logic = rec.logic()
    futures = [logic.add_plain(b"v%d" % i, None, None, 0) for i in range(3)]
    plain: concurrent.futures.Future[MessageId] = concurrent.futures.Future()
    logic.add(b"w", None, None, 0, 0, plain)
    called: list[Any] = []
    logic.add(b"z", None, None, 0, 0, lambda mid, err: called.append((mid, err)))
    logic.seal_all()
    (batch,) = rec.submitted
    assert batch.num_messages == 5
    batch.callback((7, 8, 100, False), None)
    assert [f.result(0) for f in futures] == [MessageId(7, 8, i, -1, 100 + i) for i in range(3)]
    assert [f.result(0).offset for f in futures] == [100, 101, 102]
    assert plain.result(0) == MessageId(7, 8, 3) and plain.result(0).offset == 103
    assert called == [(MessageId(7, 8, 4), None)]
    assert rec.done == [5]


def test_a_failed_batch_fails_every_message() -> None:
    rec = Recorder()
    logic = rec.logic()
    future = logic.add_plain(b"v", None, None, 0)
    logic.seal_all()
    error = RuntimeError("lost")
    rec.submitted[0].callback(None, error)
    assert future.exception(0) is error
    assert rec.done == [1]


def test_an_unknown_first_offset_leaves_every_offset_unknown() -> None:
    assert receipt_message_id((1, 2, -1, False), 3, 0).offset == -1
    assert receipt_message_id((1, 2, 10, True), 3, 0) == MessageId(1, 2, 3, 0)


def test_plain_and_keyed_messages_mixed_in_one_batch_keep_their_values_keys_and_ids() -> None:
    # add_plain's hot path appends values alone; a keyed message, a callback or a plain
    # future may come between them in the same batch, and each keeps its own place
    from pigeon.core.batch import decode_batch

    rec = Recorder()
    logic = rec.logic()
    first = logic.add_plain(b"a", None, None, 0)  # opens the batch
    second = logic.add_plain(b"bb", None, None, 0)  # the hot path
    called: list[Any] = []
    logic.add(b"c", None, None, 0, 0, lambda mid, err: called.append(mid))  # add's hot path
    logic.add_plain(b"d", "k", None, 0)  # a key: the general path
    fourth = logic.add_plain(b"", None, None, 0)  # an empty value after a key
    logic.seal_all()
    (batch,) = rec.submitted
    decoded = decode_batch(batch.payload, codecs_of(PluginManager()))
    assert decoded.values() == [b"a", b"bb", b"c", b"d", b""]
    assert [decoded.key(i) for i in range(5)] == [None, None, None, b"k", None]
    batch.callback((3, 4, 50, False), None)
    assert [f.result(0).batch_index for f in (first, second, fourth)] == [0, 1, 4]
    assert called == [MessageId(3, 4, 2)] and called[0].offset == 52
    assert rec.done == [5]
