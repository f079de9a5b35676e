"""The built-in quorum policy against the ReplicationPolicy contract."""

from __future__ import annotations

from typing import Any

import pytest

from pigeon.core._replication import QuorumPolicy
from pigeon.core.errors import ConfigError
from pigeon.core.testing import ReplicationPolicyContract


class TestQuorumPolicy(ReplicationPolicyContract):
    @pytest.fixture
    def make_policy(self) -> Any:
        return QuorumPolicy


def test_quorum_sizes_are_validated() -> None:
    with pytest.raises(ConfigError, match="ensemble_size >= write_quorum >= ack_quorum"):
        QuorumPolicy(None, ensemble_size=2, write_quorum=3, ack_quorum=1)  # type: ignore[arg-type]


async def _striped_segment(
    bookies: Any, client: Any, segment_id: int, n: int
) -> tuple[QuorumPolicy, list[str], list[bytes]]:
    """A closed segment of ``n`` entries written with E=3, Qw=2, Qa=2 (no bookie holds
    every entry): the policy, the ensemble and the entries."""
    from pigeon.core.testing._replication_suite import _write

    policy = QuorumPolicy(client, ensemble_size=3, write_quorum=2, ack_quorum=2)
    ensemble = policy.choose_ensemble(bookies.addresses)
    writer = await policy.create_writer(segment_id, ensemble)
    payloads = [f"entry-{i}".encode() * 10 for i in range(n)]
    await _write(writer, payloads)
    writer.close()
    return policy, ensemble, payloads


def _holders(ensemble: list[str], entry: int) -> list[str]:
    """The bookies of ``ensemble`` that hold ``entry`` with Qw=2."""
    return [ensemble[(entry + k) % len(ensemble)] for k in range(2)]


async def test_a_stalled_bookie_is_replaced_and_writes_go_on(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bookie that stops answering (paused, cut off) but keeps its connection open is
    treated as failed after the add timeout: the writer changes the ensemble instead of
    waiting for it forever."""
    import trio

    from pigeon.core.testing._replication_suite import _cluster, _read_all, _write

    monkeypatch.setattr("pigeon.core._replication.ADD_ENTRY_TIMEOUT_S", 1.0)
    async with _cluster(tmp_path, 4) as (bookies, client):
        policy = QuorumPolicy(client, ensemble_size=3, write_quorum=2, ack_quorum=2)
        ensemble = policy.choose_ensemble(bookies.addresses[:3])
        spare = bookies.addresses[3]

        async def replace(index: int, first_entry: int) -> str:
            ensemble[index] = spare
            return spare

        async with trio.open_nursery() as nursery:
            writer = await policy.create_writer(
                77, list(ensemble), replace_bookie=replace, nursery=nursery
            )
            await _write(writer, [b"a", b"b", b"c"])
            stalled = ensemble[1]
            bookies.pause(stalled)
            with trio.fail_after(30):
                await _write(writer, [f"x{i}".encode() for i in range(6)])
            assert stalled not in writer.ensemble
            assert await _read_all(policy, 77, writer.ensemble, 8) == [
                b"a",
                b"b",
                b"c",
                *[f"x{i}".encode() for i in range(6)],
            ]
            bookies.resume(stalled)
            nursery.cancel_scope.cancel()


async def test_a_striped_range_is_read_in_one_call_even_with_a_bookie_down(
    tmp_path: Any,
) -> None:
    """E=3, Qw=2: no bookie holds every entry, yet a range read returns the whole range
    at once (it read one entry per round trip before: a consumer catching up after a
    fault managed ~50 entries/s), and with one bookie gone the other two cover it."""
    from pigeon.core.testing._replication_suite import _cluster, _ReadOrder

    async with _cluster(tmp_path, 3) as (bookies, client):
        policy, ensemble, payloads = await _striped_segment(bookies, client, 31, 300)
        order = _ReadOrder(client)
        got = await policy.read(31, ensemble, 5, 299)
        assert [bytes(d) for _e, d in got] == payloads[5:]
        assert len(order.asked) == 3  # one range read per bookie
        got = await policy.read(31, ensemble, 0, 299, max_count=100)
        assert [e for e, _d in got] == list(range(100))
        await bookies.stop(ensemble[1])
        got = await policy.read(31, ensemble, 0, 299)
        assert [bytes(d) for _e, d in got] == payloads


async def test_a_striped_read_refills_a_bookie_that_lost_its_tail(tmp_path: Any) -> None:
    from pigeon.core.testing._replication_suite import _cluster, segment_file

    async with _cluster(tmp_path, 3) as (bookies, client):
        policy, ensemble, payloads = await _striped_segment(bookies, client, 32, 60)
        lossy = ensemble[0]
        before = (await client.segment_info(lossy, 32))["last_entry_id"]

        def truncate(data_dir: Any) -> None:
            path = segment_file(data_dir, 32)
            with path.open("r+b") as f:
                f.truncate(path.stat().st_size // 2)

        await bookies.restart(lossy, truncate)
        cut = (await client.segment_info(lossy, 32))["last_entry_id"]
        assert cut < before
        got = await policy.read(32, ensemble, cut + 5, 59, repair=True)
        assert [bytes(d) for _e, d in got] == payloads[cut + 5 :]
        assert (await client.segment_info(lossy, 32))["last_entry_id"] == before
        held = await client.read_entries(lossy, 32, 0, 59)
        assert [i for i, _d in held] == [i for i in range(60) if lossy in _holders(ensemble, i)]


async def test_reads_pass_over_a_bookie_that_does_not_answer(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paused or cut-off bookie keeps its connection open and answers nothing: reads
    go on without it after the read timeout (a striped range from the others, a single
    entry from its next replica) and ask it last while it is slow, instead of waiting
    for it (a consumer or a de-duplication lookup stalled for the whole pause)."""
    import trio

    from pigeon.core.testing._replication_suite import _cluster, _ReadOrder

    monkeypatch.setattr("pigeon.core._replica_reads.READ_TIMEOUT_S", 0.5)
    async with _cluster(tmp_path, 3) as (bookies, client):
        policy, ensemble, payloads = await _striped_segment(bookies, client, 33, 60)
        order = _ReadOrder(client)
        silent = ensemble[0]
        bookies.pause(silent)
        with trio.fail_after(5):
            got = await policy.read(33, ensemble, 0, 59)
        assert [bytes(d) for _e, d in got] == payloads
        assert client.is_slow(silent)
        # entry 0 is on ensemble[0] and ensemble[1]: the silent one is asked last
        order.asked.clear()
        with trio.fail_after(5):
            got = await policy.read(33, ensemble, 0, 0)
        assert [bytes(d) for _e, d in got] == payloads[:1]
        assert order.asked == [ensemble[1]]
        bookies.resume(silent)


async def test_recovery_does_not_wait_per_entry_on_a_bookie_that_stops_answering(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recovery copies the entries a bookie lacks to it in windows of adds sent at once,
    and gives that bookie up at the first window it leaves unanswered.  It waited
    RECOVERY_OP_TIMEOUT_S per entry before: a bookie paused right after the fence held
    a topic's load (and every producer and consumer of it) for minutes."""
    import trio

    import pigeon.core._replication as replication
    from pigeon.core.testing._replication_suite import _cluster

    monkeypatch.setattr(replication, "RECOVERY_OP_TIMEOUT_S", 0.5)
    async with _cluster(tmp_path, 3) as (bookies, client):
        policy = QuorumPolicy(client, ensemble_size=3, write_quorum=2, ack_quorum=2)
        ensemble = policy.choose_ensemble(bookies.addresses)
        lacking = ensemble[0]
        e = len(ensemble)
        # a writer died with 300 entries unconfirmed (LAC -1); `lacking` got only 0-9
        for entry in range(300):
            for bookie in _holders(ensemble, entry):
                if bookie != lacking or entry < 10:
                    await client.add_entry(bookie, 41, entry, -1, b"e%d" % entry)

        # first: every bookie answers, and `lacking` gets its share of the tail back
        assert await policy.recover(41, ensemble) == 299
        held = await client.read_entries(lacking, 41, 0, 299)
        assert [bytes(d) for _i, d in held] == [
            b"e%d" % i for i in range(300) if lacking in _holders(ensemble, i)
        ]

        for entry in range(300, 600):  # a second segment of the same shape
            for bookie in _holders(ensemble, entry):
                if bookie != lacking:
                    await client.add_entry(bookie, 42, entry - 300, -1, b"f%d" % entry)
        original = replication._read_tail
        reads = 0

        async def read_then_pause(*args: Any) -> Any:
            nonlocal reads
            tail = await original(*args)
            reads += 1
            if reads == e:  # fenced and read everywhere: now `lacking` goes silent
                bookies.pause(lacking)
            return tail

        monkeypatch.setattr(replication, "_read_tail", read_then_pause)
        try:
            with trio.fail_after(5):  # ~200 entries to copy: 100 s at one timeout each
                assert await policy.recover(42, ensemble) == 299
        finally:
            bookies.resume(lacking)
