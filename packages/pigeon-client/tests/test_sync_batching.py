"""The sync face's batching timer against a real ``pigeon standalone`` process: a batch the
timer seals on the engine's thread goes to the connection from there at once, with no
``run_sync_soon`` of the engine's thread to itself (a wake-up write and a scheduler pass on
the latency path of every batch a timer seals)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from pigeon.client import Client

pytestmark = pytest.mark.integration


def test_a_batch_the_timer_seals_is_sent_without_a_hop_to_the_engine_itself(url: str) -> None:
    with Client(url) as client:
        thread = client.engine_thread
        from_engine: list[Any] = []
        soon = thread.soon

        def counting_soon(fn: Any, *args: Any) -> None:
            if threading.current_thread() is thread.thread:
                from_engine.append(fn)
            soon(fn, *args)

        thread.soon = counting_soon  # type: ignore[method-assign]
        with client.create_producer("sync-timer", batching_max_delay_ms=2) as producer:
            ids = [producer.send(b"m%d" % i, timeout=10) for i in range(5)]
        assert len({(i.segment_id, i.entry_id) for i in ids}) == 5, "one batch per send"
        assert from_engine == [], "the engine's thread scheduled a call to itself"
