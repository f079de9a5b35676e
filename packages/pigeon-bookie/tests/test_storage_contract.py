"""The ``segment-files`` backend (SegmentStore) against the ledger storage contract."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pigeon.bookie import SegmentStore, testing
from pigeon.bookie import _cli as bookie_cli
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


class TestJournal(LedgerStorageContract):
    reclaims_on_delete = False  # entry logs are shared: compaction frees the space

    @pytest.fixture
    def storage_name(self) -> str:
        return "journal"

    @pytest.fixture
    def make_storage(self) -> Callable[..., LedgerStorage]:
        return testing.make_journal_storage

    @pytest.fixture
    def tear_tail(self) -> Callable[[Path], None]:
        return testing.tear_journal_append

    @pytest.fixture
    def corrupt_entry(self) -> Callable[[Path, int, int], None]:
        return testing.corrupt_journal_entry


class TestJournalSyncThread(TestJournal):
    """The contract again with every group-commit round on the sync thread (small
    rounds run inline by default, so the contract above mostly exercises that path)."""

    @pytest.fixture
    def make_storage(self) -> Callable[..., LedgerStorage]:
        return lambda path, **options: testing.make_journal_storage(
            path, **({"journal_inline_sync_max_bytes": 0} | options)
        )


def test_journal_store_is_a_ledger_storage(tmp_path: Path) -> None:
    store: Any = testing.make_journal_storage(tmp_path)
    assert isinstance(store, LedgerStorage)


@pytest.mark.parametrize(
    ("first", "then"), [("journal", "segment-files"), ("segment-files", "journal")]
)
async def test_a_data_dir_keeps_the_storage_that_wrote_it(
    first: str, then: str, tmp_path: Path
) -> None:
    """Started with the other backend, a bookie refuses its data dir in words (its
    segments would otherwise look lost and be re-replicated from scratch)."""
    import trio

    from pigeon.bookie import BookieConfig
    from pigeon.core import PluginManager
    from pigeon.core.errors import StorageError

    storages = PluginManager(load_entry_points=False, extra_plugins=(bookie_cli,)).ledger_storages
    config = BookieConfig(data_dir=str(tmp_path), fsync="always")
    async with trio.open_nursery() as nursery:
        store = storages.get(first)(config)
        await nursery.start(store.run)
        await store.add_entry(1, 0, b"kept")
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        with pytest.raises(StorageError, match=f"holds another ledger storage .*not {then}"):
            await nursery.start(storages.get(then)(config).run)
    async with trio.open_nursery() as nursery:  # the right one still opens it
        store = storages.get(first)(config)
        await nursery.start(store.run)
        assert store.read_entries(1, 0, 0) == [(0, b"kept")]
        nursery.cancel_scope.cancel()
