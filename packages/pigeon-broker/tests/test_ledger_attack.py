"""Hostile tests of ManagedLedger's write side (issue #12): precise interleavings with the
scripted writer/policy of ``ledger_fakes``, and a random-program test over the same
fakes (appends, acks, writer failures, bookies dying and returning, metadata hiccups,
size-based rollovers, close and takeover).

What a user would notice is checked: every append is answered exactly once; every success
is in the log at the offset and position it was given, in append order; the offsets of the
log are dense from 0; with too few bookies an append gets a clear retriable error instead
of waiting; and the ledger is writable again by itself once the bookies are back.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ledger_fakes import (
    Cluster,
    ListingStore,
    ScriptedPolicy,
    ScriptedWriter,
    ledger_world,
    log_entries,
    log_offsets,
    open_ledger,
    settle,
)

from pigeon.broker._ledger import LedgerConfig, ManagedLedger
from pigeon.core.errors import (
    ConnectionClosed,
    PigeonError,
    SegmentFenced,
    ServiceUnavailable,
    StorageError,
)

# ------------------------------------------------------------------ fakes


class FencingWriter(ScriptedWriter):
    """A scripted writer whose segment can be fenced by a recovery: from then on what
    it had in flight fails, and nothing more reaches the bookies."""

    fenced: set[int]

    def store(self, upto: int, *, ack: bool = True) -> None:
        if self.segment_id in self.fenced:
            self.fail(SegmentFenced(f"segment={self.segment_id} is fenced"))
            return
        super().store(upto, ack=ack)


class RecoveringPolicy(ScriptedPolicy):
    """Recovery as ``recover_segment`` does it: it fences the segment, and needs
    ``E - Qa + 1`` bookies of the segment's ensemble to answer, else ServiceUnavailable."""

    def __init__(self, cluster: Cluster, *args: Any, **kw: Any) -> None:
        super().__init__(cluster, *args, **kw)
        self.fenced: set[int] = set()

    async def create_writer(self, segment_id: int, ensemble: Any, **kw: Any) -> ScriptedWriter:
        writer = await super().create_writer(segment_id, ensemble, **kw)
        writer.__class__ = FencingWriter
        writer.fenced = self.fenced  # type: ignore[attr-defined]
        return writer

    async def recover(self, segment_id: int, ensemble: Any, **kw: Any) -> int:
        await trio.lowlevel.checkpoint()
        qa = kw.get("ack_quorum") or self.ack_quorum
        alive = [b for b in ensemble if b not in self.cluster.dead]
        needed = len(ensemble) - min(qa, len(ensemble)) + 1
        if len(alive) < needed:
            raise ServiceUnavailable(
                f"cannot recover segment {segment_id}: only {len(alive)} of"
                f" {len(ensemble)} bookies answered"
            )
        self.fenced.add(segment_id)
        return await super().recover(segment_id, ensemble, **kw)


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


# ------------------------------------------------------------------ random programs

BOOKIES = ["b1", "b2", "b3"]

_actions = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 3)),
    st.tuples(st.just("ack"), st.integers(1, 4)),
    st.tuples(st.just("store"), st.integers(1, 4)),  # reaches the bookies, no ack
    st.tuples(st.just("fail"), st.sampled_from(["storage", "conn"])),
    st.tuples(st.just("kill"), st.sampled_from(BOOKIES)),
    st.tuples(st.just("revive"), st.sampled_from(BOOKIES)),
    st.tuples(st.just("meta"), st.integers(1, 6)),
    st.tuples(st.just("sleep"), st.sampled_from([0.01, 0.3, 3.0, 12.0])),
    st.tuples(st.just("roll"), st.just(0)),
    st.tuples(st.just("takeover"), st.just(0)),  # another broker opens the ledger
    st.tuples(st.just("reload"), st.just(0)),  # close, then open again (an unload)
    st.tuples(st.just("ack_any"), st.integers(0, 5)),  # an older writer acknowledges
    st.tuples(st.just("fail_any"), st.integers(0, 5)),  # an older writer fails
    st.tuples(st.just("hole"), st.integers(1, 3)),  # a later entry stored, not the next
)


class _Run:
    """One random program against one ledger; every answer recorded as it comes."""

    def __init__(self) -> None:
        self.cluster = Cluster(list(BOOKIES))
        self.policy = RecoveringPolicy(self.cluster)
        self.store = ListingStore()
        self.answers: dict[int, list[tuple[Any, Any]]] = {}
        self.order: list[int] = []  # appends in the order they were answered
        self.appended: dict[int, tuple[bytes, int]] = {}  # i -> (payload, count)
        self.refused: list[int] = []
        self.n = 0
        self.ledgers: list[ManagedLedger] = []

    def callback(self, i: int) -> Any:
        def cb(result: Any, error: Any) -> None:
            self.answers.setdefault(i, []).append((result, error))
            assert len(self.answers[i]) == 1, f"append {i} answered twice: {self.answers[i]}"
            self.order.append(i)

        return cb

    def append(self, ledger: ManagedLedger, count: int) -> None:
        i = self.n
        self.n += 1
        payload = f"p{i}".encode()
        try:
            ledger.append_nowait(payload, count, self.callback(i))
        except PigeonError as exc:
            assert exc.retriable, f"append refused with a non-retriable error: {exc!r}"
            self.refused.append(i)
            return
        self.appended[i] = (payload, count)

    def open_writers(self) -> list[ScriptedWriter]:
        return [w for w in self.cluster.writers if not w.closed and w.failed is None]


async def _run_program(actions: list[tuple[str, Any]], max_entries: int) -> None:
    run = _Run()
    cluster, store = run.cluster, run.store
    async with trio.open_nursery() as nursery:
        # the broker (re)opening the topic
        reopen = functools.partial(
            open_ledger,
            nursery,
            store,
            run.policy,
            cluster.bookies,
            LedgerConfig(max_entries_per_segment=max_entries),
        )
        ledger = await reopen()
        run.ledgers.append(ledger)
        for kind, arg in actions:
            writers = run.open_writers()
            if kind == "append":
                run.append(ledger, arg)
            elif kind == "ack" and writers:
                w = writers[-1]
                if w.flights and not any(b in cluster.dead for b in w.ensemble[: w.write_quorum]):
                    w.store(min(w.flights) + arg - 1)
            elif kind == "store" and writers:
                w = writers[-1]
                if w.flights:
                    w.store(min(w.flights) + arg - 1, ack=False)
            elif kind == "fail" and writers:
                err = StorageError("bookie failed") if arg == "storage" else ConnectionClosed("x")
                writers[-1].fail(err)
            elif kind == "ack_any" and writers:
                w = writers[arg % len(writers)]
                if w.flights:
                    w.store(min(w.flights))
            elif kind == "fail_any" and writers:
                writers[arg % len(writers)].fail(StorageError("bookie failed"))
            elif kind == "hole" and writers:
                w = writers[-1]
                later = sorted(w.flights)[arg:]
                if later and w.segment_id not in run.policy.fenced:
                    eid = later[0]
                    cluster.segments[w.segment_id][eid] = w.flights[eid][0]
            elif kind == "kill":
                cluster.dead.add(arg)
            elif kind == "revive":
                cluster.dead.discard(arg)
            elif kind == "meta":
                store.fail_sets = arg
            elif kind == "sleep":
                await trio.sleep(arg)
            elif kind == "roll" and not ledger.closed:
                ledger._start_roll()
            elif kind in ("takeover", "reload"):
                if kind == "reload":
                    await ledger.close()
                try:
                    ledger = await reopen()
                except PigeonError as exc:
                    assert exc.retriable, f"open failed with a non-retriable error: {exc!r}"
                    # the bookies or the metadata are away: try again when they are back
                    cluster.dead.clear()
                    store.fail_sets = 0
                    ledger = await reopen()
                run.ledgers.append(ledger)
            await trio.lowlevel.checkpoint()
        # everything comes back: every append is answered, the ledger is writable
        cluster.dead.clear()
        store.fail_sets = 0
        with trio.fail_after(600):
            while True:
                for w in run.open_writers():
                    if w.flights:
                        w.store(max(w.flights))
                await trio.sleep(1)
                pending = set(run.appended) - set(run.answers)
                if not pending and ledger.closed:
                    # it lost the ledger to a later opener (the old owner won the race):
                    # the broker opens the topic again
                    ledger = await reopen()
                    run.ledgers.append(ledger)
                if not pending and not ledger._rolling and ledger.unavailable is None:
                    break
        run.append(ledger, 1)
        last = run.n - 1
        assert last in run.appended, "the ledger refuses appends with every bookie back"
        with trio.fail_after(60):
            while last not in run.answers:
                for w in run.open_writers():
                    if w.flights:
                        w.store(max(w.flights))
                await trio.sleep(0.5)
        assert run.answers[last][0][1] is None, f"append failed: {run.answers[last]}"
        await _check_log(ledger, run)
        # a takeover finds the same log
        await ledger.close()
        other = await open_ledger(nursery, store, run.policy, cluster.bookies)
        await _check_log(other, run)
        nursery.cancel_scope.cancel()


async def _check_log(ledger: ManagedLedger, run: _Run) -> None:
    ok = {i: a[0][0] for i, a in run.answers.items() if a[0][1] is None}
    entries = await log_entries(ledger)
    # offsets of the log are dense from 0 (after a takeover, a new owner may start above
    # offsets the old one handed out to appends that were never stored: subscriptions
    # pass over such a gap, nobody waits on it; never below them)
    expected = 0
    for seg, eid, first, count, _data in entries:
        if len(run.ledgers) > 1:
            assert first >= expected, f"offsets overlap at {(seg, eid)}: {first} < {expected}"
        else:
            assert first == expected, f"offsets not dense at {(seg, eid)}: {first} != {expected}"
        expected = first + count
    by_pos = {(seg, eid): (first, count, data) for seg, eid, first, count, data in entries}
    # every success is in the log at the position and offset it was given, its payload
    for i, (seg, eid, offset) in ok.items():
        assert (seg, eid) in by_pos, f"append {i} acknowledged at {(seg, eid)}, not in the log"
        first, count, data = by_pos[(seg, eid)]
        payload, n = run.appended[i]
        assert (first, count) == (offset, n), f"append {i}: log has {(first, count)}"
        assert data == payload, f"append {i}: another payload at {(seg, eid)}"
    # successes are in the log in append order, answered in append order
    succeeded = sorted(ok)
    positions = [ok[i][:2] for i in succeeded]
    assert positions == sorted(positions), "acknowledged appends out of order in the log"
    answered_ok = [i for i in run.order if i in ok]
    assert answered_ok == succeeded, "successes answered out of append order"
    # every other entry of the log is an append that failed where the ledger could not
    # tell whether it was stored (a takeover or close while it was in flight), and
    # nothing is in the log twice
    acked = {ok[i][:2] for i in ok}
    payloads = [data for _s, _e, _f, _c, data in entries]
    assert len(set(payloads)) == len(payloads), "an entry is in the log twice"
    failed = {i for i, a in run.answers.items() if a[0][1] is not None}
    for seg, eid, _first, _count, data in entries:
        if (seg, eid) in acked:
            continue
        who = [i for i in failed if data == run.appended[i][0]]
        assert who, f"entry {(seg, eid)} in the log is no append's"


@settings(
    max_examples=int(__import__("os").environ.get("ATTACK_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(actions=st.lists(_actions, max_size=40), max_entries=st.sampled_from([2, 3, 1000]))
def test_random_programs_keep_every_promise(
    actions: list[tuple[str, Any]], max_entries: int
) -> None:
    errors: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: errors.append(record.getMessage())  # type: ignore[method-assign]
    ledger_log = logging.getLogger("pigeon.broker._ledger")
    ledger_log.addHandler(handler)
    try:
        trio.run(
            _run_program,
            actions,
            max_entries,
            clock=trio.testing.MockClock(autojump_threshold=0),
        )
        # an out-of-order completion would mean an append dropped without an answer
        assert errors == [], errors
    except BaseException:
        print(f"failing program: max_entries={max_entries} actions={actions}")
        raise
    finally:
        ledger_log.removeHandler(handler)


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
