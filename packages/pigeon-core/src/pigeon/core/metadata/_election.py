"""Leader election and locks, built only on the abstract :class:`MetadataStore` API.

Every backend gets them for free; they are part of the contract suite.

Leader election follows ZooKeeper's recipe: each candidate creates an ephemeral
sequential node ``<path>/c-<10 digits>``; the lowest sequence number leads.  A candidate
waits for the deletion of its predecessor (or of its own node), then looks again.  The
value of a candidate node is ``candidate_id`` (UTF-8), a NUL byte, then the candidate's
``value`` bytes.

A lock is one ephemeral node at the lock's path whose value names the owner (a broker
address, say).  Whoever creates it holds the lock; waiters watch it and try again when it
is deleted (not fair: any waiter may win).  The lock is lost with the holder's session.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from types import TracebackType

import trio

from pigeon.core.errors import (
    BadVersion,
    InvalidArgument,
    MetadataError,
    NodeExists,
    NoSuchNode,
    SessionExpired,
)
from pigeon.core.metadata._store import (
    EventType,
    MetadataStore,
    check_value,
    join_path,
    node_name,
    sequence_number,
    validate_path,
)

__all__ = ["LeaderElection", "Lock"]

log = logging.getLogger(__name__)

_CANDIDATE_PREFIX = "c-"
#: Cleanup on exit (deleting our node) gets this long before it is abandoned; the
#: session's end removes the node anyway.
_CLEANUP_TIMEOUT = 10.0


def _encode_candidate(candidate_id: str, value: bytes) -> bytes:
    return candidate_id.encode() + b"\x00" + value


def _decode_candidate(raw: bytes) -> tuple[str, bytes]:
    candidate_id, _, value = raw.partition(b"\x00")
    return candidate_id.decode(errors="replace"), value


class LeaderElection:
    """Take part in the election under ``path`` while :meth:`run` runs.

    ``await nursery.start(election.run)`` returns once this candidate's node exists and
    the first look at the candidates was taken (``is_leader`` is then already true for
    the first candidate).  ``run`` keeps watching until cancelled, then withdraws (deletes
    its node, so the next candidate takes over at once).  If the candidate's node
    disappears (the session expired), ``run`` stops leading and raises
    ``SessionExpired``; start it again after ``store.new_session()``.
    """

    def __init__(
        self, store: MetadataStore, path: str, candidate_id: str, value: bytes = b""
    ) -> None:
        self.store = store
        self.path = validate_path(path)
        if not candidate_id or "\x00" in candidate_id:
            raise InvalidArgument("candidate_id must be a non-empty string without NUL")
        self.candidate_id = candidate_id
        self.value = check_value(value)
        self._node: str | None = None
        self._is_leader = False
        self._leader_event = trio.Event()

    def __repr__(self) -> str:
        role = "leader" if self._is_leader else "follower"
        return f"<LeaderElection {self.path!r} {self.candidate_id!r} {role}>"

    @property
    def is_leader(self) -> bool:
        return self._is_leader

    @property
    def node(self) -> str | None:
        """This candidate's node while :meth:`run` runs."""
        return self._node

    async def wait_leader(self) -> None:
        """Return once this candidate leads (at once if it does)."""
        await self._leader_event.wait()

    async def current_leader(self) -> str | None:
        """The ``candidate_id`` of the current leader, ``None`` if there is no candidate."""
        info = await self.current_leader_info()
        return None if info is None else info[0]

    async def current_leader_info(self) -> tuple[str, bytes] | None:
        """``(candidate_id, value)`` of the current leader, or ``None``."""
        while True:
            candidates = await self._candidates()
            if not candidates:
                return None
            stat = await self.store.get(join_path(self.path, candidates[0]))
            if stat is not None:
                return _decode_candidate(stat.value)
            # the leader left between the two reads: look again

    async def _candidates(self) -> list[str]:
        names = await self.store.children(self.path)
        found = [
            (seq, name)
            for name in names
            if name.startswith(_CANDIDATE_PREFIX) and (seq := sequence_number(name)) is not None
        ]
        return [name for _, name in sorted(found)]

    def _set_leader(self, leading: bool) -> None:
        if leading and not self._is_leader:
            log.info("%r: became leader", self)
            self._is_leader = True
            self._leader_event.set()
        elif not leading and self._is_leader:
            log.info("%r: no longer leader", self)
            self._is_leader = False
            self._leader_event = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self._node is not None:
            raise MetadataError(f"{self!r} is already running")
        started = False
        # The watch exists before our node does, so no deletion can slip between a look
        # at the candidates and the wait.
        async with self.store.watch(self.path, prefix=True) as events:
            self._node = await self.store.create(
                join_path(self.path, _CANDIDATE_PREFIX),
                _encode_candidate(self.candidate_id, self.value),
                ephemeral=True,
                sequential=True,
            )
            mine = self._node
            try:
                while True:
                    candidates = await self._candidates()
                    name = node_name(mine)
                    if name not in candidates:
                        raise SessionExpired(f"election node {mine} vanished (session expired?)")
                    index = candidates.index(name)
                    self._set_leader(index == 0)
                    awaited = {mine}
                    if index > 0:
                        awaited.add(join_path(self.path, candidates[index - 1]))
                    if not started:
                        task_status.started()
                        started = True
                    async for event in events:
                        if event.type is EventType.DELETED and event.path in awaited:
                            break
                    else:
                        raise MetadataError(f"election watch on {self.path} ended")
            finally:
                self._set_leader(False)
                self._node = None
                with trio.CancelScope(shield=True), trio.move_on_after(_CLEANUP_TIMEOUT):
                    try:
                        await self.store.delete(mine)
                    except MetadataError:  # gone already, session over, store closing
                        pass


class Lock:
    """A lock at ``path`` whose holder's ``value`` is readable by everyone.

    ``await lock.acquire()`` / ``await lock.release()`` or ``async with lock:``.  The
    lock is held by this object's store session: if the session expires the lock is lost
    (``held`` is not updated; watch ``store.wait_session_expired()``).
    """

    def __init__(self, store: MetadataStore, path: str, value: bytes = b"") -> None:
        self.store = store
        self.path = validate_path(path)
        self.value = check_value(value)
        self._held = False

    def __repr__(self) -> str:
        return f"<Lock {self.path!r} {'held' if self._held else 'free'}>"

    @property
    def held(self) -> bool:
        """Whether this object acquired the lock and has not released it."""
        return self._held

    async def acquire(self, *, blocking: bool = True) -> bool:
        """Take the lock; return True.  If someone holds it: return False at once if
        not ``blocking``, else wait for its release.  ``SessionExpired`` if the
        session expired."""
        if self._held:
            raise InvalidArgument(f"{self!r} is already held by this object")
        while True:
            try:
                await self.store.create(self.path, self.value, ephemeral=True)
            except NodeExists:
                if not blocking:
                    return False
            else:
                self._held = True
                return True
            async with self.store.watch(self.path) as events:
                if not await self.store.exists(self.path):
                    continue
                async for event in events:
                    if event.type is EventType.DELETED:
                        break
                else:
                    raise MetadataError(f"lock watch on {self.path} ended")

    async def release(self) -> None:
        """Release the lock if this object holds it (deleting the lock node only if it
        still carries our value)."""
        if not self._held:
            await trio.lowlevel.checkpoint()
            return
        self._held = False
        stat = await self.store.get(self.path)
        if stat is None or not stat.ephemeral or stat.value != self.value:
            return
        try:
            await self.store.delete(self.path, version=stat.version)
        except (NoSuchNode, BadVersion):
            pass

    async def owner(self) -> bytes | None:
        """The value of the current holder, ``None`` if the lock is free."""
        stat = await self.store.get(self.path)
        return None if stat is None else stat.value

    async def __aenter__(self) -> Lock:
        await self.acquire()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(_CLEANUP_TIMEOUT):
            await self.release()


async def lead_forever(
    store: MetadataStore,
    path: str,
    candidate_id: str,
    work: Callable[[], Awaitable[None]],
    *,
    retry_s: float = 1.0,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Campaign for the leadership of ``path`` and run ``work()`` while leading, for as
    long as this runs.  A lost session (the candidate node vanished) or a failed watch
    ends the term, cancelling ``work``; the candidate campaigns again ``retry_s`` later,
    once the store has a new session (whoever owns the session renews it).  Started once
    the first campaign began."""
    started = False
    while True:
        election = LeaderElection(store, path, candidate_id)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(election.run)
                if not started:
                    started = True
                    task_status.started()
                await election.wait_leader()
                await work()
        except* MetadataError as group:
            log.warning(
                "%s: leadership term ended, campaigning again error=%s",
                path,
                group.exceptions[0],
            )
        if not started:
            started = True
            task_status.started()
        await trio.sleep(retry_s)
