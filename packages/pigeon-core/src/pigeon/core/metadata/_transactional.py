"""The write side of a metadata backend whose writes are planned transactions.

:class:`TransactionalMetadataStore` implements ``create``, ``set``, ``delete`` and
``multi`` (and checks the arguments of ``watch``) once for every backend built on
:class:`~pigeon.core.metadata.Planner` (ZooKeeper, etcd): it checks the arguments as the
contract says, then runs :meth:`~TransactionalMetadataStore._transact`::

    reads = first_reads(ops)
    repeat (at most max_attempts times, with jittered backoff between attempts):
        snapshot = new snapshot
        read `reads` into it; plan; on NeedRead read what it names and plan again
        commit the plan → its results; on StaleRead start again

A backend supplies the I/O and its key layout through the hooks below, and keeps
everything else that is its own: sessions (leases), watches, the thread bridging of its
client library.

=====================  ===========================================================
hook                   what the backend does
=====================  ===========================================================
``session_alive``      whether its session is alive (ephemeral creates need it)
``_require()``         raise ``MetadataError`` unless the store is running
``_watch(path, pre)``  ``watch()`` once the path is checked
``_new_snapshot()``    an empty snapshot of its kind
``_read(need, snap)``  read what :class:`NeedRead` names into the snapshot
``_plan(ops, snap)``   plan with its :class:`Planner` subclass (pure, may raise
                       ``NeedRead``, ``StaleRead`` or the contract's errors)
``_commit_plan()``     commit the plan: its results, ``StaleRead`` if its conditions
                       failed (another writer came between), or an error
``_first_reads()``     optional: what to read before the first plan
``_delete_tree()``     optional: ``delete(recursive=True)``, if it needs more than
                       one planned transaction
=====================  ===========================================================
"""

from __future__ import annotations

import abc
import random
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Generic, TypeVar, cast

import trio

from pigeon.core.errors import InvalidArgument, MetadataError, SessionExpired
from pigeon.core.metadata._plan import Create, Delete, NeedRead, StaleRead, WriteOp, first_reads
from pigeon.core.metadata._store import (
    MetadataStore,
    Op,
    WatchEvent,
    check_value,
    validate_create,
    validate_ops,
    validate_path,
)

__all__ = ["TransactionalMetadataStore"]

S = TypeVar("S")
P = TypeVar("P")


class TransactionalMetadataStore(MetadataStore, Generic[S, P]):
    """A :class:`MetadataStore` whose writes are planned transactions over snapshots of
    type ``S``, planned as ``P`` (see the module docstring for the hooks)."""

    #: Attempts of a write whose reads keep being invalidated by other writers.
    max_attempts = 50

    # --- the write API -----------------------------------------------------------------

    async def create(
        self, path: str, value: bytes = b"", *, ephemeral: bool = False, sequential: bool = False
    ) -> str:
        value = validate_create(path, value, sequential=sequential)
        self._require()
        if ephemeral and not self.session_alive:
            await trio.lowlevel.checkpoint()
            raise SessionExpired("the metadata session expired; call new_session()")
        results = await self._transact([Create(path, value, ephemeral, sequential)])
        return str(results[0])

    async def set(self, path: str, value: bytes, *, version: int | None = None) -> int:
        validate_path(path)
        value = check_value(value)
        self._require()
        results = await self._transact([Op.set(path, value, version)])
        return cast(int, results[0])

    async def delete(
        self, path: str, *, version: int | None = None, recursive: bool = False
    ) -> None:
        validate_path(path)
        self._require()
        if path == "/":
            await trio.lowlevel.checkpoint()
            raise InvalidArgument("the root node cannot be deleted")
        if recursive:
            await self._delete_tree(path, version)
        else:
            await self._transact([Op.delete(path, version)])

    async def multi(self, ops: list[Op]) -> list[object]:
        ops = validate_ops(ops)
        self._require()
        if not ops:
            await trio.lowlevel.checkpoint()
            return []
        if any(op.ephemeral for op in ops) and not self.session_alive:
            await trio.lowlevel.checkpoint()
            raise SessionExpired("the metadata session expired; call new_session()")
        return await self._transact(ops)

    def watch(
        self, path: str, *, prefix: bool = False
    ) -> AbstractAsyncContextManager[AsyncIterator[WatchEvent]]:
        validate_path(path)
        return self._watch(path, prefix)

    # --- planning and committing ----------------------------------------------------------

    async def _transact(self, ops: Sequence[WriteOp]) -> list[object]:
        """Plan and commit ``ops`` as one transaction; read again and re-plan while
        other writers invalidate the reads (at most :attr:`max_attempts` times)."""
        first = self._first_reads(ops)
        delay = 0.001
        last: StaleRead | None = None
        for _attempt in range(self.max_attempts):
            try:
                plan = await self._plan_reading(ops, first)
                return await self._commit_plan(ops, plan)
            except StaleRead as exc:
                last = exc
            await trio.sleep(delay * random.random())
            delay = min(delay * 2, 0.05)
        raise MetadataError(
            f"metadata write gave up after {self.max_attempts} attempts"
            f" (concurrent changes; last: {last})"
        )

    async def _plan_reading(self, ops: Sequence[WriteOp], first: NeedRead) -> P:
        """Read ``first`` into a new snapshot and plan, reading what the planner asks
        for until it has all it needs."""
        snapshot = self._new_snapshot()
        need = first
        while True:
            await self._read(need, snapshot)
            try:
                return self._plan(ops, snapshot)
            except NeedRead as more:
                need = more

    def _first_reads(self, ops: Sequence[WriteOp]) -> NeedRead:
        """What to read before the first plan of ``ops`` (default: :func:`first_reads`)."""
        return first_reads(ops)

    async def _delete_tree(self, path: str, version: int | None) -> None:
        """``delete(path, version=version, recursive=True)`` (``path`` is not the root);
        by default one planned transaction."""
        await self._transact([Delete(path, version, recursive=True)])

    # --- backend hooks ----------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def session_alive(self) -> bool:
        """Whether the store's session is alive."""

    @abc.abstractmethod
    def _require(self) -> object:
        """Raise ``MetadataError`` unless the store is running."""

    @abc.abstractmethod
    def _watch(
        self, path: str, prefix: bool
    ) -> AbstractAsyncContextManager[AsyncIterator[WatchEvent]]:
        """``watch(path, prefix=prefix)`` with a valid ``path``."""

    @abc.abstractmethod
    def _new_snapshot(self) -> S:
        """An empty snapshot."""

    @abc.abstractmethod
    async def _read(self, need: NeedRead, snapshot: S) -> None:
        """Read what ``need`` names into ``snapshot``."""

    @abc.abstractmethod
    def _plan(self, ops: Sequence[WriteOp], snapshot: S) -> P:
        """Plan ``ops`` on ``snapshot`` (no I/O)."""

    @abc.abstractmethod
    async def _commit_plan(self, ops: Sequence[WriteOp], plan: P) -> list[object]:
        """Commit ``plan``; return the results of ``ops``.  Raise :class:`StaleRead` if
        the transaction's conditions failed (read again and re-plan), or the error."""
