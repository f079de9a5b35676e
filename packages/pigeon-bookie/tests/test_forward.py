"""Leader-follower forwarding and idempotent adds, between real bookies over loopback TCP."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import trio
from test_service import payload, running

from pigeon.core._bookie_client import BookieClient
from pigeon.core.errors import InvalidEntryId, SegmentFenced
from pigeon.core.testing.servers import free_port


async def replicated_add(
    client: BookieClient,
    leader: str,
    segment_id: int,
    entry_id: int,
    data: bytes,
    followers: list[str],
    *,
    acks: int,
    sync_from: int = 0,
) -> tuple[int, list[str]]:
    conn = await client.connection(leader)
    box: list[Any] = []
    done = trio.Event()

    def callback(result: Any, error: BaseException | None) -> None:
        box.append((result, error))
        done.set()

    client.add_replicated_nowait(
        conn,
        segment_id,
        entry_id,
        entry_id - 1,
        data,
        callback,
        forward_to=followers,
        forward_acks=acks,
        sync_from=sync_from,
    )
    with trio.fail_after(10):
        await done.wait()
    result, error = box[0]
    if error is not None:
        raise error
    copies, lost = result
    return int(copies), list(lost)


def closed_port_address() -> str:
    return f"127.0.0.1:{free_port()}"


async def test_resends_and_recovery_adds_are_idempotent(tmp_path: Path) -> None:
    async with running(tmp_path) as (_server, client, addr):
        conn = await client.connection(addr)
        await client.add_entry(addr, 1, 0, -1, b"zero")
        outcomes: list[BaseException | None] = []
        done = trio.Event()

        def callback(result: Any, error: BaseException | None) -> None:
            outcomes.append(error)
            done.set()

        # the same bytes again: acknowledged, not stored twice
        client.add_entry_nowait(conn, 1, 0, -1, b"zero", callback, resend=True)
        await done.wait()
        assert outcomes == [None]
        assert [bytes(d) for _, d in await client.read_entries(addr, 1, 0, 5)] == [b"zero"]
        done = trio.Event()
        client.add_entry_nowait(conn, 1, 0, -1, b"other", callback, resend=True)
        await done.wait()
        assert isinstance(outcomes[-1], InvalidEntryId)
        await client.fence(addr, 1)
        done = trio.Event()
        client.add_entry_nowait(conn, 1, 1, 0, b"one", callback, resend=True)
        await done.wait()
        assert isinstance(outcomes[-1], SegmentFenced)  # a resend does not pass a fence
        await client.add_entry(addr, 1, 1, 0, b"one", recovery=True)  # recovery does
        await client.add_entry(addr, 1, 1, 0, b"one", recovery=True)
        assert [bytes(d) for _, d in await client.read_entries(addr, 1, 0, 5)] == [
            b"zero",
            b"one",
        ]


async def test_the_leader_forwards_counts_copies_and_reports_lost_followers(
    tmp_path: Path,
) -> None:
    async with AsyncExitStack() as stack:
        _l, client, leader = await stack.enter_async_context(running(tmp_path / "l"))
        _f, _c, follower = await stack.enter_async_context(running(tmp_path / "f"))
        dead = closed_port_address()
        for entry in range(5):
            copies, lost = await replicated_add(
                client, leader, 7, entry, payload(7, entry), [follower], acks=1
            )
            assert (copies, lost) == (2, [])
        got = await client.read_entries(follower, 7, 0, 10)
        assert [(i, bytes(d)) for i, d in got] == [(i, payload(7, i)) for i in range(5)]
        # an unreachable follower is reported; the leader's own copy still counts
        copies, lost = await replicated_add(
            client, leader, 7, 5, payload(7, 5), [follower, dead], acks=2
        )
        assert copies == 2 and lost == [dead]
        # ...and stays lost for later entries (it would otherwise get them with a gap)
        copies, lost = await replicated_add(
            client, leader, 7, 6, payload(7, 6), [follower, dead], acks=2
        )
        assert copies == 2 and lost == [dead]
        # a later fragment (the writer changed its ensemble) tries that follower afresh:
        # here the "dead" address is a bookie again, and it is brought up to date
        async with running(tmp_path / "back", port=int(dead.rsplit(":", 1)[1])):
            copies, lost = await replicated_add(
                client, leader, 7, 7, payload(7, 7), [follower, dead], acks=2, sync_from=7
            )
            assert (copies, lost) == (3, [])
            assert [i for i, _ in await client.read_entries(dead, 7, 7, 7)] == [7]


async def test_a_new_follower_is_brought_up_to_date_from_sync_from(tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        _l, client, leader = await stack.enter_async_context(running(tmp_path / "l"))
        _f, _c, newcomer = await stack.enter_async_context(running(tmp_path / "n"))
        for entry in range(10):  # written while the newcomer was not in the ensemble
            await client.add_entry(leader, 3, entry, entry - 1, payload(3, entry))
        # the new fragment starts at entry 4: the leader copies 4..9 first, then 10
        copies, lost = await replicated_add(
            client, leader, 3, 10, payload(3, 10), [newcomer], acks=1, sync_from=4
        )
        assert (copies, lost) == (2, [])
        got = await client.read_entries(newcomer, 3, 4, 20)
        assert [(i, bytes(d)) for i, d in got] == [(i, payload(3, i)) for i in range(4, 11)]
        info = await client.segment_info(newcomer, 3)
        assert info["last_entry_id"] == 10


async def test_a_fenced_follower_fails_the_add(tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        _l, client, leader = await stack.enter_async_context(running(tmp_path / "l"))
        _f, _c, follower = await stack.enter_async_context(running(tmp_path / "f"))
        await replicated_add(client, leader, 4, 0, b"a", [follower], acks=1)
        await client.fence(follower, 4)  # recovery reached the follower, not the leader
        with pytest.raises(SegmentFenced):
            await replicated_add(client, leader, 4, 1, b"b", [follower], acks=1)
