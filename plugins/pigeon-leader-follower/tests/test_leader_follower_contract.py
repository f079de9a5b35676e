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
