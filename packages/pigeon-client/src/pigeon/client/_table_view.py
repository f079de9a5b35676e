"""TableView (Pulsar's name): a live dict of the latest value of every key of a topic.

A TableView reads its topic with a reader from the earliest message with
``read_compacted=True`` (the compacted view, then the live tail); a message with a key
sets the key's value, one with an empty value (a tombstone) removes the key, messages
without a key are left out.  ``create_table_view`` returns once the view holds
everything up to the topic's last message at that time; after that a task of the
engine keeps it up to date and calls the listeners (``for_each_and_listen``).

The dict is read from any thread (under a lock); the faces differ in where listeners
run: on the engine (trio face, sync face: keep them short) or on the asyncio loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import trio

from pigeon.client._options import ReaderOptions
from pigeon.core.errors import AlreadyClosed, PigeonError

__all__ = ["TableViewCore", "TableViewOptions", "TableViewBase"]

log = logging.getLogger(__name__)

#: ``fn(key, value)``; value None: the key was removed (a tombstone)
Listener = Callable[[str, "bytes | None"], None]


@dataclass(frozen=True)
class TableViewOptions:
    """A TableView's options (``create_table_view``'s signature)."""

    topic: str
    receiver_queue_size: int = 10_000


class TableViewCore:
    """*engine*: the reader and its pump; the dict and listeners, thread-safe."""

    def __init__(self, call: Callable[[Listener, str, bytes | None], None]) -> None:
        self._call = call
        self._lock = threading.RLock()
        self.data: dict[str, bytes] = {}
        self.listeners: list[Listener] = []
        self.reader: Any = None
        self.scope = trio.CancelScope()
        self.closed = False

    async def open(self, engine: Any, codecs: Any, options: TableViewOptions) -> None:
        """*engine*: open the reader and read up to the topic's last message."""
        from pigeon.client.trio import Reader, open_face  # the engine's own face

        reader_options = ReaderOptions(
            options.topic,
            "earliest",
            receiver_queue_size=options.receiver_queue_size,
            read_compacted=True,
        )
        self.reader = await open_face(Reader(), engine, codecs, reader_options)
        try:
            while await self.reader.has_message_available():
                self._apply(await self.reader.read_next())
        except BaseException:
            await self.reader.close()
            raise
        engine.nursery.start_soon(self._pump)

    async def _pump(self) -> None:
        with self.scope:
            try:
                while True:
                    self._apply(await self.reader.read_next())
            except AlreadyClosed:
                return
            except PigeonError as exc:
                log.warning("table view stopped topic=%s error=%s", self.reader, exc)

    def _apply(self, msg: Any) -> None:
        key = msg.key
        if key is None:
            return
        value: bytes | None = msg.value if len(msg.value) else None
        with self._lock:
            if value is None:
                self.data.pop(key, None)
            else:
                self.data[key] = value
            for fn in list(self.listeners):
                self._call(fn, key, value)

    def listen(self, fn: Listener, *, existing: bool) -> None:
        """Add a listener; ``existing``: call it first for every entry there is."""
        with self._lock:
            self.listeners.append(fn)
            if existing:
                for key, value in list(self.data.items()):
                    self._call(fn, key, value)

    async def close(self) -> None:
        """*engine*"""
        if self.closed:
            return
        self.closed = True
        self.scope.cancel()
        if self.reader is not None:
            await self.reader.close()


def call_here(fn: Listener, key: str, value: bytes | None) -> None:
    """Call a listener where the update happens; its errors are logged."""
    try:
        fn(key, value)
    except Exception:
        log.exception("table view listener failed key=%r", key)


class TableViewBase:
    """The dict-like reading side of every face's TableView."""

    _core: TableViewCore

    def get(self, key: str, default: bytes | None = None) -> bytes | None:
        with self._core._lock:
            return self._core.data.get(key, default)

    def __getitem__(self, key: str) -> bytes:
        with self._core._lock:
            return self._core.data[key]

    def __contains__(self, key: object) -> bool:
        with self._core._lock:
            return key in self._core.data

    def __len__(self) -> int:
        with self._core._lock:
            return len(self._core.data)

    def size(self) -> int:
        return len(self)

    def is_empty(self) -> bool:
        return len(self) == 0

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def keys(self) -> list[str]:
        with self._core._lock:
            return list(self._core.data)

    def values(self) -> list[bytes]:
        with self._core._lock:
            return list(self._core.data.values())

    def items(self) -> list[tuple[str, bytes]]:
        with self._core._lock:
            return list(self._core.data.items())

    def for_each(self, fn: Callable[[str, bytes], None]) -> None:
        """``fn(key, value)`` for every entry there is now."""
        for key, value in self.items():
            fn(key, value)

    def listen(self, fn: Listener) -> None:
        """``fn(key, value)`` for every update from now on (value None: key removed)."""
        self._core.listen(fn, existing=False)

    def for_each_and_listen(self, fn: Listener) -> None:
        """``fn(key, value)`` for every entry there is, then for every update."""
        self._core.listen(fn, existing=True)
