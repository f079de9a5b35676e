"""A real ``pigeon bookie`` process: kill -9 under pipelined adds, damaged files.

The bookie runs as ``pigeon bookie --metadata embedded:///<tmp>/meta --port <free>
--data-dir <tmp> --fsync always``; the test talks to it over loopback with the broker's
own :class:`~pigeon.core._bookie_client.BookieClient`.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import pytest
import trio

from pigeon.bookie.testing import pipelined_adds
from pigeon.core._bookie_client import BookieClient
from pigeon.core.errors import (
    ConnectionClosed,
    CorruptEntry,
    EntryNotFound,
    InvalidEntryId,
)
from pigeon.core.testing.servers import clean_env, free_ports, pigeon_command

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HOST = "127.0.0.1"
READY_TIMEOUT = 20.0


class BookieProcess:
    """One ``pigeon bookie`` on a fixed data dir and port, restartable."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data_dir = root / "data"
        self.port = free_ports(1)[0]
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0
        self._log: IO[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        logs = sorted(self.root.glob("bookie-*.log"), key=lambda p: p.stat().st_mtime)
        if not logs:
            return ""
        return "\n".join(logs[-1].read_text(errors="replace").splitlines()[-lines:])

    async def start(self) -> None:
        """Start on the same data dir and port; return once it accepts connections."""
        proc = self._launch()
        with trio.move_on_after(READY_TIMEOUT):
            while proc.poll() is None:
                try:
                    stream = await trio.open_tcp_stream(HOST, self.port)
                except OSError:
                    await trio.sleep(0.02)
                    continue
                await stream.aclose()
                return
        code = proc.poll()
        self.kill9()
        pytest.fail(f"bookie not ready (exit code {code}); log:\n{self.log_tail()}")

    def _launch(self) -> subprocess.Popen[bytes]:
        assert self.proc is None or self.proc.poll() is not None
        self.close_log()
        self._log = open(self.root / f"bookie-{self.runs}.log", "wb")  # noqa: SIM115
        self.runs += 1
        cmd = [
            *pigeon_command(),
            "bookie",
            "--metadata",
            f"embedded:///{self.root / 'meta'}",
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            "--fsync",
            "always",
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=clean_env(),
            start_new_session=True,
        )
        return self.proc

    def kill9(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=15)
        self.close_log()

    def terminate(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            assert self.proc.wait(timeout=15) == 0, self.log_tail()
        finally:
            self.kill9()

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


@pytest.fixture
def bookie(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    proc = BookieProcess(tmp_path)
    yield proc
    proc.kill9()
    report = getattr(request.node, "_pigeon_report_call", None)
    if report is not None and report.failed:
        sys.stdout.write(f"\n----- bookie log -----\n{proc.log_tail(80)}\n")


def payload(segment_id: int, entry_id: int) -> bytes:
    rng = random.Random(segment_id * 1_000_003 + entry_id)
    size = rng.randrange(50_000, 150_000) if entry_id % 50 == 0 else rng.randrange(0, 3000)
    return rng.randbytes(size)


# ----------------------------------------------------------------------- kill -9

#: kill -9 rounds; each kills at a new random moment with adds in flight on three
#: segments and checks every round before it after the restart.  8 in CI (~15 s); set
#: PIGEON_BOOKIE_CRASH_ROUNDS=20 or more for a longer hunt
ROUNDS = int(os.environ.get("PIGEON_BOOKIE_CRASH_ROUNDS", "8"))
CONTIG, STRIPED = 1, 2  # segment 1: every id; segment 2: ids i % 3 != 2 (striping)


def next_id(segment_id: int, after: int) -> int:
    i = after + 1
    while segment_id == STRIPED and i % 3 == 2:
        i += 1
    return i


class Writer:
    """Pipelined adds to one segment, ``window`` in flight, acks recorded."""

    def __init__(
        self, client: BookieClient, address: str, segment_id: int, first: int, lock: trio.Lock
    ) -> None:
        self.client = client
        # Connection.wait_writable() takes one waiter at a time; the writers share one
        self.writable_lock = lock
        self.address = address
        self.segment_id = segment_id
        self.next = first
        self.sent: list[int] = []
        self.acked: set[int] = set()
        self._contiguous = 0  # sent[:_contiguous] are all acknowledged
        self.failed: BaseException | None = None
        self.stopped = trio.Event()  #: set once an add failed (the bookie died)
        self.first_ack = trio.Event()

    def _fail(self, error: BaseException) -> None:
        if self.failed is None:
            self.failed = error
            self.stopped.set()

    @property
    def lac(self) -> int:
        """Highest id acknowledged along with every id sent before it (-1: none)."""
        while self._contiguous < len(self.sent) and self.sent[self._contiguous] in self.acked:
            self._contiguous += 1
        return self.sent[self._contiguous - 1] if self._contiguous else -1

    async def run(self, window: int = 64) -> None:
        conn = await self.client.connection(self.address)
        slots = trio.Semaphore(window)
        while self.failed is None:
            await slots.acquire()
            eid = self.next
            self.next = next_id(self.segment_id, eid)
            lac = self.lac
            self.sent.append(eid)

            def done(result: Any, error: BaseException | None, eid: int = eid) -> None:
                slots.release()
                if error is None:
                    self.acked.add(eid)
                    self.first_ack.set()
                else:
                    self._fail(error)

            try:
                self.client.add_entry_nowait(
                    conn, self.segment_id, eid, lac, payload(self.segment_id, eid), done
                )
                async with self.writable_lock:
                    await conn.wait_writable()
            except ConnectionClosed as exc:  # the bookie was killed
                self._fail(exc)
                return


async def read_all(
    client: BookieClient, address: str, segment_id: int, first: int, last: int
) -> list[int]:
    """Every entry first..last in order, each checked against what was sent."""
    ids: list[int] = []
    while first <= last:
        try:
            got = await client.read_entries(address, segment_id, first, last, max_bytes=4 << 20)
        except EntryNotFound:
            first = next_id(segment_id, first)  # a skipped id first in the range
            continue
        for eid, data in got:
            assert bytes(data) == payload(segment_id, eid), f"wrong data for {segment_id}:{eid}"
        ids.extend(eid for eid, _ in got)
        first = got[-1][0] + 1
    return ids


async def test_kill_9_never_loses_an_acknowledged_entry(bookie: BookieProcess) -> None:
    """Rounds of: start the bookie on the same data dir, check everything acknowledged
    so far, write to three segments with many adds in flight, kill -9 at a random
    moment.  Segment 1 takes every id, segment 2 every id but i % 3 == 2 (striping),
    and each round a new segment starts at id 1_000_000 * round (a replacement bookie).
    """
    rng = random.Random(20240601)
    writers: list[Writer] = []  # every writer of every round
    deadline = time.monotonic() + 150  # a safety net: ~1.8 s a round on an idle 2-core machine
    rounds = 0
    while True:
        await bookie.start()
        with trio.fail_after(30):
            client = BookieClient(name="crash-test")
            async with trio.open_nursery() as nursery:
                await nursery.start(client.run)
                addr = bookie.address
                # --- everything acknowledged before the kills is there, intact
                first_ids: dict[int, int] = {CONTIG: 0, STRIPED: 0}
                for seg in sorted({w.segment_id for w in writers}):
                    mine = [w for w in writers if w.segment_id == seg]
                    acked = set().union(*(w.acked for w in mine))
                    sent = [i for w in mine for i in w.sent]
                    state = await client.segment_info(addr, seg)
                    last = state["last_entry_id"]
                    assert last >= max(acked, default=-1), f"segment {seg}: lost acked entries"
                    assert last <= max(sent)  # nothing that was never sent
                    # the bookie's lac is the writers', never beyond what they acknowledged
                    assert state["lac"] <= max(w.lac for w in mine)
                    start = min(sent)
                    ids = await read_all(client, addr, seg, start, last)
                    assert ids == [i for i in sorted(set(sent)) if i <= last]  # no hole
                    if seg in first_ids:
                        first_ids[seg] = next_id(seg, last)
                if rounds >= ROUNDS:
                    nursery.cancel_scope.cancel()
                    break
                assert time.monotonic() < deadline, f"only {rounds} rounds in the time budget"
                rounds += 1
                lock = trio.Lock()
                new = [Writer(client, addr, seg, first_ids[seg], lock) for seg in (CONTIG, STRIPED)]
                new.append(Writer(client, addr, 2 + rounds, 1_000_000 * rounds, lock))
                writers.extend(new)
                for w in new:
                    nursery.start_soon(w.run)
                # --- kill -9 at a random moment, adds in flight
                with trio.fail_after(15):
                    for w in new:
                        await w.first_ack.wait()
                await trio.sleep(rng.uniform(0.0, 0.35))
                bookie.kill9()
                with trio.move_on_after(5):
                    for w in new:  # the client sees the connection drop
                        await w.stopped.wait()
                nursery.cancel_scope.cancel()
            client.close()
        for w in new:
            assert w.acked, f"no add acknowledged on segment {w.segment_id}"
    bookie.kill9()


# ----------------------------------------------------------------------- damage


async def test_damaged_files_never_yield_wrong_data(bookie: BookieProcess) -> None:
    n = 300
    await bookie.start()
    client = BookieClient(name="damage-test")
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        for seg in (1, 2, 3):
            ids = [i for i in range(n) if seg != 3 or i % 3 != 2]  # 3 is striped
            with trio.fail_after(30):
                results = await pipelined_adds(client, bookie.address, seg, ids, payload)
            assert all(err is None for err in results.values()), results
        nursery.cancel_scope.cancel()
    client.close()
    bookie.terminate()

    segments = bookie.data_dir / "segments"
    # 1: truncated in the middle (a lost end: the bookie cannot tell it from a crash)
    log1 = segments / f"{1:016x}.log"
    os.truncate(log1, log1.stat().st_size * 6 // 10)
    # 2 and 3: a block in the middle overwritten with garbage (bit rot, a bad write)
    for seg in (2, 3):
        log = segments / f"{seg:016x}.log"
        data = bytearray(log.read_bytes())
        at = len(data) // 2
        data[at : at + 20_000] = random.Random(seg).randbytes(20_000)
        log.write_bytes(data)

    with trio.fail_after(60):
        result = await trio.run_process(
            [*pigeon_command(), "bookie", "inspect", str(bookie.data_dir)],
            capture_stdout=True,
            capture_stderr=True,
            env=clean_env(),
            check=False,
        )
    assert result.returncode == 1, result.stdout.decode() + result.stderr.decode()
    assert b"CORRUPT" in result.stdout

    await bookie.start()
    client = BookieClient(name="damage-check")
    outcome: dict[int, dict[str, list[int]]] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        addr = bookie.address
        for seg in (1, 2, 3):
            outcome[seg] = {"ok": [], "corrupt": [], "missing": []}
            for eid in range(n):
                try:
                    [(got_id, data)] = await client.read_entries(addr, seg, eid, eid)
                except CorruptEntry:
                    outcome[seg]["corrupt"].append(eid)
                    continue
                except EntryNotFound:
                    outcome[seg]["missing"].append(eid)
                    continue
                assert got_id == eid and bytes(data) == payload(seg, eid)
                outcome[seg]["ok"].append(eid)
            # range reads: never wrong bytes, never an id that was not written
            for first in outcome[seg]["ok"][::7]:
                got = await client.read_entries(addr, seg, first, n)
                assert all(bytes(d) == payload(seg, eid) for eid, d in got)
                assert {eid for eid, _ in got} <= set(outcome[seg]["ok"])
        # 1: a clean cut, the rest of the log is readable and writable again
        ok1 = outcome[1]["ok"]
        assert ok1 == list(range(len(ok1))) and 100 < len(ok1) < n and not outcome[1]["corrupt"]
        with pytest.raises(InvalidEntryId):
            await client.add_entry(addr, 1, len(ok1) - 1, 0, b"again")
        await client.add_entry(addr, 1, len(ok1), len(ok1) - 1, payload(1, len(ok1)))
        # 2, 3: the damaged block is reported, entries after it are still served
        for seg in (2, 3):
            assert outcome[seg]["corrupt"], seg
            assert max(outcome[seg]["ok"]) > max(outcome[seg]["corrupt"])
        assert set(outcome[3]["missing"]) >= {i for i in range(n) if i % 3 == 2} - set(
            outcome[3]["corrupt"]
        )
        assert len(outcome[2]["ok"]) + len(outcome[2]["corrupt"]) == n
        nursery.cancel_scope.cancel()
    client.close()
