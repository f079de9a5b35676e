"""The ``segment-files`` backend (SegmentStore) against the ledger storage contract."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pigeon.bookie import SegmentStore, testing
from pigeon.core.storage import LedgerStorage
from pigeon.core.testing import LedgerStorageContract


class TestSegmentFiles(LedgerStorageContract):
    @pytest.fixture
    def storage_name(self) -> str:
        return "segment-files"

    @pytest.fixture
    def make_storage(self) -> Callable[..., LedgerStorage]:
        return lambda path, **options: SegmentStore(path, **options)

    @pytest.fixture
    def tear_tail(self) -> Callable[[Path], None]:
        return testing.tear_tail

    @pytest.fixture
    def corrupt_entry(self) -> Callable[[Path, int, int], None]:
        return testing.corrupt_entry


def test_segment_store_is_a_ledger_storage(tmp_path: Path) -> None:
    store: Any = SegmentStore(tmp_path)
    assert isinstance(store, LedgerStorage)
