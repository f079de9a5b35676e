"""ManagedLedger's write lifecycle against a scripted replication policy and an
in-memory metadata store (``ledger_fakes``): failed writers, recovery, shrinking
ensembles, bookies coming back, metadata hiccups and a takeover by another broker.

What a user would notice is checked: every append is answered exactly once; every
success is really in the log (read back), at the offset it was given; offsets are dense;
and the ledger recovers by itself.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import trio
from ledger_fakes import LedgerWorld, ledger_world, log, log_offsets, settle

from pigeon.broker._ledger import ManagedLedger
from pigeon.core.errors import (
    ConnectionClosed,
    NotEnoughBookies,
    NotOwner,
    PigeonError,
    StorageError,
)
from pigeon.core.paths import segment_path


@pytest.fixture
async def world() -> AsyncIterator[LedgerWorld]:
    """The default ledger world (three bookies, Qw = Qa = 2); the tests ask for trio's
    ``autojump_clock`` too (pytest-trio takes the clock from the test's own arguments)."""
    async with ledger_world() as world:
        yield world


@pytest.fixture
async def ledger(world: LedgerWorld) -> ManagedLedger:
    """The ledger of ``world``, opened (the topic's first owner)."""
    return await world.open()


async def test_a_failed_writer_loses_nothing_and_keeps_offsets_dense(
    world: LedgerWorld, ledger: ManagedLedger, autojump_clock: trio.testing.MockClock
) -> None:
    for i in range(5):
        world.append(ledger, i)
    w1 = world.writer
    w1.store(1)  # 0, 1 acknowledged
    w1.store(2, ack=False)  # 2 reached the bookies, its ack did not come back
    w1.fail(StorageError("bookie b2 died"))
    await settle()
    assert len(world.cluster.writers) == 2, "no new segment after the writer failed"
    world.writer.store(10)
    await settle()
    world.results.check_once()
    assert world.results.errors() == {}
    offsets = [world.results.ok()[i][2] for i in range(5)]
    assert offsets == [0, 2, 4, 6, 8]
    assert await log(ledger) == [(o, 2) for o in offsets]
    assert ledger.next_offset == 10


async def test_one_bookie_down_of_three_shrinks_the_ensemble_and_writes_go_on(
    world: LedgerWorld, ledger: ManagedLedger, autojump_clock: trio.testing.MockClock
) -> None:
    world.append(ledger, 0)
    world.writer.store(0)
    # b3 dies, still registered (its session has not expired)
    world.cluster.dead.add("b3")
    world.append(ledger, 1)
    world.writer.fail(ConnectionClosed("b3 is gone"))
    await settle()
    ensemble, qw, qa = world.policy.created[-1]
    assert sorted(ensemble) == ["b1", "b2"] and (qw, qa) == (2, 2)
    world.writer.store(10)
    world.append(ledger, 2)
    world.writer.store(10)
    await settle()
    world.results.check_once()
    assert world.results.errors() == {}
    assert await log_offsets(ledger) == [0, 2, 4]
    # b3 back: after its quarantine, a new segment has the full ensemble again
    world.cluster.dead.discard("b3")
    await trio.sleep(10)
    ledger._start_roll()
    await settle()
    assert sorted(world.policy.created[-1][0]) == ["b1", "b2", "b3"]


async def test_too_few_bookies_fail_with_a_retriable_error_and_writes_resume(
    world: LedgerWorld, ledger: ManagedLedger, autojump_clock: trio.testing.MockClock
) -> None:
    world.append(ledger, 0)
    world.writer.store(0)
    world.cluster.dead |= {"b2", "b3"}
    world.cluster.registered = ["b1", "b2", "b3"]
    world.append(ledger, 1)
    world.append(ledger, 2)
    world.writer.fail(ConnectionClosed("b2 and b3 are gone"))
    await settle()
    errors = world.results.errors()
    assert set(errors) == {1, 2}
    assert all(isinstance(e, PigeonError) and e.retriable for e in errors.values())
    with pytest.raises(NotEnoughBookies):
        world.append(ledger, 3)
    assert ledger.next_offset == 2, "failed appends must not keep their offsets"
    # the bookies return: the ledger is writable again without anyone's help
    world.cluster.dead.clear()
    with trio.fail_after(30):
        while ledger.unavailable is not None:  # noqa: ASYNC110
            await trio.sleep(0.1)
    world.append(ledger, 4)
    world.writer.store(10)
    await settle()
    world.results.check_once()
    assert world.results.ok()[4][2] == 2
    assert await log_offsets(ledger) == [0, 2]


async def test_a_rollover_that_fails_on_metadata_is_retried(
    world: LedgerWorld, ledger: ManagedLedger, autojump_clock: trio.testing.MockClock
) -> None:
    world.append(ledger, 0)
    world.store.fail_sets = 4  # the metadata server is away for a while
    world.writer.fail(StorageError("bookie failed"))
    world.append(ledger, 1)  # queued while rolling
    await trio.sleep(20)
    world.writer.store(10)
    await settle()
    world.results.check_once()
    assert world.results.errors() == {}
    assert await log_offsets(ledger) == [0, 2]


async def test_a_ledger_taken_over_by_another_broker_fails_pending_appends_retriably(
    world: LedgerWorld, ledger: ManagedLedger, autojump_clock: trio.testing.MockClock
) -> None:
    fenced: list[bool] = []
    ledger.on_fenced = lambda: fenced.append(True)
    world.append(ledger, 0)
    # another broker recovers and closes our segment, and appends one of its own
    doc = json.loads(world.store.nodes[ledger.path].value)
    doc["segments"][-1]["state"] = "closed"
    doc["segments"].append(dict(doc["segments"][-1], id=999))
    await world.store.set(ledger.path, json.dumps(doc).encode())
    world.writer.fail(StorageError("segment fenced"))
    await settle()
    world.results.check_once()
    assert isinstance(world.results.errors()[0], NotOwner)
    assert fenced == [True]
    with pytest.raises(PigeonError):
        world.append(ledger, 1)


async def test_close_with_writes_that_do_not_drain_leaves_the_segment_for_recovery(
    world: LedgerWorld, ledger: ManagedLedger, autojump_clock: trio.testing.MockClock
) -> None:
    world.append(ledger, 0)
    world.append(ledger, 1)
    world.writer.store(0)
    world.writer.store(1, ack=False)  # stored, never acknowledged
    await ledger.close()
    world.results.check_once()
    assert set(world.results.errors()) == {1}
    doc = json.loads(world.store.nodes[ledger.path].value)
    assert doc["segments"][-1]["state"] == "open", "the next owner must recover it"
    # the next owner finds entry 1 (stored although its append failed here)
    other = await world.open()
    assert await log_offsets(other) == [0, 2]
    assert other.next_offset == 4


async def test_an_empty_segment_dropped_on_open_leaves_no_metadata_behind(
    world: LedgerWorld, autojump_clock: trio.testing.MockClock
) -> None:
    """A segment opened and never written (its owner died) is dropped when the ledger is
    opened again; its ``/pigeon/segments`` node went with it, or the bookies' garbage
    collector, which removes segments whose node is gone, would keep its files forever."""
    first = await world.open()
    world.append(first, 0)
    world.writer.store(0)
    first._start_roll()  # a new, empty tail segment
    await settle()
    empty = first.segments[-1].id
    assert segment_path(empty) in world.store.nodes
    # the owner dies; another opens the ledger
    second = await world.open()
    assert empty not in [s.id for s in second.segments]
    assert segment_path(empty) not in world.store.nodes
    assert await log_offsets(second) == [0]


async def test_every_stored_append_is_timed_and_failed_ones_are_not(
    world: LedgerWorld, ledger: ManagedLedger, autojump_clock: trio.testing.MockClock
) -> None:
    """The ledger measures its own publish latency (accepted to stored), from its first
    append on; the metrics endpoint only exports it."""
    for i in range(3):
        world.append(ledger, i)
    world.writer.store(1)
    assert ledger.publish_latency.count == 2
    world.cluster.dead.update({"b1", "b2", "b3"})
    world.writer.fail(ConnectionClosed("every bookie is gone"))
    await settle()
    assert world.results.errors(), "the append in flight fails when no bookie is left"
    assert ledger.publish_latency.count == 2
    assert ledger.publish_latency.sum >= 0
