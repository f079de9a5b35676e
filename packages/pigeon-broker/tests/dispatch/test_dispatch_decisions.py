"""Dispatcher (pigeon.broker._dispatch): its decisions case by case — subscription types,
permits, unacknowledged messages of an entry, failover, key-shared ordering, redelivery,
delayed entries and seeks.  ``test_dispatch_model`` checks them against a model.
"""

from __future__ import annotations

import pytest
from dispatch_fakes import NOW, FakeConsumer, FakeEntry, dispatcher, entries, sent

from pigeon.core.errors import ConsumerBusy, NotSupported, SubscriptionBusy

# ------------------------------------------------------------------ unit tests


def test_exclusive_refuses_a_second_consumer_and_a_type_change() -> None:
    d = dispatcher("exclusive")
    d.add_consumer(FakeConsumer(1, "a"), "exclusive")
    with pytest.raises(ConsumerBusy):
        d.add_consumer(FakeConsumer(2, "b"), "exclusive")
    with pytest.raises(SubscriptionBusy):
        d.add_consumer(FakeConsumer(3, "c"), "shared")


def test_type_follows_the_first_consumer_of_an_empty_subscription() -> None:
    d = dispatcher("exclusive")
    a = FakeConsumer(1, "a")
    d.add_consumer(a, "exclusive")
    d.remove_consumer(a)
    d.add_consumer(FakeConsumer(2, "b"), "shared")
    assert d.type == "shared"


def test_shared_goes_round_robin_among_consumers_with_permits() -> None:
    d = dispatcher("shared")
    a, b, c = FakeConsumer(1, "a"), FakeConsumer(2, "b"), FakeConsumer(3, "c")
    for x in (a, b, c):
        d.add_consumer(x, "shared")
    d.flow(a, 10)
    d.flow(c, 10)
    out = d.deliver(entries(4), NOW)
    assert [x.consumer.name for x in out] == ["a", "c", "a", "c"]
    assert a.permits == c.permits == 8 and b.permits == 0


def test_an_entry_costs_its_unacknowledged_messages_and_skips_the_acknowledged() -> None:
    d = dispatcher("exclusive")
    a = FakeConsumer(1, "a")
    d.add_consumer(a, "exclusive")
    d.flow(a, 2)
    d.cursor.ack(1)
    d.cursor.ack(3)
    (out,) = d.deliver([FakeEntry((1, 0), 0, 5)], NOW)
    assert out.skip == [1, 3]
    # the entry goes whole while permits are positive: 2 - 3 unacked messages
    assert a.permits == -1
    assert d.deliver([FakeEntry((1, 1), 5, 1)], NOW) == []
    assert not d.ready()


def test_failover_spreads_partitions_and_moves_unacked_to_the_new_active() -> None:
    names = ["a", "b", "c"]
    active = []
    for partition in range(3):
        d = dispatcher("failover", partition=partition)
        for i, name in enumerate(names):
            d.add_consumer(FakeConsumer(i, name), "failover")
        active.append(d.active_consumer().name)
    assert active == names

    d = dispatcher("failover")
    low = FakeConsumer(1, "low")
    d.add_consumer(low, "failover")
    d.flow(low, 10)
    assert sent(d.deliver(entries(2), NOW)) == [("low", (1, 0), []), ("low", (1, 1), [])]
    high = FakeConsumer(2, "high", priority=5)
    d.add_consumer(high, "failover")
    d.flow(high, 10)
    assert low.pending == set()
    assert d.take_redeliveries(10) == [(1, 0), (1, 1)]
    out = d.deliver(entries(2), NOW)
    assert [(x.consumer.name, x.redelivery_count) for x in out] == [("high", 1), ("high", 1)]


def test_a_leaving_consumer_s_entries_come_back_first_with_their_count() -> None:
    d = dispatcher("shared")
    a, b = FakeConsumer(1, "a"), FakeConsumer(2, "b")
    d.add_consumer(a, "shared")
    d.flow(a, 10)
    log = entries(3)
    d.deliver(log[:2], NOW)
    d.add_consumer(b, "shared")
    d.flow(b, 10)
    d.remove_consumer(a)
    assert d.has_redeliveries
    assert d.take_redeliveries(10) == [(1, 0), (1, 1)]
    out = d.deliver(log[:2], NOW)
    assert [(x.consumer.name, x.redelivery_count) for x in out] == [("b", 1), ("b", 1)]
    d.ack([((1, 0), 0)], cumulative=False)
    assert d.redeliveries == {(1, 1): 1}


def test_a_cumulative_ack_inside_a_batch_keeps_the_rest_of_it_pending() -> None:
    d = dispatcher("failover")
    a, b = FakeConsumer(1, "a"), FakeConsumer(2, "b")
    d.add_consumer(a, "failover")
    d.flow(a, 10)
    d.deliver([FakeEntry((1, 0), 0, 2), FakeEntry((1, 1), 2, 3)], NOW)
    d.ack([((1, 1), 3)], cumulative=True)  # offsets 0..3: offset 4 is still unacked
    assert a.pending == {(1, 1)} and list(d.pending) == [(1, 1)]
    d.remove_consumer(a)
    d.add_consumer(b, "failover")
    d.flow(b, 10)
    assert d.take_redeliveries(10) == [(1, 1)]
    (out,) = d.deliver([FakeEntry((1, 1), 2, 3)], NOW)
    assert (out.consumer, out.skip, out.redelivery_count) == (b, [0, 1], 1)


def test_cumulative_acks_are_refused_on_shared_subscriptions() -> None:
    d = dispatcher("shared")
    with pytest.raises(NotSupported):
        d.ack([((1, 0), 0)], cumulative=True)
    assert d.cursor.mark_delete == 0


def test_delayed_entries_wait_for_their_time_on_shared_only() -> None:
    for sub_type, held in (("shared", True), ("keyShared", True), ("exclusive", False)):
        d = dispatcher(sub_type)
        a = FakeConsumer(1, "a")
        d.add_consumer(a, sub_type)
        d.flow(a, 10)
        out = d.deliver(entries(1, deliver_at=NOW + 500), NOW)
        assert (out == []) is held, sub_type
        if held:
            assert d.delayed_count == 1 and d.next_due_ms() == NOW + 500
            d.release_due(NOW + 499)
            assert not d.has_redeliveries
            d.release_due(NOW + 500)
            assert d.take_redeliveries(10) == [(1, 0)]
            assert d.next_due_ms() is None


def test_key_shared_splits_an_entry_by_key_and_stalls_for_a_consumer_without_permits() -> None:
    d = dispatcher("keyShared")
    a, b = FakeConsumer(1, "a"), FakeConsumer(2, "b")
    d.add_consumer(a, "keyShared")
    d.add_consumer(b, "keyShared")
    keys = [f"k{i}".encode() for i in range(8)]
    owner = {k: d.owner_of(k).name for k in keys}
    assert set(owner.values()) == {"a", "b"}
    d.flow(a, 100)
    log = [FakeEntry((1, 0), 0, 8, keys=tuple(keys))]
    assert d.deliver(log, NOW) == []  # b has no permits: nothing overtakes
    assert d.stalled and not d.ready()  # and nothing is read again until something changes
    assert d.take_redeliveries(10) == [(1, 0)]
    d.flow(b, 100)
    assert not d.stalled and d.ready()
    out = d.deliver(log, NOW)
    for x in out:
        mine = [i for i in range(8) if i not in x.skip]
        assert {owner[keys[i]] for i in mine} == {x.consumer.name}
    assert sorted(i for x in out for i in range(8) if i not in x.skip) == list(range(8))


def test_key_shared_newcomer_waits_until_earlier_dispatches_are_acknowledged() -> None:
    d = dispatcher("keyShared")
    a = FakeConsumer(1, "a")
    d.add_consumer(a, "keyShared")
    d.flow(a, 100)
    d.deliver([FakeEntry((1, 0), 0, 1, keys=(b"k",))], NOW)
    b = FakeConsumer(2, "b")
    d.add_consumer(b, "keyShared")
    d.flow(b, 100)
    assert b.join_offset == 1
    keys = tuple(f"k{i}".encode() for i in range(16))
    later = FakeEntry((1, 1), 1, 16, keys=keys)
    out = d.deliver([later], NOW)
    assert {x.consumer.name for x in out} == {"a"}  # b's part is held
    assert d.statistics().held == 1
    d.ack([((1, 0), 0)], cumulative=False)
    assert b.join_offset is None
    assert d.take_redeliveries(10) == [(1, 1)]
    out = d.deliver([later], NOW)
    assert {x.consumer.name for x in out} == {"b"}


def test_key_shared_newcomer_waits_for_an_earlier_message_of_its_key_below_its_join() -> None:
    # A message below the newcomer's join offset that was never dispatched (here delayed;
    # also one held for another newcomer) is not a replay: while an earlier message of
    # its key is held by another consumer it must wait (found by TestKeyShared).
    d = dispatcher("keyShared")
    a = FakeConsumer(1, "a")
    d.add_consumer(a, "keyShared")
    d.flow(a, 100)
    b = FakeConsumer(2, "b")
    d.add_consumer(b, "keyShared")  # only to pick a key that will move to b
    key = next(k for k in (f"k{i}".encode() for i in range(64)) if d.owner_of(k) is b)
    d.remove_consumer(b)
    log = [
        FakeEntry((1, 0), 0, 1, keys=(key,)),
        FakeEntry((1, 1), 1, 1, NOW + 50, keys=(key,)),
        FakeEntry((1, 2), 2, 1, keys=(b"other",)),
    ]
    assert [x.entry.position for x in d.deliver(log, NOW)] == [(1, 0), (1, 2)]
    b = FakeConsumer(3, "b")
    d.add_consumer(b, "keyShared")
    d.flow(b, 100)
    assert b.join_offset == 3 and d.owner_of(key) is b
    d.release_due(NOW + 50)
    assert d.take_redeliveries(10) == [(1, 1)]
    assert d.deliver(log[1:2], NOW + 50) == []  # offset 0 of its key is still on a
    assert d.statistics().held == 1
    d.ack([((1, 0), 0)], cumulative=False)
    assert d.take_redeliveries(10) == [(1, 1)]
    assert [x.consumer for x in d.deliver(log[1:2], NOW + 50)] == [b]


def test_key_shared_redelivers_what_a_consumer_asks_for_again() -> None:
    d = dispatcher("keyShared")
    a = FakeConsumer(1, "a")
    d.add_consumer(a, "keyShared")
    d.flow(a, 10)
    log = [FakeEntry((1, 0), 0, 2, keys=(b"x", b"y")), FakeEntry((1, 1), 2, 1, keys=(b"x",))]
    d.deliver(log, NOW)
    d.ack([((1, 0), 0)], cumulative=False)
    d.redeliver_unacked(a, [(1, 0)])  # a negative ack of offset 1
    assert d.take_redeliveries(10) == [(1, 0)]
    (out,) = d.deliver(log[:1], NOW)
    assert (out.consumer, out.skip, out.redelivery_count) == (a, [0], 1)
    d.remove_consumer(a)  # everything a holds comes back, the nacked message too
    assert d.take_redeliveries(10) == [(1, 0), (1, 1)]


def test_key_shared_keeps_the_redelivery_count_while_part_of_an_entry_is_queued() -> None:
    d = dispatcher("keyShared")
    a, b = FakeConsumer(1, "a"), FakeConsumer(2, "b")
    for c in (a, b):
        d.add_consumer(c, "keyShared")
        d.flow(c, 10)
    keys = [f"k{i}".encode() for i in range(16)]
    key_a = next(k for k in keys if d.owner_of(k) is a)
    key_b = next(k for k in keys if d.owner_of(k) is b)
    entry = FakeEntry((1, 0), 0, 2, keys=(key_a, key_b))
    assert [x.consumer for x in d.deliver([entry], NOW)] == [a, b]
    d.redeliver_unacked(b, None)  # b's message: handed back once
    assert d.take_redeliveries(10) == [(1, 0)]
    d.ack([((1, 0), 0)], cumulative=False)  # a's part is settled meanwhile
    (out,) = d.deliver([entry], NOW)
    assert (out.consumer, out.skip, out.redelivery_count) == (b, [0], 1)


@pytest.mark.parametrize("sub_type", ["failover", "keyShared"])
def test_what_comes_back_during_a_read_goes_before_what_was_read(sub_type: str) -> None:
    d = dispatcher(sub_type)
    a, b = FakeConsumer(1, "a"), FakeConsumer(2, "b")
    for c, permits in ((a, 1), (b, 10)):
        d.add_consumer(c, sub_type)
        d.flow(c, permits)
    key = next(k for k in (f"k{i}".encode() for i in range(16)) if d.owner_of(k) is a)
    log = [FakeEntry((1, i), i, 1, keys=(key,)) for i in range(2)]
    assert [x.consumer for x in d.deliver(log[:1], NOW)] == [a]
    # log[1] is being read when a leaves and hands log[0] back
    d.remove_consumer(a)
    assert d.deliver(log[1:], NOW) == []
    assert d.take_redeliveries(10) == [(1, 0), (1, 1)]
    out = d.deliver(log, NOW)
    assert [(x.consumer, x.entry.position) for x in out] == [(b, (1, 0)), (b, (1, 1))]


def test_seek_forgets_everything_delivered() -> None:
    d = dispatcher("shared")
    a = FakeConsumer(1, "a")
    d.add_consumer(a, "shared")
    d.flow(a, 10)
    d.deliver(entries(2), NOW)
    d.redeliver_unacked(a, [(1, 1)])
    d.cursor.reset(0)
    d.reset()
    assert (a.pending, d.pending, d.redeliveries, d.has_redeliveries) == (set(), {}, {}, False)
