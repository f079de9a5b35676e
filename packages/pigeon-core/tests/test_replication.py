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
