"""A persistent topic partition: its producers, subscriptions, de-duplication state and
retention.

A :class:`Topic` knows no wire protocol: a front door (the native protocol in
:mod:`pigeon.broker._service`, the admin API) attaches producers and consumers to it and
appends through it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from pigeon.broker._cursor import CursorState
from pigeon.broker._dedup import Deduplication, Receipt
from pigeon.broker._ledger import ManagedLedger
from pigeon.broker._ledger_state import Entry, Position
from pigeon.broker._policies import NamespacePolicies
from pigeon.broker._singleflight import open_once
from pigeon.broker._subscription import Subscription, take_cursor
from pigeon.broker._topic_configs import dirty_ratio, is_compacted
from pigeon.broker._topic_protocol import SeekTarget
from pigeon.core import TopicName
from pigeon.core.batch import ENTRY_HEADER_SIZE, read_header
from pigeon.core.errors import (
    CorruptEntry,
    InvalidArgument,
    NoSuchNode,
    NotOwner,
    PigeonError,
    SubscriptionNotFound,
)
from pigeon.core.paths import cursor_path, cursors_path, dedup_path, segment_path

if TYPE_CHECKING:
    from pigeon.broker._service import BrokerService
    from pigeon.core.rpc import Connection

__all__ = ["COMPACTION_SUBSCRIPTION", "Producer", "Topic", "drop_reader"]

log = logging.getLogger(__name__)

#: the durable subscription that holds a compacted topic's log from its horizon on
COMPACTION_SUBSCRIPTION = "__compaction"
#: entries stored between two snapshots of a topic's deduplication state (Pulsar's
#: ``brokerDeduplicationEntriesInterval``, 1000 there too): each is a metadata write,
#: and a recovering broker replays at most this many entries past the last one
DEDUP_SNAPSHOT_ENTRIES = 1000
#: how long closing subscriptions may take before the topic goes on regardless
CLOSE_TIMEOUT = 5.0
DEDUP_SNAPSHOT_SECONDS = 1.0
#: how much of a topic's log may be read to name the original of a duplicate
DEDUP_LOOKUP_MAX_BYTES = 256 << 20
#: entries read at a time, backwards, to name the original of a duplicate
DEDUP_LOOKUP_CHUNK = 256


@dataclass(eq=False)
class Producer:
    conn: Connection
    producer_id: int
    name: str
    topic: Topic
    ready: bool = True
    fenced: bool = False  # a send was not stored: refuse sends until it re-attaches
    #: set when an exclusive_with_fencing producer removed it: its sends fail with this
    fenced_error: PigeonError | None = None
    #: the topic's producer epoch it was admitted with (see pigeon.broker._access)
    epoch: int = 0
    #: de-duplicate its sends whatever the namespace policy says (a Kafka idempotent
    #: producer was promised it)
    deduplicate: bool = False
    #: the batch format its sends must have (1 native, 2 a Kafka RecordBatch wrapped by
    #: the Kafka front door: see pigeon.core.kafka_records)
    record_format: int = 1
    #: a duplicate whose original is not remembered is looked up in the log to answer
    #: with its position; a Kafka producer needs none (DUPLICATE_SEQUENCE_NUMBER is a
    #: success to it), and an answer that waits on a slow log search risks a refusal
    find_duplicate_positions: bool = True


class Topic:
    """A persistent topic partition owned by this broker."""

    def __init__(self, name: TopicName, ledger: ManagedLedger, service: BrokerService) -> None:
        self.name = name
        self.ledger = ledger
        self.service = service
        self.producers: dict[str, Producer] = {}
        self.subscriptions: dict[str, Subscription] = {}
        # De-duplication (pushed vs persisted sequence ids per producer name), its
        # persisted part snapshotted to the metadata store and, after a crash or a
        # move, completed by replaying the entries after the snapshot.
        self.dedup = Deduplication()
        self.dedup_path = dedup_path(name)
        self._dedup_position: tuple[int, int] = (-1, -1)  # (segment id, entry id) covered
        #: the dedup state remembers where the entries from here on are; the log before
        #: it is read (backwards, once) only to name the original of a duplicate
        self._dedup_indexed_from: tuple[int, int] | None = None
        self._dedup_lookup_bytes = 0
        self._dedup_searching = False  #: a search of the log for originals is running
        self._dedup_waiters = 0  #: sends waiting for it
        self._dedup_searched = trio.Event()  #: set (and replaced) after each chunk read
        self._dedup_unsaved = 0
        self._dedup_saving = False
        self._dedup_saved_at = 0.0
        self._held: list[Any] = []
        self._opening_subs: dict[str, trio.Event] = {}
        #: set when the topic is unloaded or deleted here: nothing may attach to it then
        self.unloaded = False

    persistent = True

    @property
    def msgs_in(self) -> int:
        return self.ledger.msgs_in

    @property
    def bytes_in(self) -> int:
        return self.ledger.bytes_in

    @property
    def next_offset(self) -> int:
        return self.ledger.next_offset

    @property
    def holding(self) -> bool:
        return bool(self._held)

    async def close(self) -> None:
        await self.ledger.close()

    def as_persistent(self) -> Topic:
        return self

    def internal_stats(self) -> dict[str, Any]:
        return {
            **self.ledger.internal_stats(),
            "cursors": {n: s.cursor_stats() for n, s in sorted(self.subscriptions.items())},
        }

    def storage_stats(self) -> dict[str, int]:
        ledger = self.ledger
        return {
            "first_offset": ledger.first_offset,
            "storage_size": sum(s.size for s in ledger.segments),
            "segments": len(ledger.segments),
            "corrupt_entries": ledger.corrupt_entries,
        }

    # ------------------------------------------------------------------ policies

    def backlog_bytes(self) -> int:
        """Unacknowledged bytes of the slowest durable subscription (by segment sizes)."""
        subs = [s for s in self.subscriptions.values() if s.durable]
        if not subs:
            return 0
        return self.ledger.bytes_after(min(s.cursor.mark_delete for s in subs))

    def hold(self, send: Any) -> None:
        """producer_request_hold: keep the send (in order) until the backlog shrinks."""
        self._held.append(send)
        if len(self._held) == 1:
            self.service.nursery.start_soon(self._release_held)

    async def _release_held(self) -> None:
        while self._held:
            policies = self.service.policies.cached(self.name.namespace_name)
            if (
                self.ledger.closed  # unloaded: the sends fail (retriably), nothing waits on
                or policies.backlog_quota_bytes < 0
                or self.backlog_bytes() <= policies.backlog_quota_bytes
            ):
                held, self._held = self._held, []
                for send in held:
                    send()
                return
            await trio.sleep(0.05)

    async def maintain(self, policies: NamespacePolicies) -> None:
        now = self.service.clock.now_ms()
        # a partition of a topic with cleanup.policy=compact (see _topic_configs); plain
        # topics have no topic-level configs and read none
        config = (
            await self.service.topic_configs.get(self.name)
            if self.name.partition_index >= 0
            else {}
        )
        compacted_topic = is_compacted(config)
        if compacted_topic and COMPACTION_SUBSCRIPTION not in self.subscriptions:
            # held from the start: nothing is trimmed before it is compacted
            await self.subscription(
                COMPACTION_SUBSCRIPTION, "exclusive", "earliest", durable=True, start_offset=-1
            )
        subs = [s for s in self.subscriptions.values() if s.durable]
        # TTL and backlog eviction are for consumers: the compaction cursor holds the log
        # until it is compacted (else a key's latest value could go unseen)
        expirable = [s for s in subs if s.name != COMPACTION_SUBSCRIPTION]
        if policies.message_ttl_s > 0 and expirable:
            pos = await self.ledger.position_for_time(now - int(policies.message_ttl_s * 1000))
            npos = self.ledger.normalize(pos)
            try:
                cutoff = (
                    (await self.ledger.read_one(npos)).first_offset
                    if npos
                    else self.ledger.next_offset
                )
            except CorruptEntry:  # on no replica intact: expire up to what follows it
                assert npos is not None
                cutoff = (await self.ledger.skip_damaged(npos)).end_offset
            for sub in expirable:
                if sub.cursor.mark_delete < cutoff:
                    log.info(
                        "message ttl expired topic=%s sub=%s up_to=%s", self.name, sub.name, cutoff
                    )
                    sub.expire_before(cutoff)
        if (
            policies.backlog_quota_bytes >= 0
            and policies.backlog_quota_policy == "consumer_backlog_eviction"
            and expirable
        ):
            keep_from = self.ledger.offset_keeping_bytes(policies.backlog_quota_bytes)
            for sub in expirable:
                if sub.cursor.mark_delete < keep_from:
                    log.info(
                        "backlog evicted topic=%s sub=%s up_to=%s", self.name, sub.name, keep_from
                    )
                    sub.expire_before(keep_from)
        # Without a durable subscription nothing counts as consumed: a topic nobody
        # subscribed to keeps its data (readers and late subscribers can still read it).
        consumed = min((s.cursor.mark_delete for s in subs), default=self.ledger.first_offset)
        trimmed = await self.ledger.trim(
            consumed, policies.retention_time_s, policies.retention_size_mb, now
        )
        await self._delete_segments(trimmed)
        # retention deletes offloaded copies too, and the key of any upload not recorded
        # (an interrupted one, or one still running: see _ledger_offload); the trim
        # saved them in ``offload_deleting``, so what fails (or a crash) is retried
        offloader = self.service.offloader
        if self.ledger.offload_deleting:
            await self.ledger.delete_removed_objects(offloader)
        if not self.ledger.compacting:
            if self.ledger.compaction_pending is not None:
                with contextlib.suppress(PigeonError):  # tried again next time
                    await self.ledger.drop_pending_compaction()
            threshold_bytes = policies.compaction_threshold
            dirty = self.ledger.bytes_since_compaction()
            if threshold_bytes > 0 and dirty > threshold_bytes:
                self.start_compaction()
            elif compacted_topic and dirty > 0:
                c = self.ledger.compacted
                clean = c.size if c is not None else 0
                fresh = c is None or self.ledger.stored_offset > c.horizon
                if fresh and dirty >= dirty_ratio(config) * (dirty + clean):
                    self.start_compaction()
        if offloader is not None and self.ledger.offloader is not None:
            threshold = policies.offload_threshold_bytes
            if (
                threshold >= 0
                and not self.ledger.offloading
                and self.ledger.offload_candidates(threshold)
            ):
                self.service.nursery.start_soon(self.offload_in_background, threshold)
            released = await self.ledger.release_offloaded(policies.offload_deletion_lag_s, now)
            if released:
                self.ledger.last_trimmed_ensembles = {
                    s.id: sorted({b for b in s.ensemble + s.initial_ensemble}) for s in released
                }
                await self._delete_segments([s.id for s in released])

    async def compact(self) -> None:
        """Compact the topic (see ``_ledger_compaction``): a durable ``__compaction``
        subscription holds the log from where the last compaction stopped, so nothing
        not yet compacted is trimmed; it moves to the new horizon once that is recorded."""
        if self.ledger.compacting:
            return
        try:
            sub = await self.subscription(
                COMPACTION_SUBSCRIPTION, "exclusive", "earliest", durable=True, start_offset=-1
            )
            compacted = await self.ledger.compact(self.service.codecs)
            if compacted is not None and sub.cursor.mark_delete < compacted.horizon:
                sub.expire_before(compacted.horizon)
                await sub.persist()
        except PigeonError as exc:  # ownership lost or closed: the next owner compacts
            self.ledger.compaction_status = {"status": "ERROR", "last_error": str(exc)}
            log.info("compaction stopped topic=%s error=%s", self.name, exc)

    def start_compaction(self) -> None:
        """Compact in the background (a run already going on is not doubled)."""
        if not self.ledger.compacting:
            self.ledger.compaction_status = {"status": "RUNNING", "last_error": ""}
            self.service.nursery.start_soon(self.compact)

    async def offload_in_background(self, threshold: int, *, retry_damaged: bool = False) -> None:
        try:
            await self.ledger.offload(threshold, retry_damaged=retry_damaged)
        except PigeonError as exc:  # ownership lost or closed: the next owner offloads
            log.info("offload stopped topic=%s error=%s", self.name, exc)

    async def _delete_segments(self, segment_ids: list[int]) -> None:
        """Delete segments' nodes and their bookie copies (the bookies' GC catches up
        with copies on bookies that are away)."""
        for seg_id in segment_ids:
            try:
                await self.service.store.delete(segment_path(seg_id))
            except PigeonError:
                pass
            for address in self.ledger.last_trimmed_ensembles.get(seg_id, []):
                try:
                    await self.service.policy.client.delete_segment(address, seg_id)
                except (PigeonError, OSError) as exc:
                    log.info(
                        "bookie delete deferred to GC segment=%s bookie=%s error=%s",
                        seg_id,
                        address,
                        exc,
                    )

    def append(
        self, payload: bytes | memoryview, n: int, callback: Any, *, deliver_at: int = 0
    ) -> None:
        self.ledger.append_nowait(payload, n, callback, deliver_at=deliver_at)

    def corrupt_entry_policy(self) -> str:
        """The corrupt-entry policy ("skip" or "fail"): the namespace's, else the broker's."""
        policy = self.service.policies.cached(self.name.namespace_name).corrupt_entry_policy
        return policy or self.service.config.corrupt_entry_policy

    async def recover_dedup(self) -> None:
        stat = await self.service.store.get(self.dedup_path)
        start = self.ledger.start_position()
        if stat is not None:
            doc = json.loads(stat.value)
            self.dedup.restore({k: int(v) for k, v in doc.get("producers", {}).items()})
            seg_id, entry_id = doc.get("position", [-1, -1])
            if seg_id >= 0:
                start = (seg_id, entry_id + 1)
        self._dedup_indexed_from = start
        pos: tuple[int, int] | None = start
        replayed = 0
        while pos is not None:
            try:
                entries = await self.ledger.read(pos, max_entries=256)
            except CorruptEntry:
                # on no replica intact: its sequence ids are unknown (a resend of those
                # messages is stored again, not dropped as a duplicate)
                pos = (await self.ledger.skip_damaged(pos)).next
                continue
            if not entries:
                break
            self.dedup.replay(self._dedup_records(entries))
            self._dedup_position = (entries[-1].segment_id, entries[-1].entry_id)
            replayed += len(entries)
            pos = self.ledger.next_position(entries[-1].position)
        if replayed:
            log.info("dedup state recovered topic=%s replayed_entries=%s", self.name, replayed)
            await self.snapshot_dedup()

    @staticmethod
    def _dedup_records(entries: list[Entry]) -> list[tuple[str, int, int, Receipt]]:
        out = []
        for entry in entries:
            header = read_header(memoryview(entry.data)[ENTRY_HEADER_SIZE:])
            out.append(
                (
                    header.producer_name,
                    header.sequence_id,
                    header.num_messages,
                    (entry.segment_id, entry.entry_id, entry.first_offset),
                )
            )
        return out

    def may_find_original(self, name: str, first: int) -> bool:
        """Could :meth:`original_receipt` name a duplicate the dedup state does not?"""
        return (
            self._dedup_indexed_from is not None
            and self._dedup_lookup_bytes < DEDUP_LOOKUP_MAX_BYTES
            and not self.dedup.remembers_before(name, first)
        )

    async def original_receipt(self, name: str, first: int, count: int) -> Receipt | None:
        """The position of a stored batch the dedup state does not remember (stored
        before the snapshot this broker recovered from).  None when it cannot be named
        (the log was trimmed, or the batch was stored under other sequence boundaries).

        A background search reads the log backwards from where the recovery began,
        :data:`DEDUP_LOOKUP_CHUNK` entries at a time, at most
        :data:`DEDUP_LOOKUP_MAX_BYTES` per topic, for as long as anyone waits; a caller
        that stops waiting (``publish`` waits DEDUP_LOOKUP_WAIT_S) does not cancel the
        chunk being read, so the resend that follows finds what it read."""
        dedup = self.dedup
        self._dedup_waiters += 1
        try:
            while True:
                receipt = dedup.receipt(name, first, count)
                if receipt is not None or not self.may_find_original(name, first):
                    return receipt
                searched = self._dedup_searched
                if not self._dedup_searching:
                    self._dedup_searching = True
                    self.service.nursery.start_soon(self._search_log_backwards)
                await searched.wait()
        finally:
            self._dedup_waiters -= 1

    def _wake_dedup_waiters(self) -> None:
        self._dedup_searched.set()
        self._dedup_searched = trio.Event()

    async def _search_log_backwards(self) -> None:
        try:
            while (
                self._dedup_waiters > 0
                and not self.unloaded
                and self._dedup_indexed_from is not None
                and self._dedup_lookup_bytes < DEDUP_LOOKUP_MAX_BYTES
            ):
                end = self._dedup_indexed_from
                index = self.ledger.segment_index_before(end)
                if index is None:
                    self._dedup_indexed_from = None
                    break
                seg = self.ledger.segments[index]
                stop = seg.last_entry_id + 1 if end[0] != seg.id else end[1]
                start = max(0, stop - DEDUP_LOOKUP_CHUNK)
                try:
                    entries = await self._read_span(seg.id, start, stop)
                except PigeonError as exc:
                    log.info(
                        "reading the log for originals of duplicates failed topic=%s error=%s",
                        self.name,
                        exc,
                    )
                    await trio.sleep(0.5)
                    continue
                self._dedup_lookup_bytes += sum(len(e.data) for e in entries)
                self.dedup.remember_older(self._dedup_records(entries))
                self._dedup_indexed_from = (seg.id, start)
                self._wake_dedup_waiters()
        finally:
            self._dedup_searching = False
            self._wake_dedup_waiters()

    async def _read_span(self, segment_id: int, start: int, stop: int) -> list[Entry]:
        """Entries ``start..stop-1`` of a segment (those no replica holds intact left
        out)."""
        out: list[Entry] = []
        pos: Position = (segment_id, start)
        while pos[1] < stop:
            try:
                entries = await self.ledger.read(pos, max_entries=stop - pos[1])
            except CorruptEntry:
                pos = (await self.ledger.skip_damaged(pos)).next
                if pos[0] != segment_id:
                    break
                continue
            entries = [e for e in entries if e.entry_id < stop]
            if not entries:
                break
            out.extend(entries)
            pos = (segment_id, entries[-1].entry_id + 1)
        return out

    def confirm_sequence(self, segment_id: int, entry_id: int) -> None:
        """An entry is stored: the snapshot covers the log up to it."""
        self._dedup_position = (segment_id, entry_id)
        self._dedup_unsaved += 1
        if not self._dedup_saving and (
            self._dedup_unsaved >= DEDUP_SNAPSHOT_ENTRIES
            or trio.current_time() - self._dedup_saved_at >= DEDUP_SNAPSHOT_SECONDS
        ):
            self._dedup_saving = True
            self.service.nursery.start_soon(self.snapshot_dedup)

    async def snapshot_dedup(self) -> None:
        try:
            self._dedup_unsaved = 0
            self._dedup_saved_at = trio.current_time()
            doc = json.dumps(
                {"producers": self.dedup.persisted_map(), "position": list(self._dedup_position)}
            ).encode()
            store = self.service.store
            try:
                await store.set(self.dedup_path, doc)
            except NoSuchNode:
                await store.create(self.dedup_path, doc)
        except PigeonError as exc:
            log.warning("dedup snapshot failed topic=%s error=%s", self.name, exc)
        finally:
            self._dedup_saving = False

    async def subscription(
        self, name: str, sub_type: str, initial_position: str, *, durable: bool, start_offset: int
    ) -> Subscription:
        """The subscription ``name``, opened on first use (its cursor loaded or started).

        Opening is single-flight: a caller arriving while another opens the same name
        waits for it and gets the same object, so one cursor never has two dispatchers.
        Raises NotOwner once the topic was unloaded (the caller looks it up again).
        """

        def loaded() -> Subscription | None:
            self._check_loaded()
            sub = self.subscriptions.get(name)
            # a fenced one is on its way out: its cursor is loaded again from the store
            return None if sub is not None and sub.fenced else sub

        open_ = functools.partial(
            self._open_subscription,
            name,
            sub_type,
            initial_position,
            durable=durable,
            start_offset=start_offset,
        )
        return await open_once(self._opening_subs, name, loaded, open_)

    async def find_subscription(self, name: str) -> Subscription:
        """The subscription ``name``, its stored cursor loaded if no consumer attached to
        it since the topic loaded; SubscriptionNotFound if it has none."""
        sub = self.subscriptions.get(name)
        if sub is not None:
            return sub
        if await self.service.store.exists(cursor_path(self.name, name)):
            return await self.subscription(
                name, "exclusive", "latest", durable=True, start_offset=-1
            )
        raise SubscriptionNotFound(f"subscription {name!r} does not exist on {self.name}")

    async def load_subscriptions(self) -> None:
        """Load the cursors of subscriptions no consumer attached to since the topic loaded."""
        for name in await self.service.store.children(cursors_path(self.name)):
            if name not in self.subscriptions:
                await self.subscription(name, "exclusive", "latest", durable=True, start_offset=-1)

    async def close_subscriptions(self, names: list[str] | None = None) -> None:
        """Stop dispatch of the named (or all) subscriptions and wait until they persisted."""
        subs = [s for n, s in list(self.subscriptions.items()) if names is None or n in names]
        for sub in subs:
            sub.closed = True
            sub.wake()
        with trio.move_on_after(CLOSE_TIMEOUT) as scope:
            # A subscription's dispatch task leaves self.subscriptions when it has stopped
            # and persisted its cursor; there is no event to wait on.
            while any(self.subscriptions.get(s.name) is s for s in subs):  # noqa: ASYNC110
                await trio.sleep(0.01)
        if scope.cancelled_caught:
            log.warning("subscriptions did not stop in time topic=%s", self.name)
        for sub in subs:
            if self.subscriptions.get(sub.name) is sub:
                del self.subscriptions[sub.name]

    async def delete_subscription(self, sub: Subscription, detach: Callable[[], object]) -> None:
        """Delete ``sub`` and its cursor; ``detach()`` detaches its consumers.

        The subscription stops persisting before its node goes, so nothing re-creates the
        cursor; a consumer that re-attaches before the node is gone joins the closed
        subscription and is detached once more, then subscribes afresh.
        """
        sub.closed = True
        sub.store = None
        sub.wake()
        detach()
        with contextlib.suppress(NoSuchNode):
            await self.service.store.delete(cursor_path(self.name, sub.name))
        if self.subscriptions.get(sub.name) is sub:
            del self.subscriptions[sub.name]
        detach()

    async def has_subscription(self, name: str) -> bool:
        """Whether the subscription ``name`` is loaded here or has a stored cursor."""
        return name in self.subscriptions or await self.service.store.exists(
            cursor_path(self.name, name)
        )

    def _check_loaded(self) -> None:
        if self.unloaded:
            raise NotOwner(f"{self.name} was unloaded here; look it up again")

    async def _open_subscription(
        self, name: str, sub_type: str, initial_position: str, *, durable: bool, start_offset: int
    ) -> Subscription:
        store = self.service.store
        cursor: CursorState | None = None
        version: int | None = None
        if durable:
            taken = await take_cursor(store, cursor_path(self.name, name))
            if taken is not None:
                cursor, version = taken
        created = cursor is None
        requested: int | None = None
        if cursor is None:
            requested = (
                start_offset
                if start_offset >= 0
                else 0
                if initial_position == "earliest"
                else self.ledger.next_offset
            )
            if start_offset >= 0:
                start = max(start_offset, self.ledger.first_offset)
            elif initial_position == "earliest":
                start = self.ledger.first_offset
            else:
                start = self.ledger.next_offset
            cursor = CursorState(start, sub_type=sub_type)
        sub = Subscription(
            name,
            # a stored cursor keeps its type until a consumer asks for another one
            cursor.sub_type or sub_type,
            self.ledger,
            cursor,
            durable=durable,
            store=store,
            persist_interval=self.service.config.cursor_persist_interval_ms / 1000,
            clock=self.service.clock,
            codecs=self.service.codecs,
            corrupt_entry_policy=self.corrupt_entry_policy,
            cursor_version=version,
        )
        sub.requested_start = requested
        sub.read_position = await self.ledger.position_for_offset(cursor.mark_delete)
        self._check_loaded()  # an unload meanwhile has closed every subscription it saw
        self.subscriptions[name] = sub
        self.service.nursery.start_soon(self._run_subscription, sub)
        if created and durable:
            sub._dirty = True
            await sub.persist()
        return sub

    async def _run_subscription(self, sub: Subscription) -> None:
        try:
            await sub.run()
        except Exception as exc:  # one subscription failing must not take the broker down
            if isinstance(exc, PigeonError):
                # e.g. bookies away: the consumers re-subscribe and go on from the cursor
                log.warning(
                    "subscription stopped topic=%s sub=%s error=%s", self.name, sub.name, exc
                )
            else:
                log.exception("subscription failed topic=%s sub=%s", self.name, sub.name)
            sub.closed = True
            for consumer in list(sub.consumers):
                with contextlib.suppress(PigeonError):
                    consumer.conn.send_nowait(
                        "closedByBroker",
                        {
                            "consumerId": consumer.consumer_id,
                            "isProducer": False,
                            "reason": str(exc),
                        },
                    )
        finally:
            if self.subscriptions.get(sub.name) is sub and sub.closed:
                del self.subscriptions[sub.name]

    def seek(self, sub: Any, target: SeekTarget) -> Awaitable[None]:
        """Check a seek of ``sub`` at once; returns what moves its cursor when awaited."""
        if target.offset is not None:
            coro: Awaitable[None] = sub.seek_offset(target.offset)
        elif target.timestamp is not None:
            coro = sub.seek_time(target.timestamp)
        else:
            assert target.position is not None
            (segment_id, entry_id), batch_index = target.position
            ledger = sub.ledger
            trimmed_but_compacted = (
                getattr(sub, "read_compacted", False)
                and ledger.compacted is not None
                and (not ledger.segments or segment_id < ledger.segments[0].id)
            )  # the compacted view may still hold it
            if ledger.index_of_segment(segment_id) is None and not trimmed_but_compacted:
                raise InvalidArgument(
                    f"segment {segment_id} is not (or no longer) part of this topic"
                )
            coro = sub.seek_position((segment_id, entry_id), batch_index)
        return coro

    def last_message_id(self, sub: Any) -> tuple[Position, int, int]:
        """(position of the last entry, last offset, ``sub``'s mark-delete offset)."""
        ledger = self.ledger
        c = ledger.compacted
        compacted_only = c is not None and ledger.next_offset <= c.horizon
        if getattr(sub, "read_compacted", False) and c is not None and compacted_only:
            # nothing after the horizon: the last message this reader can get is the
            # compacted view's last (the log's may be a tombstone or an older version)
            seg, entry, _index, offset = c.last_message
            return (seg, entry), offset, sub.cursor.mark_delete
        return ledger.last_position, ledger.next_offset - 1, sub.cursor.mark_delete

    def stats(self) -> dict[str, Any]:
        return {
            "topic": self.name.full,
            "msgs_in": self.ledger.msgs_in,
            "bytes_in": self.ledger.bytes_in,
            "next_offset": self.ledger.next_offset,
            "segments": len(self.ledger.segments),
            "storage_size": sum(s.size for s in self.ledger.segments),
            "producers": len(self.producers),
            "subscriptions": {
                name: {
                    "type": sub.type,
                    "consumers": len(sub.consumers),
                    "backlog": sub.backlog(),
                    "msgs_out": sub.msgs_out,
                    "bytes_out": sub.bytes_out,
                    "mark_delete_offset": sub.cursor.mark_delete,
                }
                for name, sub in self.subscriptions.items()
            },
        }


def drop_reader(topic: Any, sub: Any) -> None:
    """A non-durable cursor (a reader's) lives only as long as its last consumer."""
    if sub.durable or sub.consumers or topic.subscriptions.get(sub.name) is not sub:
        return
    sub.closed = True
    if isinstance(sub, Subscription):
        sub.wake()
    del topic.subscriptions[sub.name]
