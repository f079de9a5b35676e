"""The journal's preallocated files (pigeon.bookie._journal_file): zeros after the
records are a clean end, never a record nor a torn tail; a torn record is still one
with zeros after it; a kill -9 in the middle of a preparation or of a write loses no
fsynced record and replays no record that was not written."""

from __future__ import annotations

import functools
import logging
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_journal import check_all, fill, open_store

import pigeon.bookie._journal_file as journal_file_mod
from pigeon.bookie._journal_file import Journal, journal_name
from pigeon.bookie._journal_format import (
    FILE_HEADER_SIZE,
    JOURNAL_MAGIC,
    encode_entry_header,
    encode_file_header,
    scan_journal,
)

KIB = 1024


def record(entry_id: int) -> bytes:
    rng = random.Random(entry_id)
    data = rng.randbytes(rng.randrange(0, 12 * KIB))
    return encode_entry_header(1, entry_id, entry_id - 1, data) + data


def write_file(path: Path, seq: int, body: bytes, zeros: int) -> None:
    path.write_bytes(encode_file_header(JOURNAL_MAGIC, seq) + body + bytes(zeros))


def replay_all(directory: Path) -> tuple[list[int], int]:
    """The entry ids a fresh journal replays (each checked against its bytes), and its
    torn tails."""
    journal = Journal(directory, 1 << 20, 0)
    try:
        journal.open_files()
        ids = []
        for rec in journal.replay(None):
            assert rec.payload == record(rec.entry_id)[40:]
            ids.append(rec.entry_id)
        return ids, journal.torn_tails
    finally:
        journal.close()


def ends_at_its_last_record(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        *_, stop = scan_journal(functools.partial(_pread, fd), FILE_HEADER_SIZE, size)
    finally:
        os.close(fd)
    return stop == size


def _pread(fd: int, pos: int, n: int) -> bytes:
    return os.pread(fd, n, pos)


def journal_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "pigeon.bookie._journal" and r.levelno >= logging.WARNING
    ]


# ---------------------------------------------------------------- replay


def test_replay_stops_at_the_preallocated_zeros_without_a_torn_tail(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    body = b"".join(record(i) for i in range(5))
    write_file(tmp_path / journal_name(0), 0, body, 300 * KIB)  # rolled early: zeros left
    write_file(tmp_path / journal_name(1), 1, record(5), 500 * KIB)
    (tmp_path / "0000000000000002.pre").write_bytes(  # the next file, being prepared
        encode_file_header(JOURNAL_MAGIC, 2) + bytes(200 * KIB)
    )
    caplog.set_level(logging.INFO)
    journal = Journal(tmp_path, 1 << 20)
    try:
        assert len(journal.open_files()) == 3
        assert [r.entry_id for r in journal.replay(None)] == list(range(6))
        assert journal.torn_tails == 0
        assert journal_warnings(caplog) == []
        ends = {f.seq: f.end for f in journal.files.values()}
        assert ends == {
            0: FILE_HEADER_SIZE + len(body),
            1: FILE_HEADER_SIZE + len(record(5)),
            2: 16,
        }
        assert journal.disk_usage() == sum(ends.values())  # the records, not the zeros
        assert (tmp_path / journal_name(1)).stat().st_size > ends[1]  # not cut
        journal.start_new_file()
        assert journal.position() == (3, FILE_HEADER_SIZE)
    finally:
        journal.close()
    # a clean close leaves each file at its logical end
    for seq in (0, 1):
        assert (tmp_path / journal_name(seq)).stat().st_size == ends[seq]
    assert replay_all(tmp_path) == (list(range(6)), 0)


@pytest.mark.parametrize("later", ["none", "prepared"])
def test_a_torn_record_followed_by_zeros_is_a_torn_tail(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, later: str
) -> None:
    intact = record(0) + record(1)
    torn = record(2)[: len(record(2)) // 2]
    write_file(tmp_path / journal_name(0), 0, intact + torn, 64 * KIB)
    if later == "prepared":  # the next file was prepared: all zeros, no record
        write_file(tmp_path / "0000000000000001.pre", 1, b"", 64 * KIB)
    caplog.set_level(logging.INFO)
    journal = Journal(tmp_path, 1 << 20)
    try:
        journal.open_files()
        assert [r.entry_id for r in journal.replay(None)] == [0, 1]
        assert journal.torn_tails == 1
        (message,) = journal_warnings(caplog)
        assert "torn tail truncated" in message  # the tail: cut, not "damaged"
    finally:
        journal.close()
    assert (tmp_path / journal_name(0)).stat().st_size == FILE_HEADER_SIZE + len(intact)
    assert replay_all(tmp_path) == ([0, 1], 0)


def test_a_torn_record_before_a_file_with_records_is_damage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_file(tmp_path / journal_name(0), 0, record(0) + record(1)[:100], 8 * KIB)
    write_file(tmp_path / journal_name(1), 1, record(2), 8 * KIB)
    caplog.set_level(logging.INFO)
    ids, torn = replay_all(tmp_path)
    assert (ids, torn) == ([0, 2], 1)
    assert any("records after it are lost" in m for m in journal_warnings(caplog))


def test_a_prepared_file_left_behind_never_hides_records(tmp_path: Path) -> None:
    # a failed preparation whose file could not be removed: the next file created has
    # another seq, but a journal written before that rule could share it
    write_file(tmp_path / journal_name(0), 0, record(0), 0)
    write_file(tmp_path / "0000000000000001.pre", 1, b"", 4 * KIB)
    write_file(tmp_path / journal_name(1), 1, record(1), 0)
    assert replay_all(tmp_path) == ([0, 1], 0)


# ---------------------------------------------------------------- writes


def test_writes_go_to_the_prepared_file_and_a_close_leaves_logical_ends(tmp_path: Path) -> None:
    journal = Journal(tmp_path, 1 << 20, 256 * KIB)
    try:
        journal.open_files()
        journal.start_new_file()  # the first file: its header alone
        first = record(0)
        journal.write([first], len(first))  # starts the preparation of the next
        assert journal.start_new_file().seq == 1  # waits for it: the prepared file
        jf = journal.current
        assert jf is not None and jf.allocated == 256 * KIB
        assert jf.path.name == journal_name(1)  # renamed from its ".pre" name
        assert os.fstat(jf.fd).st_size == 256 * KIB
        eid = 1
        while jf.end + len(record(eid)) <= jf.allocated:
            rec = record(eid)
            assert journal.write([rec], len(rec)) is jf
            eid += 1
        assert os.fstat(jf.fd).st_size == 256 * KIB  # nothing appended: zeros overwritten
        prep = journal._prep  # the next file's preparation, started by the first write
        assert prep is not None and prep.done.wait(30)
        rec = record(eid)
        written = journal.write([rec], len(rec))  # does not fit: goes to the next file
        eid += 1
        assert written is journal.current and written.seq == 2
        assert written.end <= written.allocated and jf.end < jf.allocated
    finally:
        journal.close()
    assert not list(tmp_path.glob("*.pre"))  # the preparation in progress: stopped, removed
    assert all(ends_at_its_last_record(p) for p in tmp_path.glob("*.txn"))
    assert replay_all(tmp_path) == (list(range(eid)), 0)


def test_a_journal_written_fast_stops_zero_filling_and_starts_again_when_slow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Zeros double the journal's disk writes: past PRE_ALLOC_MAX_RATE the next file is
    not prepared (appended to, up to the maximum size), below it prepared again."""
    journal = Journal(tmp_path, 512 * KIB, 64 * KIB)
    eid = 0

    def fill_current() -> int:
        nonlocal eid
        jf = journal.current
        assert jf is not None
        while journal.current is jf:
            rec = record(eid)
            journal.write([rec], len(rec))
            eid += 1
            prep = journal._prep
            if prep is not None:
                assert prep.done.wait(30)  # the disk keeps up with the test
        return jf.seq

    try:
        journal.open_files()
        journal.start_new_file()
        monkeypatch.setattr(journal_file_mod, "PRE_ALLOC_MAX_RATE", 1 << 50)  # "slow"
        fill_current()  # the first file, left as soon as its successor is ready
        seq = fill_current()  # a prepared file: 64 KiB
        assert os.fstat(journal.files[seq].fd).st_size == 64 * KIB
        # "fast": the files already prepared are used, then the journal appends
        monkeypatch.setattr(journal_file_mod, "PRE_ALLOC_MAX_RATE", 1)
        for _ in range(4):
            seq = fill_current()
            if journal.files[seq].allocated == 0:
                break
        assert journal.files[seq].allocated == 0
        assert os.fstat(journal.files[seq].fd).st_size >= 512 * KIB  # up to the maximum
        # "slow" again: a file after the next is prepared once more
        monkeypatch.setattr(journal_file_mod, "PRE_ALLOC_MAX_RATE", 1 << 50)
        for _ in range(4):
            seq = fill_current()
            if journal.files[seq].allocated:
                break
        assert journal.files[seq].allocated == 64 * KIB
    finally:
        journal.close()
    assert replay_all(tmp_path) == (list(range(eid)), 0)


async def test_a_store_stopped_cleanly_leaves_no_zeros(tmp_path: Path) -> None:
    # files at their logical end and no prepared file: what the directory holds without
    # preallocation (tools that read a stopped journal see records to its end)
    for start in (0, 60):
        async with open_store(tmp_path, journal_max_size_mb=0.05, checkpoint_on_close=False) as s:
            await fill(s, 1, 60, start)
            await fill(s, 2, 60, start)
    assert not list((tmp_path / "journal").glob("*.pre"))
    assert all(ends_at_its_last_record(p) for p in (tmp_path / "journal").glob("*.txn"))
    async with open_store(tmp_path) as store:
        check_all(store, 1, 120)
        check_all(store, 2, 120)
        assert store.statistics().torn_tails == 0


def test_a_failed_preparation_falls_back_to_appending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_open = os.open

    def no_pre(path: object, *args: int) -> int:
        if str(path).endswith(".pre"):
            raise OSError(28, "No space left on device")
        return real_open(path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(journal_file_mod.os, "open", no_pre)
    journal = Journal(tmp_path, 64 * KIB, 64 * KIB)
    try:
        journal.open_files()
        journal.start_new_file()
        for eid in range(40):
            rec = record(eid)
            journal.write([rec], len(rec))
    finally:
        journal.close()
    monkeypatch.undo()
    assert any("not preallocated" in m for m in journal_warnings(caplog))
    assert len(list(tmp_path.glob("*.txn"))) > 2  # it rolled all the same
    assert replay_all(tmp_path) == (list(range(40)), 0)


# ---------------------------------------------------------------- kill -9

CHILD = """
import os, random, signal, sys, threading
from pathlib import Path
import pigeon.bookie._journal_file as jfm
from pigeon.bookie._journal_file import Journal
from pigeon.bookie._journal_format import encode_entry_header
from pigeon.bookie._storage_commit import fsync_many

directory, mode, kill_at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])

def record(entry_id):
    rng = random.Random(entry_id)
    data = rng.randbytes(rng.randrange(0, 12 * 1024))
    return encode_entry_header(1, entry_id, entry_id - 1, data) + data

if mode == "preparation":
    # die from the preparing thread, after its kill_at-th fdatasync: in the middle of a
    # preparation, while the writer goes on
    class Os:
        calls = 0
        def __getattr__(self, name):
            return getattr(os, name)
        def fdatasync(self, fd):
            os.fdatasync(fd)
            if threading.current_thread().name.startswith("pigeon-journal-prealloc"):
                Os.calls += 1
                if Os.calls == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
    jfm.os = Os()

journal = Journal(directory, 4 << 20, 3 << 20)
journal.open_files()
eid = sum(1 for _ in journal.replay(None))
journal.start_new_file()
journal.sync_dir()
journal.dir_dirty = False
acked = 0
while True:
    rec = record(eid)
    jf = journal.current
    if mode == "write" and acked >= kill_at and jf.end + len(rec) < jf.allocated:
        os.pwrite(jf.fd, rec[: len(rec) // 2], jf.end)  # half of it, then the crash
        os.kill(os.getpid(), signal.SIGKILL)
    jf = journal.write([rec], len(rec))
    sync_dir, journal.dir_dirty = journal.dir_dirty, False
    err = fsync_many([jf.fd], journal.dir_fd if sync_dir else None)
    assert err is None, err
    sys.stdout.write(f"{eid}\\n")
    sys.stdout.flush()
    eid += 1
    acked += 1
"""


def kill_child(directory: Path, mode: str, kill_at: int) -> int:
    """Run the writer until it kills itself (mode "preparation", "write") or until
    the parent kills it ("random": after ``kill_at`` acks); the last id acknowledged."""
    src = Path(journal_file_mod.__file__).resolve().parents[2]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory), mode, str(kill_at)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    last = -1
    acks = 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.endswith(b"\n"):
                last = int(line)
                acks += 1
                if mode == "random" and acks == kill_at:
                    proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
        assert proc.stderr is not None
        err = proc.stderr.read().decode()
        proc.stderr.close()
        assert proc.stdout is not None
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    return last


@pytest.mark.slow
@pytest.mark.integration
def test_kill_9_mid_preparation_and_mid_write(tmp_path: Path) -> None:
    rng = random.Random(17)
    acked = -1
    # in the middle of the second preparation (header + one MiB of zeros fdatasynced)
    acked = max(acked, kill_child(tmp_path, "preparation", 4 + 2))
    (pre,) = tmp_path.glob("*.pre")
    assert pre.stat().st_size == 1 << 20
    ids, torn = replay_all(tmp_path)
    assert ids == list(range(len(ids))) and len(ids) > acked and torn <= 1
    # half a record written in a prepared file, zeros after it
    acked = max(acked, kill_child(tmp_path, "write", 150))
    ids, torn = replay_all(tmp_path)
    assert (ids, torn) == (list(range(acked + 1)), 1)
    for _ in range(2):  # at any moment
        acked = max(acked, kill_child(tmp_path, "random", rng.randrange(1, 400)))
        ids, torn = replay_all(tmp_path)
        assert ids == list(range(len(ids))) and len(ids) > acked and torn <= 1
