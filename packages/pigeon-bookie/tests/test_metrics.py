"""A bookie's Prometheus metrics: served over HTTP and moving with the work done."""

from __future__ import annotations

import functools
from pathlib import Path

import trio

from pigeon.bookie import SegmentStore
from pigeon.bookie._metrics import render_metrics, serve_metrics


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics:\n{text}")


async def _get(port: int, path: str) -> tuple[str, str]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = b""
        while True:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.decode().partition("\r\n\r\n")
    return head.split("\r\n", 1)[0], body


async def test_metrics_count_writes_reads_and_fsyncs(tmp_path: Path) -> None:
    store = SegmentStore(tmp_path / "data", fsync="always")
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        _host, port = await nursery.start(
            functools.partial(serve_metrics, lambda: render_metrics(store, "b1"), port=0)
        )
        status, before = await _get(port, "/metrics")
        assert status.endswith("200 OK")
        assert _value(before, "pigeon_bookie_entries_written_total") == 0
        for i in range(5):
            await store.add_entry(7, i, b"x" * 1000)
        store.read_entries(7, 0, 4)
        _status, after = await _get(port, "/metrics")
        assert _value(after, "pigeon_bookie_entries_written_total") == 5
        assert _value(after, "pigeon_bookie_bytes_written_total") >= 5000
        assert _value(after, "pigeon_bookie_entries_read_total") == 5
        assert _value(after, "pigeon_bookie_fsyncs_total") >= 1
        assert _value(after, "pigeon_bookie_flush_seconds_total") > 0
        assert _value(after, "pigeon_bookie_segments") == 1
        assert 'bookie="b1"' in after
        status, _ = await _get(port, "/elsewhere")
        assert status.endswith("404 Not Found")
        nursery.cancel_scope.cancel()
