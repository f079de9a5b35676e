"""The built-in quorum policy against the ReplicationPolicy contract, and recovery
(:func:`pigeon.core._replication.recover_segment`) when a bookie stops answering."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from pigeon.core import _replication
from pigeon.core._replication import QuorumPolicy
from pigeon.core.errors import ConfigError
from pigeon.core.testing import ReplicationPolicyContract
from pigeon.core.testing._replication_suite import _world


class TestQuorumPolicy(ReplicationPolicyContract):
    @pytest.fixture
    def make_policy(self) -> Any:
        return QuorumPolicy


def test_quorum_sizes_are_validated() -> None:
    with pytest.raises(ConfigError, match="ensemble_size >= write_quorum >= ack_quorum"):
        QuorumPolicy(None, ensemble_size=2, write_quorum=3, ack_quorum=1)  # type: ignore[arg-type]


async def test_recovery_does_not_wait_per_entry_on_a_bookie_that_stops_answering(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recovery copies the entries a bookie lacks to it in windows of adds sent at once,
    and gives that bookie up at the first window it leaves unanswered.  It waited
    RECOVERY_OP_TIMEOUT_S per entry before: a bookie paused right after the fence held
    a topic's load (and every producer and consumer of it) for minutes."""
    monkeypatch.setattr(_replication, "RECOVERY_OP_TIMEOUT_S", 0.5)
    async with _world(tmp_path, QuorumPolicy, 3, (3, 2, 2)) as w:
        lacking, first, second = w.ensemble[0], w.segment, w.segment + 1

        async def store(segment: int, entries: range, tag: bytes, lacking_has: int) -> None:
            """A writer that died with ``entries`` unconfirmed (LAC -1): every bookie of
            their write sets holds them, ``lacking`` only those below ``lacking_has``."""
            for entry in entries:
                for bookie in w.holders(entry, 2):
                    if bookie != lacking or entry < lacking_has:
                        await w.client.add_entry(
                            bookie, segment, entry - entries[0], -1, tag + b"%d" % entry
                        )

        # first: every bookie answers, and `lacking` gets its share of the tail back
        await store(first, range(300), b"e", 10)
        assert await w.policy.recover(first, w.ensemble) == 299
        held = await w.client.read_entries(lacking, first, 0, 299)
        assert [bytes(d) for _i, d in held] == [
            b"e%d" % i for i in range(300) if lacking in w.holders(i, 2)
        ]

        await store(second, range(300, 600), b"f", 0)  # a second segment of that shape
        original = _replication._read_tail
        reads = 0

        async def read_then_pause(*args: Any) -> Any:
            nonlocal reads
            tail = await original(*args)
            reads += 1
            if reads == len(w.ensemble):  # fenced and read everywhere: `lacking` goes silent
                w.bookies.pause(lacking)
            return tail

        monkeypatch.setattr(_replication, "_read_tail", read_then_pause)
        try:
            with trio.fail_after(5):  # ~200 entries to copy: 100 s at one timeout each
                assert await w.policy.recover(second, w.ensemble) == 299
        finally:
            w.bookies.resume(lacking)
