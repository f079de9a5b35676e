"""Crash safety: damaged files never crash recovery nor yield wrong data; kill -9 never
loses an acknowledged entry."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_storage import open_store

import pigeon.bookie._storage as storage_mod
from pigeon.bookie._storage import SegmentStore
from pigeon.core.errors import CorruptEntry, EntryNotFound, SegmentFenced, SegmentNotFound

SEG = 42


def payload(entry_id: int, size: int) -> bytes:
    return random.Random(entry_id).randbytes(size)


def run_store(path: Path, fn: Any, **kw: Any) -> Any:
    """trio.run ``fn(store)`` with a running store on ``path``."""
    return trio.run(_with_store, path, fn, kw)


async def _with_store(path: Path, fn: Any, kw: dict[str, Any]) -> Any:
    async with open_store(path, **kw) as store:
        return await fn(store)


def readable(store: SegmentStore, expected: dict[int, bytes]) -> set[int]:
    """Check every read against what was written; return the ids that read back."""
    try:
        last = store.last_entry_id(SEG)
    except SegmentNotFound:
        return set()
    ok = set()
    for i in range(last + 1):
        try:
            got = store.read_entries(SEG, i, i)
        except CorruptEntry:
            continue
        assert got == [(i, expected[i])]
        ok.add(i)
    for first in range(last + 1):
        try:
            got = store.read_entries(SEG, first, last + 5)
        except CorruptEntry:
            assert first not in ok
            continue
        ids = [i for i, _ in got]
        assert ids == list(range(first, first + len(ids)))
        assert all(p == expected[i] for i, p in got)
        assert set(ids) <= ok
    with pytest.raises((EntryNotFound, SegmentNotFound)):
        store.read_entries(SEG, last + 1, last + 1)
    return ok


damage_op = st.one_of(
    st.tuples(st.just("truncate"), st.sampled_from(["log", "idx", "meta"]), st.floats(0, 1)),
    st.tuples(
        st.just("flip"),
        st.sampled_from(["log", "log", "log", "idx", "meta"]),
        st.floats(0, 1),
        st.integers(1, 255),
    ),
    st.tuples(
        st.just("zeros"), st.sampled_from(["log", "idx"]), st.floats(0, 1), st.integers(1, 3000)
    ),
    st.tuples(st.just("append"), st.sampled_from(["log", "idx"]), st.binary(max_size=200)),
    st.tuples(st.just("delete"), st.sampled_from(["idx", "meta"])),
)


def apply_damage(directory: Path, op: tuple[Any, ...]) -> None:
    path = directory / "segments" / f"{SEG:016x}.{op[1]}"
    if not path.exists():
        return
    data = bytearray(path.read_bytes())
    kind = op[0]
    if kind == "truncate":
        del data[int(len(data) * op[2]) :]
    elif kind == "flip" and data:
        data[min(int(len(data) * op[2]), len(data) - 1)] ^= op[3]
    elif kind == "zeros":
        at = int(len(data) * op[2])
        data[at : at + op[3]] = bytes(len(data[at : at + op[3]]))
    elif kind == "append":
        data += op[2]
    elif kind == "delete":
        path.unlink()
        return
    path.write_bytes(data)


@settings(
    max_examples=int(os.environ.get("PIGEON_STORAGE_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    sizes=st.lists(st.integers(0, 2500), min_size=1, max_size=40),
    interval=st.sampled_from([1, 300, 4096, 1 << 20]),
    dense_window=st.sampled_from([2, 1 << 16]),
    fenced=st.booleans(),
    damage=st.lists(damage_op, min_size=1, max_size=4),
)
def test_damage_never_crashes_nor_returns_wrong_data(
    sizes: list[int],
    interval: int,
    dense_window: int,
    fenced: bool,
    damage: list[tuple[Any, ...]],
) -> None:
    expected = {i: payload(i, size) for i, size in enumerate(sizes)}
    opts = {"index_interval_bytes": interval, "dense_window": dense_window, "fsync": "never"}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)

        async def write(store: SegmentStore) -> None:
            await store.add_entries(SEG, 0, list(expected.values())[: len(sizes) // 2])
            for i in range(len(sizes) // 2, len(sizes)):
                await store.add_entry(SEG, i, expected[i], lac=i - 1)
            if fenced:
                await store.fence(SEG)

        run_store(directory, write, **opts)
        for op in damage:
            apply_damage(directory, op)

        async def check_and_append(store: SegmentStore) -> set[int]:
            ok = readable(store, expected)
            ok |= set(await _async_reads(store, expected))
            if SEG in store.segments() and not store.segment_info(SEG).fenced:
                nxt = store.last_entry_id(SEG) + 1
                expected[nxt] = payload(nxt, 100)
                await store.add_entry(SEG, nxt, expected[nxt])
                ok.add(nxt)
            elif SEG not in store.segments():
                expected.clear()
                expected[0] = payload(0, 100)
                await store.add_entry(SEG, 0, expected[0])
                ok = {0}
            else:
                with pytest.raises(SegmentFenced):
                    await store.add_entry(SEG, store.last_entry_id(SEG) + 1, b"x")
            return ok

        first = run_store(directory, check_and_append, **opts)

        async def check(store: SegmentStore) -> set[int]:
            return readable(store, expected)

        second = run_store(directory, check, **opts)
        # recovery never silently drops an entry that was readable before
        assert first <= second


async def _async_reads(store: SegmentStore, expected: dict[int, bytes]) -> list[int]:
    if SEG not in store.segments():
        return []
    last = store.last_entry_id(SEG)
    if last < 0:
        return []
    try:
        got = await store.read_entries_async(SEG, 0, last)
    except CorruptEntry:
        return []
    assert all(p == expected[i] for i, p in got)
    return [i for i, _ in got]


# ----------------------------------------------------------------------- kill -9

CHILD = """
import random, sys, trio
from pigeon.bookie._storage import SegmentStore
from pigeon.core.errors import SegmentNotFound

def payload(seg, eid):
    rng = random.Random(seg * 1_000_003 + eid)
    return rng.randbytes(rng.randrange(0, 200_000) if eid % 7 == 0 else rng.randrange(0, 3000))

async def main(path):
    store = SegmentStore(path, fsync="always", index_interval_bytes=8192)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)

        async def writer(seg):
            try:
                eid = store.last_entry_id(seg) + 1
            except SegmentNotFound:
                eid = 0
            while True:
                await store.add_entry(seg, eid, payload(seg, eid), lac=eid - 1)
                sys.stdout.write(f"{seg} {eid}\\n")
                sys.stdout.flush()
                eid += 1

        async def pipelined(seg):
            # like the RPC service: append now, acknowledge when the waiter is done
            try:
                eid = store.last_entry_id(seg) + 1
            except SegmentNotFound:
                eid = 0
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

        nursery.start_soon(writer, 1)
        nursery.start_soon(writer, 2)
        nursery.start_soon(pipelined, 3)

trio.run(main, sys.argv[1])
"""


def _child_payload(seg: int, eid: int) -> bytes:
    rng = random.Random(seg * 1_000_003 + eid)
    return rng.randbytes(rng.randrange(0, 200_000) if eid % 7 == 0 else rng.randrange(0, 3000))


def _run_and_kill(path: Path, rng: random.Random) -> list[tuple[int, int]]:
    """Start a writer process, SIGKILL it at a random moment; the acks it printed."""
    src = Path(storage_mod.__file__).resolve().parents[2]
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
        time.sleep(rng.uniform(0.0, 0.3))
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
    rng = random.Random(1234)
    acked: dict[int, int] = {}
    deadline = time.monotonic() + 60
    rounds = 0
    while rounds < 8 and time.monotonic() < deadline:
        rounds += 1
        for seg, eid in _run_and_kill(tmp_path, rng):
            acked[seg] = max(acked.get(seg, -1), eid)

        async def verify(store: SegmentStore) -> None:
            for seg in (1, 2, 3):
                if seg not in acked:
                    continue
                # an ack means an fsync covered the entry, and every earlier write
                last = store.last_entry_id(seg)
                assert last >= acked[seg], f"segment {seg}: acked {acked[seg]}, stored {last}"
                # every entry stored (acked or not) is intact, and reads back in order
                first = 0
                while first <= last:
                    got = store.read_entries(seg, first, last)
                    for eid, data in got:
                        assert data == _child_payload(seg, eid)
                    assert got[0][0] == first
                    first = got[-1][0] + 1
                assert store.read_lac(seg) >= acked[seg] - 1

        run_store(tmp_path, verify)
    assert len(acked) == 3  # every writer got acknowledgements
