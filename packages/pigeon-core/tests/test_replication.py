"""The built-in quorum policy against the ReplicationPolicy contract."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from pigeon.core import _replication
from pigeon.core._replication import QuorumPolicy
from pigeon.core.errors import ConfigError
from pigeon.core.testing import ReplicationPolicyContract
from pigeon.core.testing._replication_suite import (
    _read_all,
    _ReadOrder,
    _World,
    _world,
    _write,
    segment_file,
)


class TestQuorumPolicy(ReplicationPolicyContract):
    @pytest.fixture
    def make_policy(self) -> Any:
        return QuorumPolicy


def test_quorum_sizes_are_validated() -> None:
    with pytest.raises(ConfigError, match="ensemble_size >= write_quorum >= ack_quorum"):
        QuorumPolicy(None, ensemble_size=2, write_quorum=3, ack_quorum=1)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def _striped_segment(tmp_path: Any, n: int) -> AsyncIterator[tuple[_World, list[bytes]]]:
    """A closed segment of ``n`` entries written with E=3, Qw=2, Qa=2 on three bookies (no
    bookie holds every entry): the world and the entries."""
    async with _world(tmp_path, QuorumPolicy, 3, (3, 2, 2)) as w:
        payloads = [f"entry-{i}".encode() * 10 for i in range(n)]
        await w.written(payloads)
        yield w, payloads


def _holders(ensemble: list[str], entry: int) -> list[str]:
    """The bookies of ``ensemble`` that hold ``entry`` with Qw=2."""
    return [ensemble[(entry + k) % len(ensemble)] for k in range(2)]


async def test_a_stalled_bookie_is_replaced_and_writes_go_on(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bookie that stops answering (paused, cut off) but keeps its connection open is
    treated as failed after the add timeout: the writer changes the ensemble instead of
    waiting for it forever."""
    monkeypatch.setattr("pigeon.core._replication.ADD_ENTRY_TIMEOUT_S", 1.0)
    async with _world(tmp_path, QuorumPolicy, 4, (3, 2, 2)) as w:
        writer = await w.writer(w.spare())
        await _write(writer, [b"a", b"b", b"c"])
        stalled = w.ensemble[1]
        w.bookies.pause(stalled)
        with trio.fail_after(30):
            await _write(writer, [f"x{i}".encode() for i in range(6)])
        assert stalled not in writer.ensemble
        assert await _read_all(w.policy, w.segment, writer.ensemble, 8) == [
            b"a",
            b"b",
            b"c",
            *[f"x{i}".encode() for i in range(6)],
        ]
        w.bookies.resume(stalled)


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
        assert [i for i, _d in held] == [i for i in range(60) if lossy in _holders(w.ensemble, i)]


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


async def test_recovery_does_not_wait_per_entry_on_a_bookie_that_stops_answering(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recovery copies the entries a bookie lacks to it in windows of adds sent at once,
    and gives that bookie up at the first window it leaves unanswered.  It waited
    RECOVERY_OP_TIMEOUT_S per entry before: a bookie paused right after the fence held
    a topic's load (and every producer and consumer of it) for minutes."""
    monkeypatch.setattr(_replication, "RECOVERY_OP_TIMEOUT_S", 0.5)
    async with _world(tmp_path, QuorumPolicy, 3, (3, 2, 2)) as w:
        lacking, first, second = w.ensemble[0], w.segment, w.segment + 1

        async def store(segment: int, entries: range, tag: bytes, lacking_has: int) -> None:
            """A writer that died with ``entries`` unconfirmed (LAC -1): every bookie of
            their write sets holds them, ``lacking`` only those below ``lacking_has``."""
            for entry in entries:
                for bookie in _holders(w.ensemble, entry):
                    if bookie != lacking or entry < lacking_has:
                        await w.client.add_entry(
                            bookie, segment, entry - entries[0], -1, tag + b"%d" % entry
                        )

        # first: every bookie answers, and `lacking` gets its share of the tail back
        await store(first, range(300), b"e", 10)
        assert await w.policy.recover(first, w.ensemble) == 299
        held = await w.client.read_entries(lacking, first, 0, 299)
        assert [bytes(d) for _i, d in held] == [
            b"e%d" % i for i in range(300) if lacking in _holders(w.ensemble, i)
        ]

        await store(second, range(300, 600), b"f", 0)  # a second segment of that shape
        original = _replication._read_tail
        reads = 0

        async def read_then_pause(*args: Any) -> Any:
            nonlocal reads
            tail = await original(*args)
            reads += 1
            if reads == len(w.ensemble):  # fenced and read everywhere: `lacking` goes silent
                w.bookies.pause(lacking)
            return tail

        monkeypatch.setattr(_replication, "_read_tail", read_then_pause)
        try:
            with trio.fail_after(5):  # ~200 entries to copy: 100 s at one timeout each
                assert await w.policy.recover(second, w.ensemble) == 299
        finally:
            w.bookies.resume(lacking)
