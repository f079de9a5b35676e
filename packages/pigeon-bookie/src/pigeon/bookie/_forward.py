"""Leader-follower replication, the leader's side: a bookie forwarding adds to followers.

With the ``leader-follower`` policy a writer sends each entry to the segment's leader
bookie only, naming the followers in the add (``forwardTo``).  The leader stores the entry,
forwards it to every follower and answers the writer once the entry is durable here and
the requested number of followers confirmed it (see :class:`Replication`).

Forwards to one follower of one segment form a :class:`_Link`: one ordered stream, so a
follower receives the entries of a segment in order and holds a prefix of them.  When a
link opens, the follower's last entry is asked for; if it lacks entries the leader holds
(it is new in the ensemble, or it missed entries in flight when the previous leader
died), those are sent first, from the leader's own copy, starting at the writer's
``syncFrom`` (the first entry of the current fragment).  A link whose follower failed
stays failed: later entries report the follower as lost at once (the writer replaces it)
and never reach it out of order; only an add of a later fragment (another ``syncFrom``)
opens a new link to it.  Every forward is idempotent (``resend``): a follower
that already holds an entry with identical bytes acknowledges it again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from pigeon.core.errors import (
    ConnectionClosed,
    EntryNotFound,
    PigeonError,
    SegmentNotFound,
    ServiceUnavailable,
)
from pigeon.core.replication import BookieClient
from pigeon.core.storage import LedgerStorage

__all__ = ["Forwarder", "Replication", "is_lost_replica"]

log = logging.getLogger(__name__)

ForwardCallback = Callable[[Any, BaseException | None], None]

#: entries copied per read when a follower is brought up to date
_CATCH_UP_BATCH = 256


def is_lost_replica(error: BaseException) -> bool:
    """Is ``error`` a follower being unavailable (replace it), not a refusal (fail)?"""
    if isinstance(error, PigeonError):
        return error.retriable
    return isinstance(error, OSError)


class _Link:
    __slots__ = (
        "address",
        "conn",
        "failed",
        "last_used",
        "queue",
        "ready",
        "segment_id",
        "sync_from",
    )

    def __init__(self, segment_id: int, address: str, sync_from: int) -> None:
        self.segment_id = segment_id
        self.address = address
        self.sync_from = sync_from
        self.conn: Any = None
        self.ready = False
        self.failed: BaseException | None = None
        self.queue: list[tuple[int, int, bytes | memoryview, ForwardCallback]] = []
        self.last_used = 0.0


class Forwarder:
    """The links of one bookie to its segments' followers."""

    def __init__(
        self,
        store: LedgerStorage,
        client: BookieClient,
        nursery: trio.Nursery,
        *,
        idle_s: float = 60.0,
    ) -> None:
        self.store = store
        self.client = client
        self.nursery = nursery
        self.idle_s = idle_s
        self._links: dict[tuple[int, str], _Link] = {}
        self.forwarded = 0
        self.caught_up = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Drop links unused for ``idle_s`` (their segments were closed or moved)."""
        task_status.started()
        while True:
            await trio.sleep(self.idle_s)
            now = trio.current_time()
            for key, link in list(self._links.items()):
                if now - link.last_used > self.idle_s and not link.queue:
                    del self._links[key]

    def forward(
        self,
        segment_id: int,
        address: str,
        entry_id: int,
        lac: int,
        data: bytes | memoryview,
        sync_from: int,
        callback: ForwardCallback,
    ) -> None:
        """Send one entry to one follower; ``callback(result, error)`` runs once."""
        key = (segment_id, address)
        link = self._links.get(key)
        if link is None or (link.failed is not None and link.sync_from != sync_from):
            # new, or failed before the writer's last ensemble change: a follower picked
            # again (it came back) gets a fresh link that first brings it up to date
            link = self._links[key] = _Link(segment_id, address, sync_from)
            self.nursery.start_soon(self._open, link, sync_from)
        link.last_used = trio.current_time()
        if link.failed is not None:
            callback(None, link.failed)
        elif link.ready:
            self._send(link, entry_id, lac, data, callback)
        else:
            link.queue.append((entry_id, lac, data, callback))

    def _send(
        self,
        link: _Link,
        entry_id: int,
        lac: int,
        data: bytes | memoryview,
        callback: ForwardCallback,
    ) -> None:
        def done(result: Any, error: BaseException | None) -> None:
            if error is not None and link.failed is None and is_lost_replica(error):
                link.failed = error
                log.warning(
                    "follower lost segment=%d follower=%s error=%s",
                    link.segment_id,
                    link.address,
                    error,
                )
            callback(result, error)

        if link.failed is not None:
            callback(None, link.failed)
            return
        try:
            self.client.add_entry_nowait(
                link.conn, link.segment_id, entry_id, lac, data, done, resend=True
            )
            self.forwarded += 1
        except ConnectionClosed as exc:
            done(None, exc)

    async def _open(self, link: _Link, sync_from: int) -> None:
        try:
            link.conn = await self.client.connection(link.address)
            try:
                state = await self.client.segment_info(link.address, link.segment_id)
                follower_last = int(state["last_entry_id"])
            except SegmentNotFound:
                follower_last = -1
            if link.queue:
                first_queued = link.queue[0][0]
                await self._catch_up(link, max(follower_last + 1, sync_from), first_queued - 1)
        except (PigeonError, OSError) as exc:
            if link.failed is None:
                link.failed = exc if isinstance(exc, PigeonError) else ConnectionClosed(str(exc))
            log.warning(
                "follower unreachable segment=%d follower=%s error=%s",
                link.segment_id,
                link.address,
                exc,
            )
        link.ready = True
        queue, link.queue = link.queue, []
        for entry_id, lac, data, callback in queue:
            self._send(link, entry_id, lac, data, callback)

    async def _catch_up(self, link: _Link, first: int, last: int) -> None:
        """Copy entries ``first..last`` from this bookie to the follower, and wait until
        it confirmed them all (so that later entries never leave it with a gap)."""
        if first > last:
            return
        pending = 0
        errors: list[BaseException] = []
        settled = trio.Event()

        def done(result: Any, error: BaseException | None) -> None:
            nonlocal pending
            pending -= 1
            if error is not None:
                errors.append(error)
            if pending == 0:
                settled.set()

        lac = self.store.segment_info(link.segment_id).lac
        entry = first
        while entry <= last:
            try:
                got = await self.store.read_entries_async(
                    link.segment_id, entry, last, max_count=_CATCH_UP_BATCH
                )
            except (EntryNotFound, SegmentNotFound):
                got = []
            if not got:
                # nothing more here: the follower cannot be brought further
                log.warning(
                    "catch-up stops segment=%d follower=%s at entry=%d",
                    link.segment_id,
                    link.address,
                    entry,
                )
                break
            for entry_id, data in got:
                pending += 1
                self.client.add_entry_nowait(
                    link.conn, link.segment_id, entry_id, lac, data, done, resend=True
                )
            self.caught_up += len(got)
            entry = got[-1][0] + 1
        if pending:
            await settled.wait()
        if errors:
            raise errors[0]
        log.info(
            "follower caught up segment=%d follower=%s entries=%d..%d",
            link.segment_id,
            link.address,
            first,
            entry - 1,
        )


class Replication:
    """One leader-follower add at the leader: answers once the entry is durable here and
    ``needed`` followers confirmed it, or once every forward ended."""

    __slots__ = (
        "acks",
        "answered",
        "conn",
        "entry_id",
        "local_done",
        "lost",
        "needed",
        "pending",
        "request_id",
        "segment_id",
    )

    def __init__(
        self,
        conn: Any,
        request_id: int,
        segment_id: int,
        entry_id: int,
        followers: int,
        needed: int,
    ) -> None:
        self.conn = conn
        self.request_id = request_id
        self.segment_id = segment_id
        self.entry_id = entry_id
        self.pending = followers
        self.needed = min(needed, followers)
        self.acks = 0
        self.lost: list[str] = []
        self.local_done = False
        self.answered = False

    def local(self, error: PigeonError | None) -> None:
        if error is not None:
            self._fail(error)
            return
        self.local_done = True
        self._maybe_answer()

    def follower(self, address: str, error: BaseException | None) -> None:
        self.pending -= 1
        if error is None:
            self.acks += 1
        elif is_lost_replica(error):
            self.lost.append(address)
        else:
            self._fail(
                error
                if isinstance(error, PigeonError)
                else ServiceUnavailable(f"follower {address}: {error}")
            )
            return
        self._maybe_answer()

    def _fail(self, error: PigeonError) -> None:
        if not self.answered:
            self.answered = True
            self.conn.respond_error(self.request_id, error)

    def _maybe_answer(self) -> None:
        if self.answered or not self.local_done:
            return
        if self.acks >= self.needed or self.pending == 0:
            self.answered = True
            self.conn.respond(
                self.request_id,
                "addResponse",
                {
                    "segmentId": self.segment_id,
                    "entryId": self.entry_id,
                    "copies": 1 + self.acks,
                    "lostReplicas": list(self.lost),
                },
            )
