"""The leader-follower policy: the ReplicationPolicy contract on real bookies, the choice
of ensemble, and the writer's watchdog (issue #12): a stalled leader is replaced, and with
fewer bookies answering than the ack quorum needs a writer fails (retriably) within a
bound instead of waiting for the paused bookies to come back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from pigeon_leader_follower import LeaderFollowerPolicy, LeaderFollowerWriter

from pigeon.core import PluginManager
from pigeon.core.errors import ConfigError, PigeonError
from pigeon.core.testing import ReplicationPolicyContract
from pigeon.core.testing._replication_suite import _cluster, _write


class TestLeaderFollowerPolicy(ReplicationPolicyContract):
    @pytest.fixture
    def make_policy(self) -> Any:
        return LeaderFollowerPolicy


def test_the_policy_is_found_through_the_entry_point() -> None:
    assert PluginManager().replication_policies.get("leader-follower") is LeaderFollowerPolicy


def test_sizes_are_validated() -> None:
    with pytest.raises(ConfigError, match="ensemble_size >= write_quorum >= ack_quorum"):
        LeaderFollowerPolicy(None, ensemble_size=2, write_quorum=2, ack_quorum=3)  # type: ignore[arg-type]


def test_the_least_loaded_bookies_are_chosen_and_the_least_loaded_leads() -> None:
    load = {"a:1": 50.0, "b:1": 10.0, "c:1": 0.0, "d:1": 99.0}
    policy = LeaderFollowerPolicy(
        None,  # type: ignore[arg-type]
        ensemble_size=3,
        write_quorum=3,
        ack_quorum=2,
        bookie_load=load.__getitem__,
    )
    assert policy.choose_ensemble(sorted(load)) == ["c:1", "b:1", "a:1"]


# -- the watchdog ------------------------------------------------------------------------


@asynccontextmanager
async def writing(
    tmp_path: Any, segment_id: int
) -> AsyncIterator[tuple[Any, LeaderFollowerWriter]]:
    """A writer of a new segment on three bookies (E=Qw=3, Qa=2) that has stored two
    entries; its background work is cancelled on the way out."""
    async with _cluster(tmp_path, 3) as (bookies, client):
        policy = LeaderFollowerPolicy(client, ensemble_size=3, write_quorum=3, ack_quorum=2)
        ensemble = policy.choose_ensemble(bookies.addresses)
        async with trio.open_nursery() as nursery:
            writer = await policy.create_writer(segment_id, list(ensemble), nursery=nursery)
            await _write(writer, [b"a", b"b"])
            yield bookies, writer
            nursery.cancel_scope.cancel()


async def test_a_stalled_leader_is_replaced_and_writes_go_on(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader that stops answering but keeps its connection open is treated as failed
    after the add timeout: a follower takes over instead of the writer waiting forever."""
    monkeypatch.setattr("pigeon.core._replication.ADD_ENTRY_TIMEOUT_S", 1.0)
    async with writing(tmp_path, 78) as (bookies, writer):
        leader = writer.leader_address
        bookies.pause(leader)
        with trio.fail_after(30):
            await _write(writer, [b"c", b"d"])
        assert writer.leader_address != leader
        bookies.resume(leader)


async def test_a_paused_leader_and_follower_fail_the_writer_instead_of_wedging_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pigeon.core._replication.ADD_ENTRY_TIMEOUT_S", 0.5)
    async with writing(tmp_path, 79) as (bookies, writer):
        leader = writer.leader_address
        follower = next(a for a in writer.ensemble if a != leader)
        bookies.pause(leader)
        bookies.pause(follower)
        answers: list[tuple[int, BaseException | None]] = []
        answered = trio.Event()

        def done(eid: int, err: BaseException | None) -> None:
            answers.append((eid, err))
            answered.set()

        writer.add_nowait(b"c", done)
        with trio.move_on_after(8):
            await answered.wait()
        bookies.resume(leader)
        bookies.resume(follower)
        assert answers, "the writer neither wrote nor failed with two of three paused"
        error = answers[0][1]
        assert isinstance(error, PigeonError) and error.retriable, answers
