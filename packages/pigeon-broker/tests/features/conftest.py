"""Fixtures of the end-to-end feature tests (broker, bookie and client together)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pigeon.client.trio import Client
from pigeon.core.testing import InProcessStandalone, in_process_standalone


@pytest.fixture
async def small_segments(tmp_path: Path) -> AsyncIterator[InProcessStandalone]:
    """Like ``pigeon_standalone``, with segments of two entries (frequent rollovers, so
    trimming shows in ``ledger.segments``)."""
    async with in_process_standalone(tmp_path / "pigeon", segment_max_entries=2) as cluster:
        yield cluster


@pytest.fixture
async def small_segments_client(small_segments: InProcessStandalone) -> AsyncIterator[Client]:
    """The real (trio) client, connected to ``small_segments``."""
    async with Client(small_segments.url) as client:
        yield client
