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
