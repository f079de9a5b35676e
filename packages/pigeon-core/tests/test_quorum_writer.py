"""The quorum writer (:mod:`pigeon.core._quorum_writer`) beyond the policy contract: a
bookie that stalls is replaced."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from pigeon.core._replication import QuorumPolicy
from pigeon.core.testing._replication_suite import _read_all, _world, _write


async def test_a_stalled_bookie_is_replaced_and_writes_go_on(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bookie that stops answering (paused, cut off) but keeps its connection open is
    treated as failed after the add timeout: the writer changes the ensemble instead of
    waiting for it forever."""
    monkeypatch.setattr("pigeon.core._replication.ADD_ENTRY_TIMEOUT_S", 1.0)
    async with _world(tmp_path, QuorumPolicy, 4, (3, 2, 2)) as w:
        writer = await w.writer(w.spare())
        await _write(writer, [b"a", b"b", b"c"])
        stalled = w.ensemble[1]
        w.bookies.pause(stalled)
        with trio.fail_after(30):
            await _write(writer, [f"x{i}".encode() for i in range(6)])
        assert stalled not in writer.ensemble
        assert await _read_all(w.policy, w.segment, writer.ensemble, 8) == [
            b"a",
            b"b",
            b"c",
            *[f"x{i}".encode() for i in range(6)],
        ]
        w.bookies.resume(stalled)
