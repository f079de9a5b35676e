"""Recovery and repair of a segment store's files.

Recovery (``run`` before ``task_status.started()``): see "Recovery" in
:mod:`pigeon.bookie._storage`; the scan itself is
:func:`~pigeon.bookie._segment_scan.scan_tail`.  Repair: a recovery add of an entry
stored damaged here rewrites it in place where its bytes provably belong (see "Repair"
there).
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os

from pigeon.bookie._index import (
    INDEX_HEADER_SIZE,
    INDEX_RECORD_SIZE,
    decode_checkpoints,
    encode_checkpoints,
    encode_index_header,
)
from pigeon.bookie._segment import (
    FILE_HEADER_SIZE,
    RECORD_HEADER_SIZE,
    Buffer,
    ReadFn,
    crc32c,
    decode_meta,
    encode_file_header,
    encode_record_header,
    parse_record_header,
)
from pigeon.bookie._segment_scan import TailScan, locate_record, scan_tail
from pigeon.bookie._storage_state import (
    STORE_FORMAT,
    TAIL_CHECKPOINTS,
    SegmentState,
    StoreBase,
    file_name,
    logger,
    pread,
    pwritev_all,
)
from pigeon.core.errors import BookieReadOnly, DataDirLocked, InvalidEntryId, StorageError

__all__ = ["StoreRecovery"]


class StoreRecovery(StoreBase):
    """Opening the data directory, recovering every segment, repairing damaged entries."""

    def _open_all(self) -> None:
        """Blocking: lock the directory, recover every segment (worker thread)."""
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self._root / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataDirLocked(
                f"data directory {self._root} is in use by another bookie or standalone:"
                " stop it, or use another data directory"
            ) from None
        fmt = self._root / "FORMAT"
        if fmt.exists() and fmt.stat().st_size:
            if fmt.read_bytes() != STORE_FORMAT:
                head = fmt.read_bytes()[:80].split(b"\n", 1)[0].decode("ascii", "replace")
                raise StorageError(
                    f"{self._root} holds another ledger storage ({head!r}), not"
                    " segment-files: start the bookie with the storage that wrote it"
                )
        else:
            tmp = fmt.with_suffix(".tmp")
            tmp.write_bytes(STORE_FORMAT)
            os.replace(tmp, fmt)
        self._dir_fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

        files: dict[int, set[str]] = {}
        changed = False
        for entry in os.scandir(self._dir):
            stem, dot, suffix = entry.name.partition(".")
            if suffix.endswith("tmp"):
                os.unlink(entry.path)
                changed = True
                continue
            if len(stem) != 16 or not dot or suffix not in ("log", "idx", "meta"):
                logger.warning("ignoring unknown file path=%s", entry.path)
                continue
            try:
                segment_id = int(stem, 16)
            except ValueError:
                logger.warning("ignoring unknown file path=%s", entry.path)
                continue
            files.setdefault(segment_id, set()).add(suffix)
        segments = self._segments  # filled as we go: run() closes them on failure
        for segment_id, kinds in sorted(files.items()):
            if "log" not in kinds:
                for suffix in kinds:  # leftovers of an interrupted delete
                    os.unlink(self._dir / file_name(segment_id, "." + suffix))
                changed = True
                continue
            seg = self._recover_segment(segment_id)
            if seg is None:
                changed = True
            else:
                segments[segment_id] = seg
        if changed:
            os.fsync(self._dir_fd)
        c = self._counters
        damaged = sum(len(s.corrupt) for s in segments.values())
        logger.log(
            logging.WARNING if c.torn_tails or damaged else logging.INFO,
            "segment store open path=%s segments=%d verified_bytes=%d torn_tails=%d"
            " torn_entries=%d damaged_entries=%d",
            self._root,
            len(segments),
            c.verified_bytes,
            c.torn_tails,
            c.torn_entries,
            damaged,
        )

    def _read_meta(self, segment_id: int) -> tuple[bool, int, int, float] | None:
        """``(fenced, lac, size, mtime)`` from the meta file, None if there is none."""
        path = self._dir / file_name(segment_id, ".meta")
        try:
            with path.open("rb") as f:
                buf = f.read()
                mtime = os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return None
        meta = decode_meta(buf, segment_id)
        if meta is None:
            # A meta file is only ever replaced atomically: this is media damage.  Its
            # fenced flag may have been set, and a fence must win: assume fenced.
            logger.error("damaged meta file, assuming fenced segment=%d", segment_id)
            return True, -1, len(buf), mtime
        return meta[0], meta[1], len(buf), mtime

    def _recover_segment(self, segment_id: int) -> SegmentState | None:
        meta = self._read_meta(segment_id)
        log_path = self._dir / file_name(segment_id, ".log")
        idx_path = self._dir / file_name(segment_id, ".idx")
        fd = os.open(log_path, os.O_RDWR | os.O_CLOEXEC)
        idx_fd = -1
        try:
            st = os.fstat(fd)
            size, mtime = st.st_size, st.st_mtime  # mtime: before recovery writes
            if size < FILE_HEADER_SIZE:
                if meta is None:  # created by a first add that never completed
                    os.close(fd)
                    fd = -1
                    log_path.unlink()
                    idx_path.unlink(missing_ok=True)
                    return None
                os.ftruncate(fd, 0)
                os.pwrite(fd, encode_file_header(segment_id), 0)
                os.fsync(fd)
                size = FILE_HEADER_SIZE
            elif os.pread(fd, FILE_HEADER_SIZE, 0) != encode_file_header(segment_id):
                logger.warning("damaged data file header segment=%d", segment_id)
            read = functools.partial(pread, fd)

            idx_fd = os.open(idx_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            isize = os.fstat(idx_fd).st_size
            rebuild = os.pread(idx_fd, INDEX_HEADER_SIZE, 0) != encode_index_header(segment_id)
            if rebuild and size > FILE_HEADER_SIZE:
                logger.warning("index missing or damaged, rebuilding segment=%d", segment_id)
            # where the recovery scan may start: (entry id, position, checkpoints kept),
            # the index's last matching checkpoints first, the start of the file last
            starts: list[tuple[int, int, int]] = []
            more_checkpoints = False  # older checkpoints than those loaded exist
            if not rebuild:
                n = (isize - INDEX_HEADER_SIZE) // INDEX_RECORD_SIZE
                k = min(n, TAIL_CHECKPOINTS)
                more_checkpoints = n > k
                ids, positions = decode_checkpoints(
                    os.pread(
                        idx_fd,
                        k * INDEX_RECORD_SIZE,
                        INDEX_HEADER_SIZE + (n - k) * INDEX_RECORD_SIZE,
                    )
                )
                for j in range(k - 1, -1, -1):
                    if checkpoint_valid(read, segment_id, ids[j], positions[j], size):
                        starts.append((ids[j], positions[j], n - k + j + 1))
                if k and not starts:
                    logger.warning("index does not match data, rebuilding segment=%d", segment_id)
                    rebuild = True
            starts.append((0, FILE_HEADER_SIZE, 0))
            # Verify at least the last ``verify_tail_bytes``: start from the latest
            # checkpoint that far from the end (else the earliest loaded one; the start
            # of the file when it is that small).
            limit = size - self._verify_tail
            if limit <= FILE_HEADER_SIZE:
                starts = starts[-1:]
            else:
                first_ok = next((i for i, c in enumerate(starts) if c[1] <= limit), 0)
                if first_ok == len(starts) - 1 and len(starts) > 1 and more_checkpoints:
                    # every checkpoint loaded is inside the window (a small index
                    # interval): the earliest of them bounds the scan, not the file start
                    first_ok = len(starts) - 2
                starts = starts[first_ok:]
            for candidate in starts:
                cp_id, cp_pos, keep = candidate
                scan = scan_tail(
                    read,
                    segment_id,
                    cp_pos,
                    cp_id,
                    size,
                    interval=self._index_interval,
                    last_checkpoint=cp_pos,
                    max_dense=2 * self._dense_window,
                )
                if scan.records or cp_pos == FILE_HEADER_SIZE:
                    break
                # The checkpoint's own record is torn: the last entry stored is before
                # it (and with skipping ids, not necessarily cp_id - 1): scan again from
                # the checkpoint before, dropping this one.
            self._counters.verified_bytes += size - cp_pos
            meta_lac = meta[1] if meta is not None else -1
            if scan.end < size:
                self._log_torn_tail(segment_id, scan, meta_lac)
                os.ftruncate(fd, scan.end)
                os.fsync(fd)
            elif meta_lac >= scan.next_id:
                logger.error(
                    "confirmed entries missing segment=%d last_entry=%d lac=%d entries=%d..%d:"
                    " gone from this copy (restored from a replica when read, if one has them)",
                    segment_id,
                    scan.next_id - 1,
                    meta_lac,
                    scan.next_id,
                    meta_lac,
                )
            if scan.corrupt:
                logger.error(
                    "damaged entries found at start segment=%d count=%d entries=%s: reads"
                    " of them fail with CorruptEntry (repaired from a replica when read, if"
                    " one has them)",
                    segment_id,
                    len(scan.corrupt),
                    scan.corrupt,
                )
            if rebuild:
                os.ftruncate(idx_fd, 0)
                os.pwrite(idx_fd, encode_index_header(segment_id), 0)
            else:
                os.ftruncate(idx_fd, INDEX_HEADER_SIZE + keep * INDEX_RECORD_SIZE)
            if scan.checkpoints:
                os.pwrite(
                    idx_fd,
                    encode_checkpoints(scan.checkpoints),
                    INDEX_HEADER_SIZE + keep * INDEX_RECORD_SIZE,
                )
            fenced, lac, meta_size, meta_mtime = meta if meta is not None else (False, -1, 0, 0.0)
            if scan.records == 0 and meta is None and not scan.torn_whole:
                # nothing was ever acknowledged (whole records that fail their checksum
                # are damage, not an add cut short: the segment stays, empty)
                os.close(fd)
                os.close(idx_fd)
                fd = idx_fd = -1
                log_path.unlink()
                idx_path.unlink()
                return None
            seg = SegmentState(
                segment_id,
                fd,
                idx_fd,
                base=scan.base,
                starts=scan.starts,
                next_id=scan.next_id,
                end=scan.end,
                lac=max(lac, scan.lac),
                fenced=fenced,
                corrupt=scan.corrupt,
                last_cp_pos=scan.checkpoints[-1][1] if scan.checkpoints else cp_pos,
                idx_count=keep + len(scan.checkpoints),
                meta_size=meta_size,
            )
            seg.touched = max(mtime, meta_mtime)  # wall clock, for now
            return seg
        except BaseException:
            for f in (fd, idx_fd):
                if f >= 0:
                    try:
                        os.close(f)
                    except OSError:
                        pass
            raise

    def _log_torn_tail(self, segment_id: int, scan: TailScan, meta_lac: int) -> None:
        """One line per truncated tail: what was dropped, and whether the writer had
        confirmed any of it (then acknowledged entries are gone from this copy)."""
        c = self._counters
        c.torn_tails += 1
        c.torn_entries += len(scan.torn_ids)
        confirmed = max(scan.torn_lac, meta_lac)
        kept_last = scan.next_id - 1
        if confirmed > kept_last:
            logger.error(
                "torn tail truncated segment=%d bytes=%d kept_last_entry=%d"
                " dropped_entries=%s confirmed_up_to=%d: entries %d..%d were acknowledged"
                " and are gone from this copy (restored from a replica when read, if one"
                " has them)",
                segment_id,
                scan.torn_bytes,
                kept_last,
                scan.torn_summary(),
                confirmed,
                kept_last + 1,
                confirmed,
            )
        else:
            logger.warning(
                "torn tail truncated segment=%d bytes=%d kept_last_entry=%d"
                " dropped_entries=%s (an unfinished write, or lost data)",
                segment_id,
                scan.torn_bytes,
                kept_last,
                scan.torn_summary(),
            )

    def _repair(self, seg: SegmentState, entry_id: int, payload: Buffer, lac: int) -> None:
        """Rewrite damaged entry ``entry_id`` in place with ``payload`` (a good copy),
        where its bytes provably belong; raise InvalidEntryId anywhere else.

        Blocking, but small: a scan from the sparse checkpoint before the entry (one
        index interval) and one ``pwrite``; the caller's durability waiter covers the
        fsync.
        """
        if self._read_only is not None:
            raise BookieReadOnly(f"bookie is read-only: {self._read_only}")
        read = functools.partial(pread, seg.fd)
        sparse = self._sparse_index(seg)
        cp_id, cp_pos = sparse.lookup(entry_id)
        found = None
        for _attempt in range(8):
            found = locate_record(
                read,
                seg.id,
                cp_pos,
                cp_id,
                seg.end,
                entry_id,
                start_trusted=cp_pos == FILE_HEADER_SIZE,
                chunk=self._read_chunk,
            )
            if found is None or found.kind != "lost" or found.trusted or cp_id == 0:
                break
            # the damage starts at the checkpoint itself: scan from the one before
            cp_id, cp_pos = sparse.lookup(cp_id - 1)
        where = f"segment={seg.id} entry={entry_id}"
        if found is None:
            raise InvalidEntryId(f"{where} is not stored here: it cannot be added below the end")
        if found.kind == "record":
            if found.size - RECORD_HEADER_SIZE != len(payload) or crc32c(payload) != (
                found.payload_crc
            ):
                raise InvalidEntryId(f"{where} is stored with other content")
            bufs, at, how = [payload], found.pos + RECORD_HEADER_SIZE, "payload rewritten"
        else:
            if not (
                found.trusted
                and found.lo == found.hi == entry_id
                and found.size == RECORD_HEADER_SIZE + len(payload)
            ):
                raise InvalidEntryId(
                    f"{where}: the damaged bytes at {found.pos} ({found.size} bytes, ids"
                    f" {found.lo}..{found.hi}) cannot be rewritten with this entry alone"
                )
            header = encode_record_header(seg.id, entry_id, min(lac, entry_id - 1), payload)
            bufs, at, how = [header, payload], found.pos, "record rewritten"
        if found.kind == "lost" or not found.ok:
            try:
                pwritev_all(seg.fd, bufs, at, sum(len(b) for b in bufs))
            except OSError as exc:
                raise self._io_failed(f"repair {where}", exc)
            if found.kind == "lost" and seg.base <= entry_id < seg.base + len(seg.starts):
                seg.starts[entry_id - seg.base] = found.pos
            self._counters.repaired += 1
            logger.warning(
                "damaged entry repaired from a good copy segment=%d entry=%d how=%s",
                seg.id,
                entry_id,
                how,
            )
        seg.corrupt.discard(entry_id)


def checkpoint_valid(read: ReadFn, segment_id: int, entry_id: int, pos: int, size: int) -> bool:
    if not FILE_HEADER_SIZE <= pos <= size - RECORD_HEADER_SIZE or entry_id < 0:
        return False
    h = parse_record_header(read(pos, RECORD_HEADER_SIZE), 0)
    return h is not None and h[1] == segment_id and h[2] == entry_id
