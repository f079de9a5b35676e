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


async def _read_all(
    policy: Any,
    segment_id: int,
    ensemble: list[str],
    last: int,
    *,
    first: int = 0,
    write_quorum: int | None = None,
) -> list[bytes]:
    """Entries ``first..last`` read through the policy, checked to come in order."""
    out: list[bytes] = []
    entry = first
    while entry <= last:
        got = await policy.read(segment_id, ensemble, entry, last, write_quorum=write_quorum)
        assert got, f"no entries from {entry}"
        for eid, data in got:
            assert eid == entry, f"expected entry {entry}, got {eid}"
            out.append(bytes(data))
            entry += 1
    return out


async def _read_all_from(
    policy: Any, segment_id: int, bookie: str, first: int, last: int
) -> list[bytes]:
    """Entries ``first..last`` as ``bookie`` alone holds them."""
    return await _read_all(policy, segment_id, [bookie], last, first=first, write_quorum=1)


class _Spare:
    """A ``replace_bookie`` that puts the spare bookie in the failed one's place and
    records each fragment as ``(first entry, ensemble)``; with ``hold`` it answers only
    once :attr:`go` is set."""

    def __init__(self, spare: str, ensemble: list[str], *, hold: bool = False) -> None:
        self.spare = spare
        self.fragments: list[tuple[int, list[str]]] = [(0, list(ensemble))]
        self.changed = trio.Event()
        self.go = trio.Event()
        if not hold:
            self.go.set()

    async def __call__(self, index: int, first_entry: int) -> str:
        new = list(self.fragments[-1][1])
        new[index] = self.spare
        self.fragments.append((first_entry, new))
        self.changed.set()
        if not self.go.is_set():
            await self.go.wait()
        return self.spare


class _World:
    """One test's bookies, client, policy, the ensemble of its segment and a nursery for
    the writers' background work."""

    def __init__(
        self, bookies: BookieSet, client: BookieClient, policy: Any, nursery: trio.Nursery
    ) -> None:
        self.bookies = bookies
        self.client = client
        self.policy = policy
        self.nursery = nursery
        self.segment = next(_segment_ids)
        #: chosen among the first E bookies; the others are spares
        self.ensemble: list[str] = policy.choose_ensemble(bookies.addresses[: policy.ensemble_size])

    def holders(self, entry: int, write_quorum: int) -> list[str]:
        """The bookies of the ensemble that hold ``entry`` when it was written with
        ``write_quorum``."""
        return [self.ensemble[(entry + k) % len(self.ensemble)] for k in range(write_quorum)]

    def spare(self, *, hold: bool = False) -> _Spare:
        """A ``replace_bookie`` with the first bookie outside the ensemble."""
        spare = next(a for a in self.bookies.addresses if a not in self.ensemble)
        return _Spare(spare, self.ensemble, hold=hold)

    async def writer(self, replace: Any = None) -> Any:
        """A writer of the segment; with ``replace`` (a ``replace_bookie``) it replaces a
        failed bookie, its background work running in the world's nursery."""
        if replace is None:
            return await self.policy.create_writer(self.segment, self.ensemble)
        return await self.policy.create_writer(
            self.segment, self.ensemble, replace_bookie=replace, nursery=self.nursery
        )

    async def written(self, payloads: list[bytes]) -> Any:
        """A closed writer that stored ``payloads`` as entries 0...."""
        writer = await self.writer()
        await _write(writer, payloads)
        writer.close()
        return writer

    async def read_all(self, last: int) -> list[bytes]:
        return await _read_all(self.policy, self.segment, self.ensemble, last)

    async def wait_held(self, bookie: str, first: int, expected: list[bytes]) -> None:
        """Wait until ``bookie`` alone holds ``expected`` as entries ``first...``."""
        got: list[bytes] = []
        last = first + len(expected) - 1
        with trio.fail_after(10):
            while got != expected:
                try:
                    got = await _read_all_from(self.policy, self.segment, bookie, first, last)
                except PigeonError:
                    await trio.sleep(0.02)


@contextlib.asynccontextmanager
async def _world(
    tmp_path: Path, make_policy: Any, bookies: int, quorums: tuple[int, int, int]
) -> AsyncIterator[_World]:
    """``bookies`` bookies and a policy with ``quorums`` = (E, Qw, Qa)."""
    e, qw, qa = quorums
    async with _cluster(tmp_path, bookies) as (bookie_set, client):
        policy = make_policy(client, ensemble_size=e, write_quorum=qw, ack_quorum=qa)
        async with trio.open_nursery() as nursery:
            yield _World(bookie_set, client, policy, nursery)
            nursery.cancel_scope.cancel()


async def _closed_and_watched(w: _World) -> tuple[list[bytes], _ReadOrder]:
    """Twenty entries stored and their writer closed; the client's reads watched from
    now on."""
    payloads = [b"entry-%d " % i * 40 for i in range(20)]
    await w.written(payloads)
    return payloads, _ReadOrder(w.client)


#: what :func:`_lose_one` writes: ten entries before the loss, ten while the bookie is
#: being replaced, ten after
_LOSE_ONE = [b"before"] * 10 + [b"after"] * 10 + [b"later"] * 10


async def _lose_one(w: _World, index: int) -> tuple[_Spare, list[list[int]]]:
    """Write :data:`_LOSE_ONE` with a writer that replaces failed bookies by the spare,
    stopping ``ensemble[index]`` after the first ten entries and waiting for its
    replacement after the next ten: the ``replace_bookie`` and the ids of each ten."""
    replace = w.spare()
    writer = await w.writer(replace)
    ids = [await _write(writer, _LOSE_ONE[:10])]
    await w.bookies.stop(w.ensemble[index])
    # the ack quorum (2 of 3) keeps writes going while the change happens
    ids.append(await _write(writer, _LOSE_ONE[10:20]))
    with trio.fail_after(10):
        await replace.changed.wait()
    ids.append(await _write(writer, _LOSE_ONE[20:]))
    return replace, ids


def _flip(segment: int, entry: int) -> Any:
    """Damage done to a stopped bookie: one payload byte of ``entry`` flipped."""
    return lambda d: flip_payload_byte(segment_file(d, segment), entry, segment)


class ReplicationPolicyContract:
    """What every replication policy guarantees (see the module docstring)."""

    @pytest.fixture
    def make_policy(self) -> Any:  # pragma: no cover - provided by the subclass
        raise NotImplementedError

    async def test_the_policy_and_its_writers_follow_the_protocols(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        """The broker's ledger finds what it uses: :class:`pigeon.core.ReplicationPolicy`
        and :class:`pigeon.core.SegmentWriter` (mypy checks the signatures of the built-in
        quorum policy; this checks any policy has every member)."""
        async with _world(tmp_path, make_policy, 2, (2, 2, 2)) as w:
            assert isinstance(w.policy, ReplicationPolicy)
            writer = await w.writer()
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
        async with _world(tmp_path, make_policy, 3, (3, 2, 2)) as w:
            payloads, order = await _closed_and_watched(w)
            segment, entry = w.segment, 7
            damaged = await order.first_asked(w.policy, segment, w.ensemble, entry)
            await w.bookies.restart(damaged, _flip(segment, entry))
            with pytest.raises(CorruptEntry):  # the bookie refuses its damaged copy
                await w.client.read_entries(damaged, segment, entry, entry)
            got = await w.policy.read(segment, w.ensemble, entry, entry, repair=True)
            assert [(e, bytes(d)) for e, d in got] == [(entry, payloads[entry])]
            assert order.asked[0] == damaged  # it was asked first, and passed over
            # the damaged copy was rewritten from the good one
            got = await w.client.read_entries(damaged, segment, entry, entry)
            assert [(e, bytes(d)) for e, d in got] == [(entry, payloads[entry])]
            assert await w.read_all(19) == payloads

    async def test_a_truncated_copy_is_refilled_from_another_replica(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        async with _world(tmp_path, make_policy, 3, (3, 3, 2)) as w:
            payloads, order = await _closed_and_watched(w)
            damaged = await order.first_asked(w.policy, w.segment, w.ensemble, 12)

            def truncate(data_dir: Path) -> None:
                path = segment_file(data_dir, w.segment)
                size = path.stat().st_size
                with path.open("r+b") as f:  # entries 12..19 and part of 11
                    f.truncate(size - 8 * (40 + len(payloads[15])) - 10)

            await w.bookies.restart(damaged, truncate)
            assert (await w.client.segment_info(damaged, w.segment))["last_entry_id"] == 10
            got = await w.policy.read(w.segment, w.ensemble, 12, 19, repair=True)
            assert [bytes(d) for _e, d in got] == payloads[12:]
            assert order.asked[0] == damaged
            # 11 (before the read) and 12..19 (read) were appended to the damaged copy
            assert (await w.client.segment_info(damaged, w.segment))["last_entry_id"] == 19
            got = await w.client.read_entries(damaged, w.segment, 0, 19)
            assert [bytes(d) for _e, d in got] == payloads

    async def test_an_entry_damaged_on_every_replica_is_a_clear_error(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        async with _world(tmp_path, make_policy, 2, (2, 2, 2)) as w:
            await w.written([b"x" * 100] * 5)
            for address in list(w.ensemble):
                await w.bookies.restart(address, _flip(w.segment, 3))
            with pytest.raises(CorruptEntry) as info:
                await w.policy.read(w.segment, w.ensemble, 3, 4, repair=True)
            assert all(address in str(info.value) for address in w.ensemble)
            assert [e for e, _d in await w.policy.read(w.segment, w.ensemble, 4, 4)] == [4]

    async def test_entries_are_acknowledged_in_order_and_read_back(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        async with _world(tmp_path, make_policy, 3, (3, 2, 2)) as w:
            payloads = [f"entry-{i}".encode() * (i + 1) for i in range(50)]
            assert await _write(await w.writer(), payloads) == list(range(50))
            assert await w.read_all(49) == payloads

    async def test_a_single_bookie_ensemble_works(self, make_policy: Any, tmp_path: Path) -> None:
        async with _world(tmp_path, make_policy, 1, (1, 1, 1)) as w:
            assert await _write(await w.writer(), [b"a", b"b", b"c"]) == [0, 1, 2]
            assert await w.read_all(2) == [b"a", b"b", b"c"]
            assert await w.policy.recover(w.segment, w.ensemble) == 2

    async def test_recovery_fences_the_old_writer_and_finds_the_last_entry(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        async with _world(tmp_path, make_policy, 3, (3, 3, 2)) as w:
            writer = await w.writer()
            await _write(writer, [b"a", b"b", b"c"])
            assert await w.policy.recover(w.segment, w.ensemble) == 2
            with pytest.raises(PigeonError):
                await _write(writer, [b"late"])

    async def test_recovery_does_not_wait_for_a_bookie_that_does_not_answer(
        self, make_policy: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # unanswered fences are given up only after this long: recovery must not wait
        monkeypatch.setattr("pigeon.core._replication.RECOVERY_OP_TIMEOUT_S", 600.0)
        async with _world(tmp_path, make_policy, 3, (3, 3, 2)) as w:
            await _write(await w.writer(), [b"a", b"b", b"c"])
            for paused in w.ensemble:  # whichever bookie it is (a leader too)
                w.bookies.pause(paused)
                with trio.fail_after(60):
                    assert await w.policy.recover(w.segment, w.ensemble) == 2
                w.bookies.resume(paused)

    async def test_a_failed_bookie_is_replaced_without_failing_writes(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        async with _world(tmp_path, make_policy, 4, (3, 3, 2)) as w:
            replace, _ids = await _lose_one(w, 1)
            assert len(replace.fragments) == 2 and replace.spare in replace.fragments[-1][1]
            first_after = replace.fragments[-1][0]
            assert first_after <= 20
            # the new bookie alone ends up holding every entry of the new fragment
            # (those acknowledged while it was being connected are copied to it)
            await w.wait_held(replace.spare, first_after, _LOSE_ONE[first_after:])

    async def test_ack_quorum_holds_with_one_bookie_down(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        async def no_spare(index: int, first_entry: int) -> str:
            raise PigeonError("no spare bookie")

        async with _world(tmp_path, make_policy, 3, (3, 3, 2)) as w:
            writer = await w.writer(no_spare)
            await w.bookies.stop(w.ensemble[2])
            assert await _write(writer, [b"x"] * 5) == list(range(5))

    async def test_writes_go_on_when_the_first_bookie_of_the_ensemble_dies(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        # with leader-follower the first bookie leads: a new leader is elected
        async with _world(tmp_path, make_policy, 4, (3, 3, 2)) as w:
            replace, ids = await _lose_one(w, 0)
            assert ids == [list(range(10)), list(range(10, 20)), list(range(20, 30))]
            first_after, final = replace.fragments[-1]
            assert w.ensemble[0] not in final and replace.spare in final
            # every bookie of the new fragment ends up holding all of its entries
            for bookie in final:
                await w.wait_held(bookie, first_after, _LOSE_ONE[first_after:])
            # and everything reads back through the policy, fragment by fragment
            assert await _read_all(w.policy, w.segment, final, 29) == _LOSE_ONE

    async def test_recovery_copies_the_tail_everywhere_and_ends_at_a_gap(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        async with _world(tmp_path, make_policy, 3, (3, 3, 2)) as w:
            # a writer died mid-replication: entries 0-3 on every bookie (LAC 2), entry 4
            # reached one bookie (it may have been acknowledged: it is recovered), entry 5
            # none (so 6, on one bookie, cannot have been acknowledged: 5 never was)
            stored = [(entry, bookie) for entry in range(4) for bookie in w.ensemble]
            for entry, bookie in stored:
                await w.client.add_entry(bookie, w.segment, entry, entry - 1, b"e%d" % entry)
            await w.client.add_entry(w.ensemble[0], w.segment, 4, 2, b"e4")
            await w.client.add_entry(w.ensemble[0], w.segment, 6, 2, b"e6")
            assert await w.policy.recover(w.segment, w.ensemble) == 4
            for bookie in w.ensemble:
                got = await _read_all_from(w.policy, w.segment, bookie, 0, 4)
                assert got == [b"e0", b"e1", b"e2", b"e3", b"e4"]

    async def test_a_late_replacement_gets_the_entries_acknowledged_meanwhile(
        self, make_policy: Any, tmp_path: Path
    ) -> None:
        async with _world(tmp_path, make_policy, 4, (3, 3, 2)) as w:
            replace = w.spare(hold=True)  # the spare is found only after more writes
            writer = await w.writer(replace)
            await _write(writer, [b"before"] * 5)
            await w.bookies.stop(w.ensemble[2])
            assert await _write(writer, [b"meanwhile"]) == [5]  # the loss is noticed
            with trio.fail_after(10):
                await replace.changed.wait()
            # acknowledged by the two others while no replacement is known yet
            assert await _write(writer, [b"meanwhile"] * 9) == list(range(6, 15))
            replace.go.set()
            first = replace.fragments[-1][0]
            expected = ([b"before"] * 5 + [b"meanwhile"] * 10)[first:]
            assert expected, f"the change started late: at entry {first}"
            await w.wait_held(replace.spare, first, expected)
