"""The journal store after kill -9: every acknowledged entry is there (fsync=always),
with checkpoints, journal rolls and entry-log rolls happening while the writer dies."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import trio
from test_journal import open_store

import pigeon.bookie._journal as journal_mod

OPTIONS = dict(journal_max_size_mb=0.5, entry_log_size_limit=1 << 20, flush_interval_ms=20)

CHILD = """
import sys, random, trio
from pathlib import Path
from pigeon.bookie._journal import JournalStore
from pigeon.core.errors import SegmentNotFound

def payload(seg, eid):
    rng = random.Random(seg * 1_000_003 + eid)
    return rng.randbytes(rng.randrange(0, 100_000) if eid % 7 == 0 else rng.randrange(0, 3000))

async def main(path):
    path = Path(path)
    store = JournalStore(path / "journal", path / "ledgers", **OPTIONS_HERE)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)

        def start(seg):
            try:
                return store.last_entry_id(seg) + 1
            except SegmentNotFound:
                return 0

        async def writer(seg):
            eid = start(seg)
            while True:
                await store.add_entry(seg, eid, payload(seg, eid), lac=eid - 1)
                sys.stdout.write(f"{seg} {eid}\\n")
                sys.stdout.flush()
                eid += 1

        async def pipelined(seg):
            eid = start(seg)
            limit = trio.Semaphore(8)
            async with trio.open_nursery() as acks:
                while True:
                    await limit.acquire()
                    waiter = store.append(seg, eid, payload(seg, eid), lac=eid - 1)

                    async def ack(waiter=waiter, eid=eid):
                        await waiter.wait()
                        sys.stdout.write(f"{seg} {eid}\\n")
                        sys.stdout.flush()
                        limit.release()

                    acks.start_soon(ack)
                    eid += 1

        for seg in (1, 2, 3, 4):
            nursery.start_soon(writer, seg)
        nursery.start_soon(pipelined, 5)

trio.run(main, sys.argv[1])
""".replace("OPTIONS_HERE", repr(OPTIONS))


def child_payload(seg: int, eid: int) -> bytes:
    rng = random.Random(seg * 1_000_003 + eid)
    return rng.randbytes(rng.randrange(0, 100_000) if eid % 7 == 0 else rng.randrange(0, 3000))


def run_and_kill(path: Path, rng: random.Random) -> list[tuple[int, int]]:
    """Start a writer process, SIGKILL it at a random moment; the acks it printed."""
    src = Path(journal_mod.__file__).resolve().parents[2]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    lines: list[bytes] = []
    first_ack = threading.Event()

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            first_ack.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        if not first_ack.wait(30):
            assert proc.stderr is not None
            proc.kill()
            pytest.fail(f"writer did not start: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(rng.uniform(0.05, 0.5))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        reader.join(30)
        assert proc.stderr is not None
        proc.stderr.close()
        assert proc.stdout is not None
        proc.stdout.close()
    acks = []
    for line in lines:
        if line.endswith(b"\n"):
            seg, eid = line.split()
            acks.append((int(seg), int(eid)))
    return acks


@pytest.mark.slow
@pytest.mark.integration
def test_kill_9_never_loses_an_acknowledged_entry(tmp_path: Path) -> None:
    rng = random.Random(4321)
    acked: dict[int, int] = {}
    deadline = time.monotonic() + 60
    rounds = 0
    while rounds < 6 and time.monotonic() < deadline:
        rounds += 1
        for seg, eid in run_and_kill(tmp_path, rng):
            acked[seg] = max(acked.get(seg, -1), eid)

        async def verify() -> None:
            async with open_store(tmp_path, **OPTIONS) as store:
                for seg, top in acked.items():
                    # an ack means an fsync of the journal covered the entry
                    last = store.last_entry_id(seg)
                    assert last >= top, f"segment {seg}: acked {top}, stored {last}"
                    first = 0
                    while first <= last:  # every entry stored is intact, in order
                        got = await store.read_entries_async(seg, first, last)
                        assert got[0][0] == first
                        for eid, data in got:
                            assert data == child_payload(seg, eid)
                        first = got[-1][0] + 1
                    assert store.read_lac(seg) >= top - 1

        trio.run(verify)
    assert len(acked) == 5  # every writer got acknowledgements
    assert len(list((tmp_path / "journal").glob("*.txn"))) < 10  # old journals deleted
