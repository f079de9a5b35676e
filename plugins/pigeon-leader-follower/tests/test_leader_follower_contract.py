"""The leader-follower policy against the ReplicationPolicy contract, on real bookies."""

from __future__ import annotations

from typing import Any

import pytest
from pigeon_leader_follower import LeaderFollowerPolicy

from pigeon.core import PluginManager
from pigeon.core.errors import ConfigError
from pigeon.core.testing import ReplicationPolicyContract


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


async def test_a_stalled_leader_is_replaced_and_writes_go_on(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader that stops answering but keeps its connection open is treated as failed
    after the add timeout: a follower takes over instead of the writer waiting forever."""
    import trio

    from pigeon.core.testing._replication_suite import _cluster, _write

    monkeypatch.setattr("pigeon.core._replication.ADD_ENTRY_TIMEOUT_S", 1.0)
    async with _cluster(tmp_path, 3) as (bookies, client):
        policy = LeaderFollowerPolicy(client, ensemble_size=3, write_quorum=3, ack_quorum=2)
        ensemble = policy.choose_ensemble(bookies.addresses)
        async with trio.open_nursery() as nursery:
            writer = await policy.create_writer(78, list(ensemble), nursery=nursery)
            await _write(writer, [b"a", b"b"])
            leader = writer.leader_address
            bookies.pause(leader)
            with trio.fail_after(30):
                await _write(writer, [b"c", b"d"])
            assert writer.leader_address != leader
            bookies.resume(leader)
            nursery.cancel_scope.cancel()
