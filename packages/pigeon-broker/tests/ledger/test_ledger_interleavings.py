"""Hostile tests of ManagedLedger's write side (issue #12): precise interleavings with the
scripted writer/policy of ``ledger_fakes`` (``test_ledger_programs`` runs random programs
over the same fakes).

What a user would notice is checked: every append is answered exactly once; every success
is in the log at the offset and position it was given, in append order; the offsets of the
log are dense from 0; with too few bookies an append gets a clear retriable error instead
of waiting; and the ledger is writable again by itself once the bookies are back.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
import trio
import trio.testing
from ledger_fakes import (
    ListingStore,
    ScriptedPolicy,
    ScriptedWriter,
    ledger_world,
    log_offsets,
    open_ledger,
    settle,
)
from recovery_fakes import RecoveringPolicy

from pigeon.broker._ledger import LedgerConfig
from pigeon.core.errors import (
    ConnectionClosed,
    PigeonError,
    ServiceUnavailable,
    StorageError,
)

# ------------------------------------------------------------------ interleavings


async def test_appends_get_a_retriable_error_when_the_failed_segment_cannot_be_recovered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two bookies of three die under a writer (Qa=2): the segment cannot be recovered
    (fencing needs two answers), so the rollover cannot finish.  Appends must not wait
    for as long as the bookies are away: the ones in no segment fail with a retriable
    error, new ones are refused with one, and the ledger is writable again by itself
    once the bookies return.

    Before the fix: the rollover retried the recovery forever while ``_writer`` was still
    set, so ``unavailable`` was never set and no pending append failed: producers waited
    (and every new append was queued, unbounded) for as long as the bookies were away."""
    async with ledger_world(RecoveringPolicy, store=ListingStore) as world:
        ledger = await world.open()
        world.append(ledger, 0)
        world.writer.store(0)
        world.append(ledger, 1)  # in the failing segment: its fate needs recovery
        world.cluster.dead |= {"b2", "b3"}
        world.writer.fail(ConnectionClosed("b2 and b3 are gone"))
        world.append(ledger, 2)  # in no segment yet
        await trio.sleep(30)
        assert 2 in world.results.answers, "an append in no segment waited 30 s for a dead cluster"
        assert (
            isinstance(world.results.errors()[2], PigeonError)
            and world.results.errors()[2].retriable
        )
        with pytest.raises(PigeonError) as refused:
            world.append(ledger, 3)
        assert refused.value.retriable
        # the bookies return: recovery settles append 1 and writes go on by themselves
        world.cluster.dead.clear()
        for _ in range(120):
            if ledger.unavailable is None and not ledger._rolling:
                break
            await trio.sleep(0.5)
        assert ledger.unavailable is None, "not writable 60 s after the bookies returned"
        world.append(ledger, 4)
        world.writer.store(100)
        await settle()
        world.results.check_once()
        ok = world.results.ok()
        assert 1 not in ok or ok[1][2] == 2
        offsets = await log_offsets(ledger)
        assert offsets == list(range(0, 2 * len(offsets), 2)), offsets
        assert ok[4][2] == offsets[-1]


async def test_recovery_below_the_acknowledged_entries_does_not_cut_them_off(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Recovery that finds fewer entries than the writer had acknowledged (a copy lost
    meanwhile) must not close the segment below entries that producers were told are
    stored: they stay in the log (readable, or reported as damaged) and the offsets of
    the log stay dense.

    Before the fix: the segment was closed at the recovered end; acknowledged entries
    vanished from the log and their offsets became a hole."""
    async with ledger_world(store=ListingStore) as world:
        ledger = await world.open()
        for i in range(4):
            world.append(ledger, i)
        w1 = world.writer
        w1.store(2)  # 0..2 acknowledged
        seg = w1.segment_id
        del world.cluster.segments[seg][2]  # ... and the copies of entry 2 are lost
        w1.fail(StorageError("bookie failed"))
        await settle()
        world.writer.store(100)
        await settle()
        world.results.check_once()
        ok = world.results.ok()
        assert set(ok) == {0, 1, 2, 3}
        doc = json.loads(world.store.nodes[ledger.path].value)
        first = next(s for s in doc["segments"] if s["id"] == seg)
        assert first["last_entry_id"] >= 2, "an acknowledged entry was cut off the segment"
        # the offsets a consumer sees are dense: the next segment starts after entry 2
        second = next(s for s in doc["segments"] if s["id"] != seg)
        assert second["first_offset"] == ok[3][2] == 6


async def test_close_during_a_rollover_leaves_no_open_segment_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """close() while a size-based rollover is opening the next segment: the ledger must
    end with its last segment closed (nobody writes to it) and no writer left open."""
    async with ledger_world(store=ListingStore) as world:
        ledger = await world.open(config=LedgerConfig(max_entries_per_segment=2))
        world.append(ledger, 0)
        world.append(ledger, 1)  # the segment is full: a rollover starts
        world.writer.store(1)
        await ledger.close()
        await settle()
        world.results.check_once()
        assert set(world.results.ok()) == {0, 1}
        doc = json.loads(world.store.nodes[ledger.path].value)
        assert all(s["state"] == "closed" for s in doc["segments"]), doc["segments"]
        assert all(w.closed for w in world.cluster.writers), "a writer was left open after close"


async def test_close_while_a_rollover_cannot_finish_answers_every_append_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """close() gives up waiting for a rollover stuck on recovery (bookies away): every
    pending append is answered once, and the stuck rollover does not open a segment
    after the close once the bookies return."""
    async with ledger_world(RecoveringPolicy, store=ListingStore) as world:
        ledger = await world.open()
        world.append(ledger, 0)
        world.append(ledger, 1)
        w1 = world.writer
        w1.store(1, ack=False)
        world.cluster.dead |= {"b2", "b3"}
        w1.fail(ConnectionClosed("b2 and b3 are gone"))
        await trio.sleep(1)
        await ledger.close()
        world.cluster.dead.clear()
        await trio.sleep(30)
        world.results.check_once()
        assert set(world.results.answers) == {0, 1}
        doc = json.loads(world.store.nodes[ledger.path].value)
        opened_after_close = [s for s in doc["segments"] if s["id"] != w1.segment_id]
        assert opened_after_close == [], "a segment was opened after the ledger was closed"
        # the next owner finds what the bookies hold, densely
        other = await world.open()
        assert await log_offsets(other) == [0, 2]


class SlowRecoveryPolicy(ScriptedPolicy):
    """Recovery takes ``delay`` seconds (fences and reads waiting on slow bookies)."""

    delay = 15.0

    async def recover(self, segment_id: int, ensemble: Any, **kw: Any) -> int:
        await trio.sleep(self.delay)
        return await super().recover(segment_id, ensemble, **kw)


async def test_a_rollover_that_outlives_close_opens_no_segment_after_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """close() stops waiting for a rollover whose recovery is slow (10 s): when the
    recovery ends later, the rollover must not open (and leave open, with a live writer)
    a new segment of a ledger that is closed, possibly owned by another broker by then."""
    async with ledger_world(SlowRecoveryPolicy, store=ListingStore) as world:
        ledger = await world.open()
        world.append(ledger, 0)
        w1 = world.writer
        w1.store(0, ack=False)
        w1.fail(StorageError("bookie failed"))
        await trio.sleep(1)
        await ledger.close()  # gives up after 10 s; recovery ends at 15 s
        await trio.sleep(30)
        world.results.check_once()
        assert set(world.results.answers) == {0}
        doc = json.loads(world.store.nodes[ledger.path].value)
        assert [s["id"] for s in doc["segments"]] == [w1.segment_id], (
            "a segment was opened after the ledger was closed"
        )
        assert all(w.closed for w in world.cluster.writers), "a writer was left open after close"


async def test_an_old_owner_with_no_segment_left_cannot_erase_the_new_owners_segment(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Broker A's ledger has no segment (a new topic whose first segment cannot be opened:
    A sees too few bookies) and keeps retrying.  Broker B takes the topic over, opens a
    segment and acknowledges messages.  A's next attempt must find out it is no longer the
    owner, and leave B's segment alone.

    Before the fix: ``_save`` took every segment below A's first one (which is A's new
    segment) as trimmed by A, so B's segment did not count as "unknown": A overwrote the
    ledger's metadata with its own segment, and B's acknowledged messages were gone from
    the log."""
    a_sees = ["b1"]
    async with ledger_world(RecoveringPolicy, store=ListingStore) as world:
        # no segment: too few bookies for A
        a = await open_ledger(world.nursery, world.store, world.policy, lambda: a_sees)
        assert a.unavailable is not None and not a.segments
        b = await world.open()
        for i in range(3):
            world.append(b, i)
        world.writer.store(10)
        await settle()
        assert sorted(world.results.ok()) == [0, 1, 2]
        a_sees[:] = ["b1", "b2", "b3"]  # A's next attempt can open a segment
        await trio.sleep(5)
        world.results.check_once()
        other = await world.open()
        assert await log_offsets(other) == [0, 2, 4], (
            "acknowledged messages of the new owner are gone from the log"
        )
        assert a.closed, "the old owner did not notice it lost the ledger"


class PausedBookiesPolicy(RecoveringPolicy):
    """Bookies in ``paused`` do not answer: a recovery needing them times out (after
    RECOVERY_OP_TIMEOUT_S, 5 s) instead of failing at once."""

    paused: set[str] = set()

    async def recover(self, segment_id: int, ensemble: Any, **kw: Any) -> int:
        qa = kw.get("ack_quorum") or self.ack_quorum
        answering = [b for b in ensemble if b not in self.paused and b not in self.cluster.dead]
        if len(answering) < len(ensemble) - min(qa, len(ensemble)) + 1:
            await trio.sleep(5.0)
            raise ServiceUnavailable(f"cannot recover segment {segment_id}: fence timed out")
        return await super().recover(segment_id, ensemble, **kw)


async def test_appends_fail_within_seconds_when_recovery_times_out_on_paused_bookies(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two bookies of three are paused (SIGSTOP) under a writer: each recovery attempt
    waits 5 s for their fence answers.  An append in no segment must get its retriable
    error within about 15 s (the producer's send timeout is 30 s), not after as many
    attempts as a fast failure makes in that time."""
    async with ledger_world(PausedBookiesPolicy, store=ListingStore) as world:
        world.policy.paused = {"b2", "b3"}
        ledger = await world.open()
        world.append(ledger, 0)
        world.writer.fail(ConnectionClosed("b2 and b3 stalled"))
        world.append(ledger, 1)
        await trio.sleep(16)
        assert 1 in world.results.answers, "an append waited 16 s for paused bookies"
        world.policy.paused = set()
        await trio.sleep(30)
        world.writer.store(100)
        await settle()
        world.results.check_once()
        assert ledger.unavailable is None


async def test_a_rollover_cancelled_with_its_nursery_answers_every_append_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The broker shuts down (its nursery is cancelled) in the middle of a rollover:
    every pending append is answered once, with a retriable error, and the segment is
    left open for the next owner's recovery."""
    async with ledger_world(SlowRecoveryPolicy, store=ListingStore) as world:
        async with trio.open_nursery() as nursery:
            ledger = await world.open(nursery)
            for i in range(3):
                world.append(ledger, i)
            world.writer.store(0)
            world.writer.store(1, ack=False)
            world.writer.fail(StorageError("bookie failed"))
            world.append(ledger, 3)
            await trio.sleep(2)  # the rollover is recovering the segment
            nursery.cancel_scope.cancel()
        world.results.check_once()
        assert set(world.results.answers) == {0, 1, 2, 3}
        assert set(world.results.ok()) == {0}
        assert all(e.retriable for e in world.results.errors().values())
        other = await world.open()
        assert await log_offsets(other) == [0, 2]


async def test_an_ensemble_change_that_fails_on_metadata_does_not_quarantine_its_choice(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The writer replaces a failed bookie (b3) and the metadata write of the new
    fragment fails once.  The retry must replace b3 again -- with the healthy spare (b4),
    not quarantine b4 as if it had failed -- and the segment's ensemble must be the one
    the metadata and the writer agree on.

    Before the fix: the failed attempt left b4 in the segment's ensemble in memory, so
    the retry quarantined b4 (the bookie at the failed index now) and found no spare:
    the ensemble change stalled for the quarantine (entries under-replicated meanwhile,
    failing with Qw == Qa)."""
    async with ledger_world(bookies=["b1", "b2", "b3", "b4"], store=ListingStore) as world:
        ledger = await world.open()
        seg = ledger.segments[-1]
        index = seg.ensemble.index("b3") if "b3" in seg.ensemble else 2
        failed = seg.ensemble[index]
        spare = next(b for b in world.cluster.registered if b not in seg.ensemble)
        world.store.fail_sets = 1
        with pytest.raises(PigeonError):
            await ledger._replace_bookie(seg, index, 0)
        assert seg.ensemble[index] == failed, "a failed change left its choice in the ensemble"
        address = await ledger._replace_bookie(seg, index, 0)
        assert address == spare
        doc = json.loads(world.store.nodes[ledger.path].value)
        assert doc["segments"][-1]["ensemble"] == seg.ensemble
        assert spare not in ledger._quarantine, "the healthy spare was quarantined"


async def test_a_late_ensemble_change_does_not_rewrite_a_closed_segment(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A writer's ensemble change still under way (waiting for a spare bookie) when its
    segment is closed by a rollover: once a spare appears, the change must not record a
    fragment in the closed segment (its entries are on the old bookies; readers would be
    sent to a bookie that holds none of them)."""
    replacers: list[Any] = []
    async with ledger_world(store=ListingStore) as world:
        create = world.policy.create_writer

        async def create_writer(segment_id: int, ensemble: Any, **kw: Any) -> ScriptedWriter:
            replacers.append(kw["replace_bookie"])
            return await create(segment_id, ensemble, **kw)

        world.policy.create_writer = create_writer  # type: ignore[method-assign]
        ledger = await world.open()
        for i in range(3):
            world.append(ledger, i)
        w1 = world.writer
        w1.store(1)  # 0, 1 acknowledged; 2 in flight
        seg_id = w1.segment_id
        world.cluster.dead.add("b3")
        w1.fail(ConnectionClosed("b3 is gone"))  # the rollover closes the segment
        await settle()
        before = json.loads(world.store.nodes[ledger.path].value)["segments"][0]
        assert before["id"] == seg_id and before["state"] == "closed"
        world.cluster.registered.append("b4")  # a spare appears; the old change goes on
        with contextlib.suppress(PigeonError):
            await replacers[0](2, 3)
        after = json.loads(world.store.nodes[ledger.path].value)["segments"][0]
        assert after["fragments"] == before["fragments"], "a closed segment got a new fragment"
        assert after["ensemble"] == before["ensemble"]
