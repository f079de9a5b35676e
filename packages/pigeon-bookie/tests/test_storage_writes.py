"""The write path of the segment store (pigeon.bookie._storage_writes): payloads reach
the data file as the buffers they arrived in."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
from test_storage import files, open_store

import pigeon.bookie._storage_state as state_mod
from pigeon.bookie._segment import crc32c
from pigeon.bookie._storage_state import pwritev_all

#: payload sizes on either side of the size above which a view's checksum is taken in
#: place (64 KiB), empty included
SIZES = [0, 1, 700, 65_535, 65_536, 300_000]


def frame(sizes: list[int]) -> tuple[bytes, list[memoryview]]:
    """A received frame (one ``bytes`` object, as the frame decoder yields it) and the
    payloads in it, as memoryviews of that frame."""
    rng = random.Random(len(sizes))
    data = rng.randbytes(64 + sum(sizes))
    views, pos = [], 64
    for size in sizes:
        views.append(memoryview(data)[pos : pos + size])
        pos += size
    return data, views


@pytest.mark.parametrize("batched", [False, True])
async def test_payload_views_are_written_as_they_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batched: bool
) -> None:
    _frame, views = frame(SIZES)
    written: list[list[Any]] = []
    real = os.pwritev

    def spy(fd: int, bufs: list[Any], offset: int) -> int:
        written.append(list(bufs))
        return real(fd, bufs, offset)

    async with open_store(tmp_path / "views") as store:
        monkeypatch.setattr(os, "pwritev", spy)
        if batched:
            await store.add_entries(1, 0, views, lac=-1)
        else:
            for i, view in enumerate(views):
                await store.add_entry(1, i, view, lac=i - 1)
        monkeypatch.undo()
        assert [p for _, p in store.read_entries(1, 0, 99)] == [bytes(v) for v in views]
    bufs = [b for call in written for b in call]
    # every payload went down as the very view it came in; nothing else was written but
    # the 40-byte record headers: no joined or copied payload
    assert [b for b in bufs if b is not None and any(b is v for v in views)] == views
    others = [b for b in bufs if not any(b is v for v in views)]
    assert all(type(b) is bytes and len(b) == 40 for b in others)
    assert len(others) == len(views)

    # the file is byte for byte the one that the same entries as ``bytes`` make
    async with open_store(tmp_path / "bytes") as store:
        if batched:
            await store.add_entries(1, 0, [bytes(v) for v in views], lac=-1)
        else:
            for i, view in enumerate(views):
                await store.add_entry(1, i, bytes(view), lac=i - 1)
    for kind in ("log", "idx"):
        assert files(tmp_path / "views", 1)[kind].read_bytes() == (
            files(tmp_path / "bytes", 1)[kind].read_bytes()
        )


@pytest.mark.parametrize("size", [*SIZES, 1 << 20])
def test_checksum_of_a_view_is_that_of_its_bytes(size: int) -> None:
    _frame, [view] = frame([size])
    expected = crc32c(bytes(view))
    assert crc32c(view) == expected
    assert crc32c(bytearray(view)) == expected


def test_short_writes_and_more_buffers_than_iov_max_are_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pwritev_all writes at most IOV_MAX buffers a call and goes on after a short write."""
    monkeypatch.setattr(state_mod, "IOV_MAX", 3)
    _frame, views = frame([5, 0, 7, 11, 2, 9, 4])
    calls: list[int] = []
    real = os.pwritev

    def short(fd: int, bufs: list[Any], offset: int) -> int:
        assert len(bufs) <= 3
        calls.append(len(bufs))
        n = sum(len(b) for b in bufs)
        head = b"".join(bufs)[: max(1, n // 2)]  # half of what was asked, at most
        return real(fd, [head], offset)

    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        monkeypatch.setattr(os, "pwritev", short)
        pwritev_all(fd, list(views), 10, sum(len(v) for v in views))
    finally:
        os.close(fd)
    assert path.read_bytes()[10:] == b"".join(views)
    assert len(calls) > 3
