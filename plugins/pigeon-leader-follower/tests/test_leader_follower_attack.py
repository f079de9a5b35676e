"""Hostile tests of the leader-follower writer's watchdog (issue #12): with fewer
bookies answering than the ack quorum needs, a writer must fail (retriably) within a
bound, so that the ledger can answer producers with a clear retriable error, instead of
waiting for the paused bookies to come back."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from pigeon_leader_follower import LeaderFollowerPolicy

from pigeon.core.errors import PigeonError
from pigeon.core.testing._replication_suite import _cluster, _write


async def test_a_paused_leader_and_follower_fail_the_writer_instead_of_wedging_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pigeon.core._replication.ADD_ENTRY_TIMEOUT_S", 0.5)
    async with _cluster(tmp_path, 3) as (bookies, client):
        policy = LeaderFollowerPolicy(client, ensemble_size=3, write_quorum=3, ack_quorum=2)
        ensemble = policy.choose_ensemble(bookies.addresses)
        async with trio.open_nursery() as nursery:
            writer = await policy.create_writer(79, list(ensemble), nursery=nursery)
            await _write(writer, [b"a", b"b"])
            leader = writer.leader_address
            follower = next(a for a in ensemble if a != leader)
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
            nursery.cancel_scope.cancel()
