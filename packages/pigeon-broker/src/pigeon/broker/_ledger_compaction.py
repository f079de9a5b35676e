"""Topic compaction: the compacted ledger, the latest message of every key.

Pulsar's model.  Compaction reads the topic from the start -- or the previous compacted
ledger and what came after its horizon -- up to a *horizon* (the end of the log when it
started), in two passes: the first finds the offset of the latest message of every
key (a message with an empty value is a *tombstone*: its key is removed), the second
writes the entries holding such messages to a new segment, the *compacted ledger*.
Messages without a key are not kept (as Pulsar's ``topicCompactionRetainNullKey=false``),
nor are tombstones.

**Entries of the compacted ledger** (little endian; the layout is this module's)::

    0   i64  segment id of the original entry
    8   i64  entry id of the original entry
    16  u32  n, how many of its messages are kept
    20  u32  * n  the kept batch indexes, ascending
    ..  the original entry, byte for byte (entry header + batch)

So a message keeps its MessageId and offset in the compacted view; a batch is kept whole
while any of its messages is the latest of its key, the others are hidden at delivery
(the subscription acknowledges them: see ``Subscription``), and nothing is decompressed
or re-encoded.

**Bookkeeping, crash-safe.**  The new ledger's id is saved in the topic's ledger
metadata (``compaction_pending``) before its segment node exists; once every entry is
acknowledged by its bookies, ``compacted`` = ``{ledger id, horizon, ...}`` replaces
the previous one and ``compaction_pending`` is cleared in one compare-and-set write;
only then is the previous compacted ledger deleted.  A crash (or failure) before that
write leaves the previous compacted ledger in force and the new one pending: the next
owner's maintenance deletes its node (the bookies' GC then removes the copies), so no
compacted ledger is ever orphaned.  The messages below the horizon stay in the log
until then: the topic keeps a durable ``__compaction`` subscription at the horizon.
"""

from __future__ import annotations

import contextlib
import json
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import trio

from pigeon.broker._ledger_offload import LedgerOffload
from pigeon.broker._ledger_state import Entry, Position, log
from pigeon.broker._ledger_writes import LedgerWrites
from pigeon.core.batch import ENTRY_HEADER_SIZE, decode_batch, unpack_entry_header
from pigeon.core.errors import (
    CorruptEntry,
    NoSuchNode,
    NotOwner,
    PigeonError,
    ServiceUnavailable,
)
from pigeon.core.paths import SEGMENT_ID_PREFIX, segment_path

__all__ = [
    "CompactedEntry",
    "CompactedLedger",
    "LatestPerKey",
    "LedgerCompaction",
    "pack_compacted",
    "unpack_compacted",
]

_HEAD = struct.Struct("<qqI")
#: entries read at a time (from the log or the previous compacted ledger)
COMPACTION_READ_ENTRIES = 256
#: entries in flight to the bookies while the compacted ledger is written
COMPACTION_WRITE_WINDOW = 256


def pack_compacted(position: Position, kept: list[int], entry: bytes | memoryview) -> bytes:
    """One entry of the compacted ledger (layout in the module doc)."""
    head = _HEAD.pack(position[0], position[1], len(kept))
    return b"".join((head, struct.pack(f"<{len(kept)}I", *kept), bytes(entry)))


def unpack_compacted(data: bytes | memoryview) -> tuple[Position, list[int], memoryview]:
    """(original position, kept batch indexes, original entry) of a compacted entry."""
    view = memoryview(data)
    if len(view) < _HEAD.size:
        raise CorruptEntry("compacted entry shorter than its header")
    seg, entry, n = _HEAD.unpack_from(view)
    end = _HEAD.size + 4 * n
    if len(view) < end + ENTRY_HEADER_SIZE:
        raise CorruptEntry("compacted entry cut short")
    kept = list(struct.unpack_from(f"<{n}I", view, _HEAD.size))
    return (seg, entry), kept, view[end:]


@dataclass
class CompactedLedger:
    """The compacted ledger recorded in the topic's ledger metadata."""

    id: int
    #: one past the last offset compaction read: the compacted view holds the latest
    #: message of every key below it, the log goes on from it
    horizon: int
    ensemble: list[str]
    entries: int = 0
    size: int = 0
    write_quorum: int = 0
    ack_quorum: int = 0
    ctime: float = 0.0
    #: the last message kept ([segment, entry, batch index], offset); offset -1: none
    last_message: list[int] = field(default_factory=lambda: [-1, -1, -1, -1])

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> CompactedLedger:
        return cls(**{k: v for k, v in doc.items() if k in _FIELDS})

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)


_FIELDS = {f for f in CompactedLedger.__dataclass_fields__}


@dataclass(slots=True)
class CompactedEntry:
    """An entry read from the compacted ledger: ``entry`` is the original (its position,
    offsets, bytes), ``kept`` the batch indexes the compacted view shows."""

    entry_id: int
    entry: Entry
    kept: list[int]


class LatestPerKey:
    """Compaction's first pass, without I/O: the offset of the latest message of each key.

    ``add(first_offset, keys, value_sizes, only)`` takes one entry's messages in log order
    (``only``: the batch indexes to consider, None for all); ``kept(...)`` then says
    which of an entry's messages the compacted ledger keeps.
    """

    def __init__(self) -> None:
        self.latest: dict[bytes, int] = {}

    def add(
        self,
        first_offset: int,
        keys: list[bytes | None],
        value_sizes: list[int],
        only: list[int] | None = None,
    ) -> None:
        latest = self.latest
        for i in range(len(keys)) if only is None else only:
            key = keys[i]
            if key is None:
                continue
            if value_sizes[i] == 0:
                latest.pop(key, None)  # a tombstone: the key is removed
            else:
                latest[key] = first_offset + i

    def kept(
        self, first_offset: int, keys: list[bytes | None], only: list[int] | None = None
    ) -> list[int]:
        latest = self.latest
        return [
            i
            for i in (range(len(keys)) if only is None else only)
            if keys[i] is not None and latest.get(keys[i]) == first_offset + i  # type: ignore[arg-type]
        ]


def _messages(data: bytes | memoryview, codecs: Any) -> tuple[list[bytes | None], list[int]]:
    """Keys and value sizes of an entry's messages."""
    batch = decode_batch(memoryview(data)[ENTRY_HEADER_SIZE:], codecs)
    n = batch.num_messages
    keys: list[bytes | None] = batch.keys() if batch.has_keys else [None] * n
    offsets = batch.values_offsets
    return keys, [offsets[i + 1] - offsets[i] for i in range(n)]


class LedgerCompaction(LedgerWrites, LedgerOffload):
    """Compacting a ledger into a compacted ledger (see module doc)."""

    def _load_compaction(self, doc: dict[str, Any]) -> None:
        compacted = doc.get("compacted")
        self.compacted = CompactedLedger.from_doc(compacted) if compacted else None
        pending = doc.get("compaction_pending")
        self.compaction_pending = int(pending) if pending is not None else None

    @property
    def compacting(self) -> bool:
        return self._compaction_ended is not None

    async def compaction_stopped(self) -> None:
        """Return once no compaction of this ledger is running."""
        ended = self._compaction_ended
        if ended is not None:
            await ended.wait()

    # ------------------------------------------------------------------ reads

    async def read_compacted(
        self, compacted: CompactedLedger, entry_id: int, max_entries: int
    ) -> list[CompactedEntry]:
        """Entries of ``compacted`` from ``entry_id`` on ([] past its end)."""
        last = min(compacted.entries - 1, entry_id + max_entries - 1)
        if entry_id > last:
            return []
        raw = await self.policy.read(
            compacted.id,
            compacted.ensemble,
            entry_id,
            last,
            max_bytes=self.config.read_batch_bytes,
            max_count=max_entries,
            write_quorum=compacted.write_quorum or None,
            repair=True,
        )
        out = []
        for eid, data in raw:
            (seg, orig), kept, original = unpack_compacted(data)
            header = unpack_entry_header(original)
            entry = Entry(
                seg,
                orig,
                (seg, orig),
                original,
                header.num_messages,
                header.first_offset,
                header.publish_time,
                header.deliver_at,
            )
            out.append(CompactedEntry(eid, entry, kept))
        return out

    async def read_compacted_at(self, compacted: CompactedLedger, pos: Position) -> Entry | None:
        """The entry of original position ``pos`` in ``compacted`` (None: it keeps none
        of its messages); a binary search, as the compacted ledger is in log order."""
        lo, hi = 0, compacted.entries - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            items = await self.read_compacted(compacted, mid, 1)
            if not items:
                return None
            found = items[0].entry.position
            if found == pos:
                return items[0].entry
            if found < pos:
                lo = mid + 1
            else:
                hi = mid - 1
        return None

    async def _compaction_source(
        self, horizon: int
    ) -> AsyncIterator[tuple[Entry, list[int] | None]]:
        """What compaction reads, in log order: the previous compacted ledger's entries
        (with their kept indexes), then the log's entries from its horizon up to
        ``horizon`` (None: every message)."""
        previous = self.compacted
        start = 0
        if previous is not None:
            start = previous.horizon
            eid = 0
            while True:
                items = await self.read_compacted(previous, eid, COMPACTION_READ_ENTRIES)
                if not items:
                    break
                for item in items:
                    yield item.entry, item.kept
                eid = items[-1].entry_id + 1
        pos: Position | None = await self.position_for_offset(start)
        while pos is not None:
            self._check_open()
            npos = self.normalize(pos)
            if npos is None:
                return
            try:
                entries = await self.read(npos, max_entries=COMPACTION_READ_ENTRIES)
            except CorruptEntry as exc:
                run = await self.skip_damaged(npos)
                log.error(
                    "compaction passes over damaged entries topic=%s segment=%s entries=%s..%s: %s",
                    self.topic,
                    run.segment_id,
                    run.first_entry,
                    run.last_entry,
                    exc,
                )
                pos = run.next
                continue
            if not entries:
                return
            for entry in entries:
                if entry.first_offset >= horizon:
                    return
                if entry.first_offset + entry.num_messages > start:
                    yield entry, None
            pos = self.next_position(entries[-1].position)

    # ------------------------------------------------------------------ compaction

    async def compact(self, codecs: Any) -> CompactedLedger | None:
        """Compact up to the end of the log as it is now; returns the new compacted
        ledger (None: another run is going on, or nothing new to compact).  The status
        is kept in ``compaction_status`` (Pulsar's LongRunningProcessStatus)."""
        if self._compaction_ended is not None:
            return None
        ended = self._compaction_ended = trio.Event()
        self.compaction_status = {"status": "RUNNING", "last_error": ""}
        try:
            await self.drop_pending_compaction()
            result = await self._compact(codecs)
        except NotOwner:
            self.compaction_status = {"status": "ERROR", "last_error": "ownership lost"}
            raise
        except (PigeonError, OSError, trio.TooSlowError) as exc:
            error = " ".join(str(exc).split()) or type(exc).__name__
            self.compaction_status = {"status": "ERROR", "last_error": error}
            log.warning("compaction failed topic=%s error=%s; retried later", self.topic, error)
            return None
        else:
            self.compaction_status = {"status": "SUCCESS", "last_error": ""}
            return result
        finally:
            self._compaction_ended = None
            ended.set()

    async def _compact(self, codecs: Any) -> CompactedLedger | None:
        # everything acknowledged before this point is below the horizon
        horizon = self.stored_offset
        previous: CompactedLedger | None = self.compacted
        if previous is not None and previous.horizon >= horizon:
            return previous
        started = time.perf_counter()
        latest = LatestPerKey()
        async for entry, only in self._compaction_source(horizon):
            keys, sizes = _messages(entry.data, codecs)
            latest.add(entry.first_offset, keys, sizes, only)
        self._check_open()
        compacted = await self._write_compacted(codecs, horizon, latest)
        if self.closed:  # unloaded or deleted meanwhile: not recorded, not left behind
            with trio.CancelScope(shield=True), contextlib.suppress(PigeonError):
                await self.drop_pending_compaction()
            self._check_open()
        # recorded in one write: the new ledger in force, nothing pending
        self.compacted, self.compaction_pending = compacted, None
        try:
            await self._save()
        except BaseException as exc:
            self.compacted, self.compaction_pending = previous, compacted.id
            if isinstance(exc, (NotOwner, NoSuchNode)):
                # not recorded, and never will be (another owner's metadata, or the
                # topic deleted): the new ledger goes now, nobody else would delete it
                with trio.CancelScope(shield=True), contextlib.suppress(PigeonError):
                    await self.store.delete(segment_path(compacted.id))
            raise
        if previous is not None:
            await self._delete_compacted(previous.id, previous.ensemble)
        log.info(
            "topic compacted topic=%s ledger=%s horizon=%s keys=%s entries=%s bytes=%s"
            " seconds=%.3f",
            self.topic,
            compacted.id,
            horizon,
            len(latest.latest),
            compacted.entries,
            compacted.size,
            time.perf_counter() - started,
        )
        return compacted

    async def _write_compacted(
        self, codecs: Any, horizon: int, latest: LatestPerKey
    ) -> CompactedLedger:
        """Second pass: the kept entries written to a new segment (pending until the
        caller records it)."""
        bookies, e, qw, qa = self._ensemble_config()
        ensemble = self.policy.choose_ensemble(bookies, e)
        created = await self.store.create(SEGMENT_ID_PREFIX, b"", sequential=True)
        segment_id = int(created.rsplit("-", 1)[1]) + 1
        # pending first: a crash from here on leaves nothing unrecorded
        self.compaction_pending = segment_id
        try:
            await self._save()
        except BaseException:
            self.compaction_pending = None
            raise
        self._check_open()
        compacted = CompactedLedger(
            segment_id, horizon, ensemble, write_quorum=qw, ack_quorum=qa, ctime=time.time()
        )
        try:
            await self.store.create(
                segment_path(segment_id),
                json.dumps(
                    {
                        "topic": self.topic.full,
                        "ensemble": ensemble,
                        "ctime": compacted.ctime,
                        "compacted": True,
                    }
                ).encode(),
            )
            writer = await self.policy.create_writer(
                segment_id, ensemble, write_quorum=qw, ack_quorum=qa, nursery=self.nursery
            )
            errors: list[BaseException] = []

            def done(_entry_id: int, error: BaseException | None) -> None:
                if error is not None:
                    errors.append(error)

            try:
                self._check_open()  # the segment node exists now: deleted if closed
                async for entry, only in self._compaction_source(horizon):
                    keys, _sizes = _messages(entry.data, codecs)
                    kept = latest.kept(entry.first_offset, keys, only)
                    if not kept:
                        continue
                    record = pack_compacted(entry.position, kept, entry.data)
                    writer.add_nowait(record, done)
                    last = kept[-1]
                    compacted.last_message = [
                        entry.segment_id,
                        entry.entry_id,
                        last,
                        entry.first_offset + last,
                    ]
                    compacted.entries += 1
                    compacted.size += len(record)
                    if writer.pending >= COMPACTION_WRITE_WINDOW:
                        await writer.wait_idle()
                    if errors or writer.failed is not None:
                        break
                await writer.wait_idle()
            finally:
                writer.close()
            failed = errors[0] if errors else writer.failed
            if failed is not None:
                raise ServiceUnavailable(f"cannot write the compacted ledger: {failed}")
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.drop_pending_compaction()
            raise
        return compacted

    def _check_open(self) -> None:
        """Compaction stops once the ledger is closed (unloaded, or its topic deleted)."""
        if self.closed:
            raise ServiceUnavailable(f"topic {self.topic} is closed; compaction stopped")

    async def drop_pending_compaction(self) -> None:
        """Delete a compacted ledger written and never recorded (a failed or crashed
        run); best effort, retried by the next maintenance."""
        pending = self.compaction_pending
        if pending is None or (self.compacted is not None and self.compacted.id == pending):
            return
        with contextlib.suppress(PigeonError):
            await self.store.delete(segment_path(pending))
        if await self.store.get(segment_path(pending)) is not None:
            return  # not deleted: tried again later
        log.info("unrecorded compacted ledger deleted topic=%s ledger=%s", self.topic, pending)
        if self.compaction_pending == pending:
            self.compaction_pending = None
            try:
                await self._save()
            except PigeonError:
                self.compaction_pending = pending
                raise

    async def _delete_compacted(self, ledger_id: int, ensemble: list[str]) -> None:
        """The node of a compacted ledger no longer recorded, and its bookie copies
        (the bookies' GC catches up with those it cannot reach)."""
        with contextlib.suppress(PigeonError):
            await self.store.delete(segment_path(ledger_id))
        client = getattr(self.policy, "client", None)
        if client is None:
            return
        for address in ensemble:
            try:
                await client.delete_segment(address, ledger_id)
            except (PigeonError, OSError) as exc:
                log.info(
                    "bookie delete deferred to GC segment=%s bookie=%s error=%s",
                    ledger_id,
                    address,
                    exc,
                )
