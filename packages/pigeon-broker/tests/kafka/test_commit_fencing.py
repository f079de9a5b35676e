"""A Kafka commit never moves a stored cursor back behind a later commit.

The group coordinator stores a commit of a partition it does not serve by writing the
partition's cursor node itself.  A coordinator paused past its metadata session (the
nemesis's ``pause-broker``) still believes it coordinates; meanwhile the group finds the
next coordinator and commits later offsets there.  When the paused broker resumes, the
commit it was storing must not land on top of them: a consumer restarting then would be
given back messages it committed.  The write is therefore made only while the
coordinator's metadata session (the one it checked coordination under) is alive.
"""

from __future__ import annotations

import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from pigeon.broker._cursor import CursorState
from pigeon.broker._kafka_offsets import commit_offset, committed_offset
from pigeon.client.trio import Client
from pigeon.core import TopicName
from pigeon.core.errors import NotOwner
from pigeon.core.paths import BROKER_SESSIONS_PATH, cursor_path
from pigeon.core.testing import InProcessStandalone, in_process_standalone

#: a partition no client opened: this broker does not serve it, so commits write the node
PARTITION = TopicName.parse("persistent://public/default/fenced-commits-partition-0")
GROUP = "g"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessStandalone]:
    async with in_process_standalone(tmp_path / "pigeon") as cluster:
        yield cluster


async def stored_offset(cluster: InProcessStandalone) -> int | None:
    stat = await cluster.service.store.get(cursor_path(PARTITION, GROUP))
    return None if stat is None else CursorState.from_json(stat.value).mark_delete


class PausedBeforeItsRead:
    """The broker's metadata store as seen by a coordinator that stops (SIGSTOP) before it
    reads the cursor node, until ``resume`` is set."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.paused = trio.Event()
        self.resume = trio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def get(self, path: str) -> Any:
        if not self.resume.is_set():
            self.paused.set()
            await self.resume.wait()
        return await self.store.get(path)


async def lose_the_session(cluster: InProcessStandalone) -> None:
    """Expire the broker's metadata session (its keepalives stopped) and wait until it has
    registered again under a new session, as broker-0 did in the nemesis run."""
    ownership = cluster.service.ownership
    old = ownership.token
    await cluster.service.store.expire_session()
    with trio.fail_after(30):
        # there is no event for "registered again": polled, bounded (virtual time)
        while ownership.token == old or not await cluster.service.store.exists(  # noqa: ASYNC110
            f"{BROKER_SESSIONS_PATH}/{ownership.token}"
        ):
            await trio.sleep(0.1)


async def test_a_coordinator_paused_past_its_session_does_not_store_its_commit(
    cluster: InProcessStandalone, autojump_clock: Any
) -> None:
    door = types.SimpleNamespace(core=cluster.service)
    await commit_offset(door, PARTITION, GROUP, 2)
    assert await stored_offset(cluster) == 2

    paused = PausedBeforeItsRead(cluster.service.store)
    core = types.SimpleNamespace(
        store=paused, topics=cluster.service.topics, ownership=cluster.service.ownership
    )
    outcome: list[object] = []

    async def stale_commit() -> None:
        try:
            await commit_offset(types.SimpleNamespace(core=core), PARTITION, GROUP, 3)
        except NotOwner as exc:
            outcome.append(exc)
        else:
            outcome.append("stored")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stale_commit)
        await paused.paused.wait()
        await lose_the_session(cluster)
        await commit_offset(door, PARTITION, GROUP, 5)  # the group's next commit, stored
        paused.resume.set()

    assert await stored_offset(cluster) == 5, "an older commit overwrote a later one"
    assert len(outcome) == 1 and isinstance(outcome[0], NotOwner), outcome
    assert await committed_offset(door, PARTITION, GROUP) == 5


async def test_a_commit_written_directly_keeps_the_cursor_type(
    cluster: InProcessStandalone, autojump_clock: Any
) -> None:
    """The node keeps the subscription type a native consumer gave it."""
    path = cursor_path(PARTITION, GROUP)
    await cluster.service.store.create(path, CursorState(1, sub_type="failover").to_json())
    await commit_offset(types.SimpleNamespace(core=cluster.service), PARTITION, GROUP, 4)
    stat = await cluster.service.store.get(path)
    assert stat is not None
    cursor = CursorState.from_json(stat.value)
    assert (cursor.mark_delete, cursor.sub_type) == (4, "failover")


async def test_offset_fetch_answers_a_commit_stored_by_another_coordinator(
    cluster: InProcessStandalone, autojump_clock: Any
) -> None:
    """The partition is served here (its subscription loaded) while another broker
    coordinated the group for a while and stored a later commit in the node: the committed
    offset answered is that later one, not the subscription's older copy."""
    door = types.SimpleNamespace(core=cluster.service)
    name = TopicName.parse("persistent://public/default/served-commits-partition-0")
    async with Client(cluster.url) as client:
        producer = await client.create_producer(name.full)
        for i in range(8):
            await producer.send(f"m{i}".encode())
        await commit_offset(door, name, GROUP, 2)  # served here: through the subscription
        assert GROUP in cluster.service.topics[name.full].subscriptions
        path = cursor_path(name, GROUP)
        stat = await cluster.service.store.get(path)
        assert stat is not None
        # the next coordinator (which does not serve the partition) stores offset 6
        await cluster.service.store.set(path, CursorState(6).to_json(), version=stat.version)
        assert await committed_offset(door, name, GROUP) == 6
        await producer.close()
