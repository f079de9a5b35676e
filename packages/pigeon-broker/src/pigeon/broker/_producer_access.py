"""The I/O around :class:`~pigeon.broker._access.ProducerAccess`: loading and persisting a
topic's producer epoch, waiting in line (``wait_for_exclusive``), fencing.

A topic gets its access state only once a producer asks for an exclusive mode (shared
producers on a topic that never saw one pay nothing).  The epoch is read from the metadata
store (:func:`pigeon.core.paths.producer_epoch_path`) the first time, so a broker that
takes over a topic knows which producers are fenced; it is written (raised only, one write
at a time) before a producer that raised it is answered.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Callable
from typing import Any

import trio

from pigeon.broker._access import Admission, MustWait, ProducerAccess
from pigeon.core.errors import NodeExists, NotOwner, ProducerFenced
from pigeon.core.paths import producer_epoch_path

__all__ = ["AccessControl"]

log = logging.getLogger(__name__)

#: a waiter looks again at least this often (a client that gave up, a topic gone)
_RECHECK_S = 1.0


class _Slot:
    def __init__(self, access: ProducerAccess) -> None:
        self.access = access
        self.changed = trio.Event()
        self.save_lock = trio.Lock()
        self.saved = access.epoch

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class AccessControl:
    """Access modes of the topics a broker serves (one per broker service)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._slots: weakref.WeakKeyDictionary[Any, _Slot] = weakref.WeakKeyDictionary()
        self._loading: weakref.WeakKeyDictionary[Any, trio.Lock] = weakref.WeakKeyDictionary()

    def in_use(self, topic: Any) -> bool:
        return topic in self._slots

    async def _slot(self, topic: Any) -> _Slot:
        slot = self._slots.get(topic)
        if slot is not None:
            return slot
        lock = self._loading.setdefault(topic, trio.Lock())
        async with lock:
            slot = self._slots.get(topic)
            if slot is None:
                epoch = 0
                if topic.persistent:
                    stat = await self.store.get(producer_epoch_path(topic.name))
                    if stat is not None:
                        epoch = int(json.loads(stat.value)["epoch"])
                slot = self._slots[topic] = _Slot(ProducerAccess(topic.name.full, epoch))
        return slot

    async def admit(
        self,
        topic: Any,
        name: str,
        mode: str,
        epoch: int,
        still_wanted: Callable[[], None],
    ) -> Admission:
        """Admit producer ``name`` in ``mode`` (see :meth:`ProducerAccess.admit`), waiting
        in line for ``wait_for_exclusive``; the epoch is persisted when it went up."""
        if mode == "shared" and topic not in self._slots:
            return Admission(0)
        slot = await self._slot(topic)
        ticket: object | None = None
        try:
            while True:
                connected = [n for n in topic.producers if n != name]
                try:
                    before = slot.access.state()
                    admission = slot.access.admit(name, mode, epoch, connected, ticket)
                    ticket = None
                    break
                except MustWait as wait:
                    ticket = wait.ticket
                    changed = slot.changed
                    with trio.move_on_after(_RECHECK_S):
                        await changed.wait()
                    if topic.unloaded:
                        raise NotOwner(
                            f"{topic.name} was unloaded here while waiting for exclusive"
                            " access; look it up again"
                        ) from None
                    still_wanted()
        finally:
            if ticket is not None:  # gave up waiting: the next in line may go
                slot.access.leave(ticket)
                slot.notify()
        if admission.raised and topic.persistent:
            try:
                await self._save(topic, slot)
            except BaseException:
                # not admitted after all: nobody fenced, the previous holder holds on
                slot.access.undo(name, admission, before)
                slot.notify()
                raise
        return admission

    async def _save(self, topic: Any, slot: _Slot) -> None:
        async with slot.save_lock:
            epoch = slot.access.epoch
            if epoch <= slot.saved:
                return
            path = producer_epoch_path(topic.name)
            doc = json.dumps({"epoch": epoch}).encode()
            try:
                await self.store.create(path, doc)
            except NodeExists:
                await self.store.set(path, doc)
            slot.saved = epoch

    def fenced_error(self, topic: Any, name: str) -> ProducerFenced:
        return ProducerFenced(
            f"producer {name!r} was fenced on {topic.name.full} by an exclusive_with_fencing"
            " producer"
        )

    def released(self, topic: Any, name: str) -> None:
        """Producer ``name`` left ``topic``: the next waiter in line may go."""
        slot = self._slots.get(topic)
        if slot is not None and slot.access.released(name):
            slot.notify()
