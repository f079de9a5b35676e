"""The ReplicationPolicy contract suite.

A policy subclasses :class:`ReplicationPolicyContract` and provides a ``make_policy``
fixture: ``make_policy(bookie_client, ensemble_size=E, write_quorum=Qw, ack_quorum=Qa)``
returning a :class:`pigeon.core.ReplicationPolicy`: among others
``choose_ensemble(bookies, ensemble_size=None)``, ``create_writer(segment_id, ensemble,
write_quorum=, ack_quorum=, replace_bookie=, nursery=)``, ``read(segment_id, ensemble,
first, last, ..., repair=False)`` (a copy that is damaged or missing is passed over for an
intact one, and with ``repair`` rewritten from it) and ``recover(segment_id, ensemble)``.
The suite runs real bookies (``pigeon-bookie``) in the test's trio run over an in-memory
network, several per test, and can stop one of them.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.lowlevel

from pigeon.core._bookie_client import BookieClient
from pigeon.core._memnet import MemoryNetwork
from pigeon.core._policy import ReplicationPolicy, SegmentWriter
from pigeon.core.errors import CorruptEntry, PigeonError

__all__ = ["BookieSet", "ReplicationPolicyContract"]

_segment_ids = itertools.count(1000)


class BookieSet:
    """In-process bookies the suite can start and stop."""

    def __init__(self, root: Path, nursery: trio.Nursery) -> None:
        self.root = root
        self.nursery = nursery
        self.addresses: list[str] = []
        self._scopes: dict[str, trio.CancelScope] = {}
        self._count = itertools.count()
        self.network: MemoryNetwork | None = None
        #: each bookie's data directory
        self.data_dirs: dict[str, Path] = {}
        self._done: dict[str, trio.Event] = {}

    def pause(self, address: str) -> None:
        """Freeze a bookie as SIGSTOP would: connected, but it answers nothing."""
        assert self.network is not None
        host, port = address.rsplit(":", 1)
        self.network.pause(host, int(port))

    def resume(self, address: str) -> None:
        assert self.network is not None
        host, port = address.rsplit(":", 1)
        self.network.resume(host, int(port))

    async def start(self, *, port: int = 0, data_dir: Path | None = None) -> str:
        from pigeon.bookie import BookieConfig, BookieServer

        if data_dir is None:
            data_dir = self.root / f"b{next(self._count)}"
        server = BookieServer(BookieConfig(port=port, fsync="never", data_dir=str(data_dir)))
        scope = trio.CancelScope()
        done = trio.Event()

        async def run(task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                with scope:
                    async with trio.open_nursery() as nursery:
                        await nursery.start(server.run)
                        task_status.started(server.advertised)
                        await trio.sleep_forever()
            finally:
                done.set()

        address: str = await self.nursery.start(run)
        self.addresses.append(address)
        self._scopes[address] = scope
        self.data_dirs[address] = data_dir
        self._done[address] = done
        return address

    async def stop(self, address: str) -> None:
        self._scopes[address].cancel()
        self.addresses.remove(address)
        await trio.lowlevel.checkpoint()

    async def restart(self, address: str, damage: Any = None) -> None:
        """Stop the bookie, call ``damage(data_dir)`` while it is down, start it again
        on the same address and data."""
        await self.stop(address)
        with trio.fail_after(30):
            await self._done[address].wait()
        if damage is not None:
            damage(self.data_dirs[address])
        await self.start(port=int(address.rsplit(":", 1)[1]), data_dir=self.data_dirs[address])


# pigeon-core does not depend on pigeon-bookie: its damage helpers are imported late.


def segment_file(data_dir: Path, segment_id: int) -> Path:
    """:func:`pigeon.bookie.testing.segment_file`."""
    from pigeon.bookie.testing import segment_file

    return segment_file(data_dir, segment_id)


def flip_payload_byte(path: Path, entry_id: int, segment_id: int) -> None:
    """:func:`pigeon.bookie.testing.flip_payload_byte`."""
    from pigeon.bookie.testing import flip_payload_byte

    flip_payload_byte(path, entry_id, segment_id)


class _ReadOrder:
    """Which bookies a client's reads ask, in order."""

    def __init__(self, client: BookieClient) -> None:
        self.asked: list[str] = []
        original = client.read_entries

        async def read_entries(address: str, *args: Any, **kw: Any) -> Any:
            self.asked.append(address)
            return await original(address, *args, **kw)

        client.read_entries = read_entries  # type: ignore[method-assign]

    async def first_asked(self, policy: Any, segment: int, ensemble: list[str], entry: int) -> str:
        self.asked.clear()
        await policy.read(segment, ensemble, entry, entry)
        return self.asked[0]


@contextlib.asynccontextmanager
async def _cluster(root: Path, n: int) -> AsyncIterator[tuple[BookieSet, BookieClient]]:
    network = MemoryNetwork()
    with network.installed():
        async with trio.open_nursery() as nursery:
            bookies = BookieSet(root, nursery)
            bookies.network = network
            for _ in range(n):
                await bookies.start()
            client = BookieClient()
            await nursery.start(client.run)
            yield bookies, client
            nursery.cancel_scope.cancel()


async def _write(writer: Any, payloads: list[bytes]) -> list[int]:
    done: list[int] = []
    errors: list[BaseException] = []
    finished = trio.Event()

    def callback(entry_id: int, error: BaseException | None) -> None:
        if error is not None:
            errors.append(error)
        else:
            done.append(entry_id)
        if len(done) + len(errors) == len(payloads):
            finished.set()

    for p in payloads:
        writer.add_nowait(p, callback)
    with trio.fail_after(20):
        await finished.wait()
    if errors:
        raise errors[0]
    return done


async def _read_all(policy: Any, segment_id: int, ensemble: list[str], last: int) -> list[bytes]:
    out: list[bytes] = []
    entry = 0
    while entry <= last:
        got = await policy.read(segment_id, ensemble, entry, last)
        assert got, f"no entries from {entry}"
        for eid, data in got:
            assert eid == entry, f"expected entry {entry}, got {eid}"
            out.append(bytes(data))
            entry += 1
    return out


async def _read_all_from(
    policy: Any, segment_id: int, bookie: str, first: int, last: int
) -> list[bytes]:
    out: list[bytes] = []
    entry = first
    while entry <= last:
        got = await policy.read(segment_id, [bookie], entry, last, write_quorum=1)
        assert got, f"no entries from {entry}"
        for eid, data in got:
            assert eid == entry, f"expected entry {entry}, got {eid}"
            out.append(bytes(data))
            entry += 1
    return out


class ReplicationPolicyContract:
    """What every replication policy guarantees (see the module docstring)."""

    async def test_the_policy_and_its_writers_follow_the_protocols(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        """The broker's ledger finds what it uses: :class:`pigeon.core.ReplicationPolicy`
        and :class:`pigeon.core.SegmentWriter` (mypy checks the signatures of the built-in
        quorum policy; this checks any policy has every member)."""
        async with _cluster(tmp_path, 2) as (bookies, client):
            policy = make_policy(client, ensemble_size=2, write_quorum=2, ack_quorum=2)
            assert isinstance(policy, ReplicationPolicy)
            ensemble = policy.choose_ensemble(bookies.addresses)
            writer = await policy.create_writer(next(_segment_ids), ensemble)
            assert isinstance(writer, SegmentWriter)
            assert (writer.next_entry_id, writer.lac, writer.pending) == (0, -1, 0)
            assert await _write(writer, [b"a", b"bc"]) == [0, 1]
            await writer.wait_idle()
            assert (writer.next_entry_id, writer.lac, writer.pending) == (2, 1, 0)
            assert writer.bytes_written == 3 and writer.failed is None
            writer.close()

    async def test_a_damaged_copy_is_read_from_another_replica_and_repaired(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        async with _cluster(tmp_path, 3) as (bookies, client):
            policy = make_policy(client, ensemble_size=3, write_quorum=2, ack_quorum=2)
            ensemble = policy.choose_ensemble(bookies.addresses)
            segment = next(_segment_ids)
            writer = await policy.create_writer(segment, ensemble)
            payloads = [b"entry-%d " % i * 40 for i in range(20)]
            await _write(writer, payloads)
            writer.close()
            order = _ReadOrder(client)
            entry = 7
            damaged = await order.first_asked(policy, segment, ensemble, entry)
            await bookies.restart(
                damaged,
                lambda d: flip_payload_byte(segment_file(d, segment), entry, segment),
            )
            with pytest.raises(CorruptEntry):  # the bookie refuses its damaged copy
                await client.read_entries(damaged, segment, entry, entry)
            got = await policy.read(segment, ensemble, entry, entry, repair=True)
            assert [(e, bytes(d)) for e, d in got] == [(entry, payloads[entry])]
            assert order.asked[0] == damaged  # it was asked first, and passed over
            # the damaged copy was rewritten from the good one
            got = await client.read_entries(damaged, segment, entry, entry)
            assert [(e, bytes(d)) for e, d in got] == [(entry, payloads[entry])]
            assert await _read_all(policy, segment, ensemble, 19) == payloads

    async def test_a_truncated_copy_is_refilled_from_another_replica(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        async with _cluster(tmp_path, 3) as (bookies, client):
            policy = make_policy(client, ensemble_size=3, write_quorum=3, ack_quorum=2)
            ensemble = policy.choose_ensemble(bookies.addresses)
            segment = next(_segment_ids)
            writer = await policy.create_writer(segment, ensemble)
            payloads = [b"entry-%d " % i * 40 for i in range(20)]
            await _write(writer, payloads)
            writer.close()
            order = _ReadOrder(client)
            damaged = await order.first_asked(policy, segment, ensemble, 12)

            def truncate(data_dir: Path) -> None:
                path = segment_file(data_dir, segment)
                size = path.stat().st_size
                with path.open("r+b") as f:  # entries 12..19 and part of 11
                    f.truncate(size - 8 * (40 + len(payloads[15])) - 10)

            await bookies.restart(damaged, truncate)
            assert (await client.segment_info(damaged, segment))["last_entry_id"] == 10
            got = await policy.read(segment, ensemble, 12, 19, repair=True)
            assert [bytes(d) for _e, d in got] == payloads[12:]
            assert order.asked[0] == damaged
            # 11 (before the read) and 12..19 (read) were appended to the damaged copy
            assert (await client.segment_info(damaged, segment))["last_entry_id"] == 19
            got = await client.read_entries(damaged, segment, 0, 19)
            assert [bytes(d) for _e, d in got] == payloads

    async def test_an_entry_damaged_on_every_replica_is_a_clear_error(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        async with _cluster(tmp_path, 2) as (bookies, client):
            policy = make_policy(client, ensemble_size=2, write_quorum=2, ack_quorum=2)
            ensemble = policy.choose_ensemble(bookies.addresses)
            segment = next(_segment_ids)
            writer = await policy.create_writer(segment, ensemble)
            await _write(writer, [b"x" * 100] * 5)
            writer.close()
            for address in list(ensemble):
                await bookies.restart(
                    address, lambda d: flip_payload_byte(segment_file(d, segment), 3, segment)
                )
            with pytest.raises(CorruptEntry) as info:
                await policy.read(segment, ensemble, 3, 4, repair=True)
            assert all(address in str(info.value) for address in ensemble)
            assert [e for e, _d in await policy.read(segment, ensemble, 4, 4)] == [4]

    @pytest.fixture
    def make_policy(self) -> Any:  # pragma: no cover - provided by the subclass
        raise NotImplementedError

    async def test_entries_are_acknowledged_in_order_and_read_back(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        async with _cluster(tmp_path, 3) as (bookies, client):
            policy = make_policy(client, ensemble_size=3, write_quorum=2, ack_quorum=2)
            ensemble = policy.choose_ensemble(bookies.addresses)
            segment = next(_segment_ids)
            writer = await policy.create_writer(segment, ensemble)
            payloads = [f"entry-{i}".encode() * (i + 1) for i in range(50)]
            assert await _write(writer, payloads) == list(range(50))
            assert await _read_all(policy, segment, ensemble, 49) == payloads

    async def test_a_single_bookie_ensemble_works(self, make_policy: Any, tmp_path: Path) -> None:
        async with _cluster(tmp_path, 1) as (bookies, client):
            policy = make_policy(client, ensemble_size=1, write_quorum=1, ack_quorum=1)
            ensemble = policy.choose_ensemble(bookies.addresses)
            segment = next(_segment_ids)
            writer = await policy.create_writer(segment, ensemble)
            assert await _write(writer, [b"a", b"b", b"c"]) == [0, 1, 2]
            assert await _read_all(policy, segment, ensemble, 2) == [b"a", b"b", b"c"]
            assert await policy.recover(segment, ensemble) == 2

    async def test_recovery_fences_the_old_writer_and_finds_the_last_entry(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        async with _cluster(tmp_path, 3) as (bookies, client):
            policy = make_policy(client, ensemble_size=3, write_quorum=3, ack_quorum=2)
            ensemble = policy.choose_ensemble(bookies.addresses)
            segment = next(_segment_ids)
            writer = await policy.create_writer(segment, ensemble)
            await _write(writer, [b"a", b"b", b"c"])
            assert await policy.recover(segment, ensemble) == 2
            with pytest.raises(PigeonError):
                await _write(writer, [b"late"])

    async def test_recovery_does_not_wait_for_a_bookie_that_does_not_answer(
        self, make_policy: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # unanswered fences are given up only after this long: recovery must not wait
        monkeypatch.setattr("pigeon.core._replication.RECOVERY_OP_TIMEOUT_S", 600.0)
        async with _cluster(tmp_path, 3) as (bookies, client):
            policy = make_policy(client, ensemble_size=3, write_quorum=3, ack_quorum=2)
            ensemble = policy.choose_ensemble(bookies.addresses)
            segment = next(_segment_ids)
            writer = await policy.create_writer(segment, ensemble)
            await _write(writer, [b"a", b"b", b"c"])
            for paused in ensemble:  # whichever bookie it is (a leader too)
                bookies.pause(paused)
                with trio.fail_after(60):
                    assert await policy.recover(segment, ensemble) == 2
                bookies.resume(paused)

    async def test_a_failed_bookie_is_replaced_without_failing_writes(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        async with _cluster(tmp_path, 4) as (bookies, client):
            policy = make_policy(client, ensemble_size=3, write_quorum=3, ack_quorum=2)
            ensemble = policy.choose_ensemble(bookies.addresses[:3])
            spare = bookies.addresses[3]
            segment = next(_segment_ids)
            fragments: list[tuple[int, list[str]]] = [(0, list(ensemble))]

            changed = trio.Event()

            async def replace(index: int, first_entry: int) -> str:
                new = list(fragments[-1][1])
                new[index] = spare
                fragments.append((first_entry, new))
                changed.set()
                return spare

            async with trio.open_nursery() as nursery:
                writer = await policy.create_writer(
                    segment, ensemble, replace_bookie=replace, nursery=nursery
                )
                await _write(writer, [b"before"] * 10)
                await bookies.stop(ensemble[1])
                # the ack quorum (2 of 3) keeps writes going while the change happens
                await _write(writer, [b"after"] * 10)
                with trio.fail_after(10):
                    await changed.wait()
                await _write(writer, [b"later"] * 10)
                assert len(fragments) == 2 and spare in fragments[-1][1]
                first_after = fragments[-1][0]
                assert first_after <= 20
                # the new bookie alone ends up holding every entry of the new fragment
                # (those acknowledged while it was being connected are copied to it)
                expected = ([b"before"] * 10 + [b"after"] * 10 + [b"later"] * 10)[first_after:]
                got: list[bytes] = []
                with trio.fail_after(10):
                    while got != expected:
                        try:
                            got = await _read_all_from(policy, segment, spare, first_after, 29)
                        except PigeonError:
                            await trio.sleep(0.02)
                nursery.cancel_scope.cancel()

    async def test_ack_quorum_holds_with_one_bookie_down(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        async with _cluster(tmp_path, 3) as (bookies, client):
            policy = make_policy(client, ensemble_size=3, write_quorum=3, ack_quorum=2)
            ensemble = policy.choose_ensemble(bookies.addresses)
            segment = next(_segment_ids)

            async def no_spare(index: int, first_entry: int) -> str:
                raise PigeonError("no spare bookie")

            async with trio.open_nursery() as nursery:
                writer = await policy.create_writer(
                    segment, ensemble, replace_bookie=no_spare, nursery=nursery
                )
                await bookies.stop(ensemble[2])
                assert await _write(writer, [b"x"] * 5) == list(range(5))
                nursery.cancel_scope.cancel()

    async def test_writes_go_on_when_the_first_bookie_of_the_ensemble_dies(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        # with leader-follower the first bookie leads: a new leader is elected
        async with _cluster(tmp_path, 4) as (bookies, client):
            policy = make_policy(client, ensemble_size=3, write_quorum=3, ack_quorum=2)
            ensemble = policy.choose_ensemble(bookies.addresses[:3])
            spare = bookies.addresses[3]
            segment = next(_segment_ids)
            fragments: list[tuple[int, list[str]]] = [(0, list(ensemble))]

            changed = trio.Event()

            async def replace(index: int, first_entry: int) -> str:
                new = list(fragments[-1][1])
                new[index] = spare
                fragments.append((first_entry, new))
                changed.set()
                return spare

            async with trio.open_nursery() as nursery:
                writer = await policy.create_writer(
                    segment, ensemble, replace_bookie=replace, nursery=nursery
                )
                assert await _write(writer, [b"before"] * 10) == list(range(10))
                await bookies.stop(ensemble[0])
                assert await _write(writer, [b"after"] * 10) == list(range(10, 20))
                with trio.fail_after(10):
                    await changed.wait()
                assert await _write(writer, [b"later"] * 10) == list(range(20, 30))
                first_after, final = fragments[-1]
                assert ensemble[0] not in final and spare in final
                expected = [b"before"] * 10 + [b"after"] * 10 + [b"later"] * 10
                # every bookie of the new fragment ends up holding all of its entries
                for bookie in final:
                    got: list[bytes] = []
                    with trio.fail_after(10):
                        while got != expected[first_after:]:
                            try:
                                got = await _read_all_from(policy, segment, bookie, first_after, 29)
                            except PigeonError:
                                await trio.sleep(0.02)
                # and everything reads back through the policy, fragment by fragment
                assert await _read_all(policy, segment, final, 29) == expected
                nursery.cancel_scope.cancel()

    async def test_recovery_copies_the_tail_everywhere_and_ends_at_a_gap(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        async with _cluster(tmp_path, 3) as (bookies, client):
            policy = make_policy(client, ensemble_size=3, write_quorum=3, ack_quorum=2)
            ensemble = policy.choose_ensemble(bookies.addresses)
            first = ensemble[0]
            segment = next(_segment_ids)
            # a writer died mid-replication: entries 0-3 on every bookie (LAC 2), entry 4
            # reached one bookie (it may have been acknowledged: it is recovered), entry 5
            # none (so 6, on one bookie, cannot have been acknowledged: 5 never was)
            for entry in range(4):
                for bookie in ensemble:
                    await client.add_entry(bookie, segment, entry, entry - 1, b"e%d" % entry)
            await client.add_entry(first, segment, 4, 2, b"e4")
            await client.add_entry(first, segment, 6, 2, b"e6")
            assert await policy.recover(segment, ensemble) == 4
            for bookie in ensemble:
                got = await _read_all_from(policy, segment, bookie, 0, 4)
                assert got == [b"e0", b"e1", b"e2", b"e3", b"e4"]

    async def test_a_late_replacement_gets_the_entries_acknowledged_meanwhile(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        async with _cluster(tmp_path, 4) as (bookies, client):
            policy = make_policy(client, ensemble_size=3, write_quorum=3, ack_quorum=2)
            ensemble = policy.choose_ensemble(bookies.addresses[:3])
            spare = bookies.addresses[3]
            segment = next(_segment_ids)
            firsts: list[int] = []
            asked = trio.Event()
            go = trio.Event()

            async def replace(index: int, first_entry: int) -> str:
                firsts.append(first_entry)
                asked.set()
                await go.wait()  # the spare is found only after more writes
                return spare

            async with trio.open_nursery() as nursery:
                writer = await policy.create_writer(
                    segment, ensemble, replace_bookie=replace, nursery=nursery
                )
                await _write(writer, [b"before"] * 5)
                await bookies.stop(ensemble[2])
                assert await _write(writer, [b"meanwhile"]) == [5]  # the loss is noticed
                with trio.fail_after(10):
                    await asked.wait()
                # acknowledged by the two others while no replacement is known yet
                assert await _write(writer, [b"meanwhile"] * 9) == list(range(6, 15))
                go.set()
                expected = ([b"before"] * 5 + [b"meanwhile"] * 10)[firsts[-1] :]
                assert expected, f"the change started late: at entry {firsts[-1]}"
                got: list[bytes] = []
                with trio.fail_after(10):
                    while got != expected:
                        try:
                            got = await _read_all_from(policy, segment, spare, firsts[-1], 14)
                        except PigeonError:
                            await trio.sleep(0.02)
                nursery.cancel_scope.cancel()
