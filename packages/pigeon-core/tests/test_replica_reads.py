"""Reads of a segment's replicas (:mod:`pigeon.core._replica_reads`) through the quorum
policy: striped ranges in one call per bookie, a lost tail refilled, a silent bookie
passed over."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from pigeon.core._replication import QuorumPolicy
from pigeon.core.testing._replication_suite import _ReadOrder, _World, _world, segment_file


@contextlib.asynccontextmanager
async def _striped_segment(tmp_path: Any, n: int) -> AsyncIterator[tuple[_World, list[bytes]]]:
    """A closed segment of ``n`` entries written with E=3, Qw=2, Qa=2 on three bookies (no
    bookie holds every entry): the world and the entries."""
    async with _world(tmp_path, QuorumPolicy, 3, (3, 2, 2)) as w:
        payloads = [f"entry-{i}".encode() * 10 for i in range(n)]
        await w.written(payloads)
        yield w, payloads


async def test_a_striped_range_is_read_in_one_call_even_with_a_bookie_down(
    tmp_path: Any,
) -> None:
    """E=3, Qw=2: no bookie holds every entry, yet a range read returns the whole range
    at once (it read one entry per round trip before: a consumer catching up after a
    fault managed ~50 entries/s), and with one bookie gone the other two cover it."""
    async with _striped_segment(tmp_path, 300) as (w, payloads):
        order = _ReadOrder(w.client)
        got = await w.policy.read(w.segment, w.ensemble, 5, 299)
        assert [bytes(d) for _e, d in got] == payloads[5:]
        assert len(order.asked) == 3  # one range read per bookie
        got = await w.policy.read(w.segment, w.ensemble, 0, 299, max_count=100)
        assert [e for e, _d in got] == list(range(100))
        await w.bookies.stop(w.ensemble[1])
        got = await w.policy.read(w.segment, w.ensemble, 0, 299)
        assert [bytes(d) for _e, d in got] == payloads


async def test_a_striped_read_refills_a_bookie_that_lost_its_tail(tmp_path: Any) -> None:
    async with _striped_segment(tmp_path, 60) as (w, payloads):
        lossy, segment = w.ensemble[0], w.segment
        before = (await w.client.segment_info(lossy, segment))["last_entry_id"]

        def truncate(data_dir: Any) -> None:
            path = segment_file(data_dir, segment)
            with path.open("r+b") as f:
                f.truncate(path.stat().st_size // 2)

        await w.bookies.restart(lossy, truncate)
        cut = (await w.client.segment_info(lossy, segment))["last_entry_id"]
        assert cut < before
        got = await w.policy.read(segment, w.ensemble, cut + 5, 59, repair=True)
        assert [bytes(d) for _e, d in got] == payloads[cut + 5 :]
        assert (await w.client.segment_info(lossy, segment))["last_entry_id"] == before
        held = await w.client.read_entries(lossy, segment, 0, 59)
        assert [i for i, _d in held] == [i for i in range(60) if lossy in w.holders(i, 2)]


async def test_reads_pass_over_a_bookie_that_does_not_answer(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paused or cut-off bookie keeps its connection open and answers nothing: reads
    go on without it after the read timeout (a striped range from the others, a single
    entry from its next replica) and ask it last while it is slow, instead of waiting
    for it (a consumer or a de-duplication lookup stalled for the whole pause)."""
    monkeypatch.setattr("pigeon.core._replica_reads.READ_TIMEOUT_S", 0.5)
    async with _striped_segment(tmp_path, 60) as (w, payloads):
        order = _ReadOrder(w.client)
        silent = w.ensemble[0]
        w.bookies.pause(silent)
        with trio.fail_after(5):
            got = await w.policy.read(w.segment, w.ensemble, 0, 59)
        assert [bytes(d) for _e, d in got] == payloads
        assert w.client.is_slow(silent)
        # entry 0 is on ensemble[0] and ensemble[1]: the silent one is asked last
        order.asked.clear()
        with trio.fail_after(5):
            got = await w.policy.read(w.segment, w.ensemble, 0, 0)
        assert [bytes(d) for _e, d in got] == payloads[:1]
        assert order.asked == [w.ensemble[1]]
        w.bookies.resume(silent)
