"""Fixtures of the end-to-end feature tests (broker, bookie and client together)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from standalone_support import standalone_on

from pigeon.core.testing import InProcessStandalone


@pytest.fixture
async def small_segments(tmp_path: Path) -> AsyncIterator[InProcessStandalone]:
    """Like ``pigeon_standalone``, with segments of two entries (frequent rollovers, so
    trimming shows in ``ledger.segments``)."""
    async with standalone_on(tmp_path / "pigeon", segment_max_entries=2) as cluster:
        yield cluster
