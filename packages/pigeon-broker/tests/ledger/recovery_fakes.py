"""A scripted ledger world (``ledger_fakes``) whose bookies fence a segment on recovery,
as ``recover_segment`` does: for the ManagedLedger attack tests of this folder."""

from __future__ import annotations

from typing import Any

import trio
from ledger_fakes import Cluster, ScriptedPolicy, ScriptedWriter

from pigeon.core.errors import SegmentFenced, ServiceUnavailable


class FencingWriter(ScriptedWriter):
    """A scripted writer whose segment can be fenced by a recovery: from then on what
    it had in flight fails, and nothing more reaches the bookies."""

    fenced: set[int]

    def store(self, upto: int, *, ack: bool = True) -> None:
        if self.segment_id in self.fenced:
            self.fail(SegmentFenced(f"segment={self.segment_id} is fenced"))
            return
        super().store(upto, ack=ack)


class RecoveringPolicy(ScriptedPolicy):
    """Recovery as ``recover_segment`` does it: it fences the segment, and needs
    ``E - Qa + 1`` bookies of the segment's ensemble to answer, else ServiceUnavailable."""

    def __init__(self, cluster: Cluster, *args: Any, **kw: Any) -> None:
        super().__init__(cluster, *args, **kw)
        self.fenced: set[int] = set()

    async def create_writer(self, segment_id: int, ensemble: Any, **kw: Any) -> ScriptedWriter:
        writer = await super().create_writer(segment_id, ensemble, **kw)
        writer.__class__ = FencingWriter
        writer.fenced = self.fenced  # type: ignore[attr-defined]
        return writer

    async def recover(self, segment_id: int, ensemble: Any, **kw: Any) -> int:
        await trio.lowlevel.checkpoint()
        qa = kw.get("ack_quorum") or self.ack_quorum
        alive = [b for b in ensemble if b not in self.cluster.dead]
        needed = len(ensemble) - min(qa, len(ensemble)) + 1
        if len(alive) < needed:
            raise ServiceUnavailable(
                f"cannot recover segment {segment_id}: only {len(alive)} of"
                f" {len(ensemble)} bookies answered"
            )
        self.fenced.add(segment_id)
        return await super().recover(segment_id, ensemble, **kw)
