"""The tiered-storage seam: offloaders copy closed segments to an object store.

A broker offloads a topic's closed segments (whole, never the one being written) through
an :class:`Offloader` chosen by name among those registered with the ``pigeon_offloaders``
hook (the ``[broker]`` key ``managed_ledger_offload_driver``, Pulsar's
``managedLedgerOffloadDriver``).  Built in (registered by pigeon-broker): ``filesystem``
(a directory, e.g. a mounted NFS or HDFS path) and ``s3`` (any S3-compatible store).
The ledger's metadata records where each segment lives; reads of an offloaded range go
to the offloader, transparently to consumers, readers, seeks and the Spark source.

The contract:

* :meth:`Offloader.offload` returns only once the whole segment is stored and readable;
  its result (a JSON-able dict) is the location the ledger metadata records.  A failed
  upload raises :class:`~pigeon.core.errors.OffloadError` (retriable) and leaves the
  bookie copy in place: the broker retries later.  Offloading the same segment again
  (after a crash between the upload and the metadata update) overwrites the same
  objects: it leaves no orphan.
* :meth:`Offloader.read` returns ``(entry_id, payload)`` pairs like a bookie's read,
  checking each entry's CRC: it stops before a damaged entry, and raises
  :class:`~pigeon.core.errors.CorruptEntry` only when the first one asked for is damaged
  (so that skipping damage never skips the intact entries before it).
* :meth:`Offloader.delete` removes an offloaded segment; a missing one is no error, so
  a retried delete succeeds.  Besides a location :meth:`Offloader.offload` returned, it
  takes ``{"driver": name, "key": key}`` alone: the key of an upload the broker started
  and did not record (cut short, or still running when its segment was removed), whose
  objects, whole or partial, must go too.

:class:`BlobOffloader` implements all of it over four object-store primitives (write an
object from chunks, read a byte range, read a whole object, delete objects), so a new
store (GCS, Azure) only supplies those; a fifth, optional one (list objects, with their
modification times) lets the broker's sweeper find objects no segment refers to
(:meth:`BlobOffloader.list_objects`, :meth:`BlobOffloader.delete_objects`).  Its
layout — what is on the object store:

``<key>/data``
    the segment's entries back to back, exactly as the bookies stored them (the broker
    header and the columnar batch; no framing: the index says where each one starts).

``<key>/index``
    written **after** the data object is complete, so a half-written upload (no index,
    or an index whose checksum fails) is never read as a whole segment.  Little-endian::

        magic        4 bytes  b"PGOX"
        version      u16      1
        flags        u16      0
        segment_id   u64
        first_entry  u64      id of the first entry (entries are dense from there)
        count        u64      number of entries n
        data_size    u64      bytes in <key>/data
        offsets      (n + 1) x u64   offsets[i] = where entry first_entry+i starts;
                                     offsets[n] = data_size
        crcs         n x u32  zlib.crc32 of each entry
        checksum     u32      zlib.crc32 of everything above

Reads fetch byte ranges of the data object, reading ahead (``read_ahead_bytes``, whole
entries) and keeping the last few ranges, so that a catch-up read walking a segment
makes one request per range, not one per entry.
"""

from __future__ import annotations

import abc
import contextlib
import struct
import zlib
from array import array
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pigeon.core.errors import CorruptEntry, EntryNotFound, OffloadError

__all__ = [
    "BlobOffloader",
    "OffloadIndex",
    "Offloader",
    "OffloaderFactory",
    "StoredObject",
    "decode_index",
    "encode_index",
]

_MAGIC = b"PGOX"
_VERSION = 1
_HEADER = struct.Struct("<4sHHQQQQ")
_CHECKSUM = struct.Struct("<I")


@runtime_checkable
class Offloader(Protocol):
    """An object store holding offloaded segments (see the module doc for the contract)."""

    #: the driver name (``filesystem``, ``s3``)
    name: str

    async def offload(
        self, key: str, segment_id: int, entries: AsyncIterator[list[tuple[int, bytes]]]
    ) -> dict[str, Any]:
        """Store the segment whose entries ``entries`` yields (dense ids from 0, in id
        order, in batches) under ``key``; return its location (what the ledger metadata
        records).

        :raises OffloadError: the store failed (retriable); nothing is recorded.
        """
        ...

    async def read(
        self, location: dict[str, Any], first: int, last: int, *, max_bytes: int
    ) -> list[tuple[int, bytes | memoryview]]:
        """Entries ``first..last`` of an offloaded segment, up to ``max_bytes`` of
        payload (one entry at least).

        :raises OffloadError: the store failed (retriable).
        :raises CorruptEntry: entry ``first`` does not match its checksum (a damaged
            entry after it ends the read before it instead).
        :raises EntryNotFound: ``first`` is past the segment's last entry.
        """
        ...

    async def delete(self, location: dict[str, Any]) -> None:
        """Remove an offloaded segment; a missing one is not an error.  ``location``
        is one :meth:`offload` returned, or ``{"driver", "key"}`` alone (an upload
        that may not have completed): whatever is stored under the key goes."""
        ...

    async def aclose(self) -> None:
        """Release connections and threads."""
        ...


#: ``factory(config) -> Offloader``: what ``pigeon_offloaders`` registers; ``config`` is
#: the broker's :class:`pigeon.broker.BrokerConfig`
OffloaderFactory = Callable[[Any], Offloader]


# ---------------------------------------------------------------------- the index


@dataclass(frozen=True, slots=True)
class OffloadIndex:
    """Where each entry of an offloaded segment lies in its data object."""

    segment_id: int
    first_entry: int
    #: ``count + 1`` offsets into the data object (the last one is its size)
    offsets: array[int]
    crcs: array[int]

    @property
    def count(self) -> int:
        return len(self.crcs)

    @property
    def last_entry(self) -> int:
        return self.first_entry + self.count - 1

    @property
    def data_size(self) -> int:
        return self.offsets[-1]

    def span(self, first: int, last: int, max_bytes: int) -> tuple[int, int]:
        """``(first, end)`` entry ids (``end`` exclusive) of ``first..last`` cut at
        ``max_bytes`` of data (one entry at least)."""
        if first < self.first_entry or first > self.last_entry:
            raise EntryNotFound(
                f"segment {self.segment_id} has no offloaded entry {first}"
                f" (entries {self.first_entry}..{self.last_entry})"
            )
        i = first - self.first_entry
        j = min(last, self.last_entry) - self.first_entry + 1
        start = self.offsets[i]
        # the last k with offsets[k] - start <= max_bytes, at least i + 1
        lo, hi = i + 1, j
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.offsets[mid] - start <= max_bytes:
                lo = mid
            else:
                hi = mid - 1
        return first, self.first_entry + lo


def encode_index(index: OffloadIndex) -> bytes:
    """The index object's bytes (layout in the module doc)."""
    if len(index.offsets) != index.count + 1:
        raise ValueError("an index needs count + 1 offsets")
    offsets = array("Q", index.offsets)
    crcs = array("I", index.crcs)
    if struct.pack("=I", 1) != struct.pack("<I", 1):  # pragma: no cover - big-endian hosts
        offsets.byteswap()
        crcs.byteswap()
    body = (
        _HEADER.pack(
            _MAGIC,
            _VERSION,
            0,
            index.segment_id,
            index.first_entry,
            index.count,
            index.data_size,
        )
        + offsets.tobytes()
        + crcs.tobytes()
    )
    return body + _CHECKSUM.pack(zlib.crc32(body))


def decode_index(data: bytes | memoryview, *, what: str = "offload index") -> OffloadIndex:
    """Parse an index object.

    :raises CorruptEntry: not an index, cut short, or its checksum does not match (a
        half-written upload).
    """
    data = bytes(data)
    if len(data) < _HEADER.size + _CHECKSUM.size:
        raise CorruptEntry(f"{what}: {len(data)} bytes is too short for an index")
    body, (checksum,) = data[: -_CHECKSUM.size], _CHECKSUM.unpack(data[-_CHECKSUM.size :])
    if zlib.crc32(body) != checksum:
        raise CorruptEntry(f"{what}: checksum mismatch (a partial or damaged upload)")
    magic, version, _flags, segment_id, first, count, size = _HEADER.unpack_from(body)
    if magic != _MAGIC or version != _VERSION:
        raise CorruptEntry(f"{what}: not a version {_VERSION} PigeonMQ offload index")
    expected = _HEADER.size + 8 * (count + 1) + 4 * count
    if len(body) != expected:
        raise CorruptEntry(f"{what}: {len(body)} bytes, expected {expected} for {count} entries")
    offsets = array("Q")
    offsets.frombytes(body[_HEADER.size : _HEADER.size + 8 * (count + 1)])
    crcs = array("I")
    crcs.frombytes(body[_HEADER.size + 8 * (count + 1) :])
    if struct.pack("=I", 1) != struct.pack("<I", 1):  # pragma: no cover - big-endian hosts
        offsets.byteswap()
        crcs.byteswap()
    if offsets[-1] != size or offsets[0] != 0:
        raise CorruptEntry(f"{what}: offsets do not span the data object")
    return OffloadIndex(segment_id, first, offsets, crcs)


@dataclass(frozen=True, slots=True)
class StoredObject:
    """An object found in an offloader's store (:meth:`BlobOffloader.list_objects`)."""

    #: its path: ``<key>/data``, ``<key>/index`` (or a store's temporary object)
    path: str
    #: when it was last written (wall clock, ms)
    modified_ms: int


# ---------------------------------------------------------------------- the base class


class BlobOffloader(abc.ABC):
    """An :class:`Offloader` over an object store's four primitives (see module doc).

    Subclasses implement :meth:`_write_object`, :meth:`_read_range`,
    :meth:`_read_object` and :meth:`_delete_objects`; each raises
    :class:`~pigeon.core.errors.OffloadError` when the store fails.
    """

    name = "blob"
    #: bytes a read fetches at least (whole entries), to serve the next reads
    read_ahead_bytes = 4 * 1024 * 1024
    #: read-ahead ranges kept (bounds the memory held to about this x read_ahead_bytes)
    cached_ranges = 8
    #: parsed indexes kept
    cached_indexes = 256

    def __init__(self) -> None:
        self._indexes: OrderedDict[str, OffloadIndex] = OrderedDict()
        # (data path, start offset) -> bytes of the last ranges fetched
        self._ranges: OrderedDict[tuple[str, int], bytes | memoryview] = OrderedDict()
        self.range_reads = 0  # requests made for data (tests and stats)

    # -- primitives

    @abc.abstractmethod
    async def _write_object(self, path: str, chunks: AsyncIterator[bytes | memoryview]) -> None:
        """Store the object ``path`` made of ``chunks``, visible whole or not at all."""

    @abc.abstractmethod
    async def _read_range(self, path: str, start: int, end: int) -> bytes | memoryview:
        """Bytes ``start..end`` (exclusive) of the object ``path``."""

    @abc.abstractmethod
    async def _read_object(self, path: str) -> bytes | memoryview:
        """The whole object ``path``."""

    @abc.abstractmethod
    async def _delete_objects(self, paths: Sequence[str]) -> None:
        """Remove the objects; missing ones are no error."""

    async def _list_objects(self, prefix: str, after: str, limit: int) -> list[StoredObject]:
        """Up to ``limit`` objects whose path starts with ``prefix`` and sorts after
        ``after``, in path order (optional: a store without listings is never swept)."""
        raise OffloadError(f"the {self.name} offloader cannot list its objects")

    def _location(self, key: str) -> dict[str, Any]:
        """What a location records besides the key and sizes (the bucket, the root)."""
        return {}

    # -- the sweeper's access (see pigeon.broker's offload sweeper)

    async def list_objects(
        self, prefix: str = "", *, after: str = "", limit: int = 1000
    ) -> list[StoredObject]:
        """Up to ``limit`` stored objects under ``prefix`` whose path sorts after
        ``after``, in path order: a sweep walks the store a page at a time.

        :raises OffloadError: the store failed, or cannot list.
        """
        return await self._list_objects(prefix, after, limit)

    async def delete_objects(self, paths: Sequence[str]) -> None:
        """Remove objects by path (what :meth:`list_objects` found); missing ones are
        no error.  The index of a segment goes before its data (never read half)."""
        ordered = sorted(paths, key=lambda p: (p.rsplit("/", 1)[0], not p.endswith("/index")))
        for path in ordered:
            key = path.rsplit("/", 1)[0]
            self._indexes.pop(key, None)
            self._forget_ranges(f"{key}/data")
        if ordered:
            await self._delete_objects(ordered)

    # -- the Offloader protocol

    async def offload(
        self, key: str, segment_id: int, entries: AsyncIterator[list[tuple[int, bytes]]]
    ) -> dict[str, Any]:
        offsets = array("Q", [0])
        crcs = array("I")
        state = {"next": 0, "size": 0}

        async def chunks() -> AsyncGenerator[bytes | memoryview, None]:
            try:
                async for batch in entries:
                    for entry_id, data in batch:
                        if entry_id != state["next"]:
                            raise OffloadError(
                                f"segment {segment_id}: entry {entry_id} where"
                                f" {state['next']} was expected (entries must be dense)"
                            )
                        state["next"] += 1
                        state["size"] += len(data)
                        offsets.append(state["size"])
                        crcs.append(zlib.crc32(data))
                    if batch:
                        yield b"".join(data for _, data in batch)
            finally:
                aclose = getattr(entries, "aclose", None)
                if aclose is not None:
                    await aclose()

        async with contextlib.aclosing(chunks()) as data_chunks:
            await self._write_object(f"{key}/data", data_chunks)
        index = OffloadIndex(segment_id, 0, offsets, crcs)
        encoded = encode_index(index)

        async def one() -> AsyncIterator[bytes]:
            yield encoded

        await self._write_object(f"{key}/index", one())
        self._remember_index(key, index)
        return {
            "driver": self.name,
            "key": key,
            "entries": index.count,
            "size": index.data_size,
            **self._location(key),
        }

    async def read(
        self, location: dict[str, Any], first: int, last: int, *, max_bytes: int
    ) -> list[tuple[int, bytes | memoryview]]:
        key = str(location["key"])
        self._check_store(location)
        index = await self._index(key)
        first, end = index.span(first, last, max_bytes)
        base = index.first_entry
        start, stop = index.offsets[first - base], index.offsets[end - base]
        path = f"{key}/data"
        block = self._cached_range(path, start, stop)
        if block is None:
            # read ahead: whole entries up to read_ahead_bytes past the start
            _, ahead = index.span(first, index.last_entry, max(self.read_ahead_bytes, stop - start))
            fetch_stop = index.offsets[ahead - base]
            data = await self._read_range(path, start, fetch_stop)
            self.range_reads += 1
            if len(data) != fetch_stop - start:
                raise CorruptEntry(
                    f"offloaded segment {index.segment_id}: {len(data)} bytes read at"
                    f" {start}, expected {fetch_stop - start} (object cut short)"
                )
            self._ranges[(path, start)] = data
            while len(self._ranges) > self.cached_ranges:
                self._ranges.popitem(last=False)
            block = (start, memoryview(data))
        block_start, view = block
        out: list[tuple[int, bytes | memoryview]] = []
        for entry_id in range(first, end):
            i = entry_id - base
            payload = view[index.offsets[i] - block_start : index.offsets[i + 1] - block_start]
            if zlib.crc32(payload) != index.crcs[i]:
                self._forget_ranges(path)
                if out:  # like a bookie: the intact entries before the damaged one
                    break
                raise CorruptEntry(
                    f"offloaded segment {index.segment_id} entry {entry_id}: checksum mismatch"
                )
            out.append((entry_id, bytes(payload)))
        return out

    async def delete(self, location: dict[str, Any]) -> None:
        key = str(location["key"])
        self._indexes.pop(key, None)
        self._forget_ranges(f"{key}/data")
        # the index first: a half-deleted segment is never read as whole
        await self._delete_objects([f"{key}/index"])
        await self._delete_objects([f"{key}/data"])

    async def aclose(self) -> None:
        self._indexes.clear()
        self._ranges.clear()

    # -- helpers

    def _same_place(self, name: str, recorded: Any, ours: Any) -> bool:
        """Is the recorded ``name`` of a location (the bucket, the root) this store's?"""
        return bool(recorded == ours)

    def _check_store(self, location: dict[str, Any]) -> None:
        """A segment offloaded to another store (driver, bucket, directory changed
        since) is not in this one: a retriable error, never \"missing\" (CorruptEntry),
        which readers would skip as damage."""
        key = str(location["key"])
        driver = location.get("driver", self.name)
        if driver != self.name:
            raise OffloadError(
                f"offloaded segment {key} is in a {driver!r} store; this broker's"
                f" offloader is {self.name!r} (managed_ledger_offload_driver)"
            )
        for name, ours in self._location(key).items():
            recorded = location.get(name, ours)
            if not self._same_place(name, recorded, ours):
                raise OffloadError(
                    f"offloaded segment {key} is in {self.name} {name} {recorded!r}; this"
                    f" broker's offloader uses {ours!r}"
                )

    def _remember_index(self, key: str, index: OffloadIndex) -> None:
        self._indexes[key] = index
        self._indexes.move_to_end(key)
        while len(self._indexes) > self.cached_indexes:
            self._indexes.popitem(last=False)

    async def _index(self, key: str) -> OffloadIndex:
        index = self._indexes.get(key)
        if index is None:
            index = decode_index(
                await self._read_object(f"{key}/index"), what=f"offload index {key}"
            )
            self._remember_index(key, index)
        else:
            self._indexes.move_to_end(key)
        return index

    def _cached_range(self, path: str, start: int, stop: int) -> tuple[int, memoryview] | None:
        for (cached_path, block_start), data in self._ranges.items():
            if cached_path == path and block_start <= start and stop <= block_start + len(data):
                self._ranges.move_to_end((cached_path, block_start))
                return block_start, memoryview(data)
        return None

    def _forget_ranges(self, path: str) -> None:
        for cached in [k for k in self._ranges if k[0] == path]:
            del self._ranges[cached]
