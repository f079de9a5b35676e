"""The chunked-messages scenario: 50 MB messages through a chunking producer (sync face)
and one consumer that reassembles them, against a standalone on loopback.

    python -m bench --scenario chunked --chunked-messages 8

Produce MB/s is from the first send to the last receipt (each send waits for its receipt,
as an application sending one large file at a time would); consume MB/s from the
subscription's first message to the last one reassembled (a backlog read).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MESSAGE_BYTES = 50 * 1000 * 1000


def chunked_scenario(args: Any) -> dict[str, Any]:
    from bench.__main__ import Standalone, client_options
    from pigeon.client import Client

    n = args.chunked_messages
    payload = os.urandom(1_000_000) * (MESSAGE_BYTES // 1_000_000)
    with tempfile.TemporaryDirectory(prefix="pigeon-bench-") as tmp:  # noqa: SIM117
        with Standalone(Path(tmp) / "data") as sa, Client(sa.url, **client_options(sa.url)) as c:
            c.subscribe("bench-chunked", "s", initial_position="earliest").close()
            with c.create_producer(
                "bench-chunked", chunking_enabled=True, batching_enabled=False
            ) as producer:
                start = time.perf_counter()
                for _ in range(n):
                    producer.send(payload)
                produce_s = time.perf_counter() - start
            print(f"produced {n} x 50 MB in {produce_s:.2f}s", file=sys.stderr)
            with c.subscribe("bench-chunked", "s") as consumer:
                start = time.perf_counter()
                for _ in range(n):
                    msg = consumer.receive(timeout=60)
                    assert len(msg.value) == MESSAGE_BYTES
                    consumer.acknowledge(msg)
                consume_s = time.perf_counter() - start
    total = n * MESSAGE_BYTES
    return {
        "messages": n,
        "message_bytes": MESSAGE_BYTES,
        "chunks_per_message": len(msg.message_id.chunk_ids),  # type: ignore[attr-defined]
        "produce_seconds": round(produce_s, 2),
        "produce_mb_per_s": round(total / produce_s / 1e6, 1),
        "consume_seconds": round(consume_s, 2),
        "consume_mb_per_s": round(total / consume_s / 1e6, 1),
    }


def render_chunked(results: dict[str, Any], command: str) -> str:
    from bench.__main__ import CHUNKED_BEGIN, CHUNKED_END, section_head

    r = results
    lines = [
        *section_head(CHUNKED_BEGIN, command),
        "| scenario | result | target |",
        "|---|---|---|",
        f"| chunked producer (sync API), {r['messages']} messages of 50 MB "
        f"({r['chunks_per_message']} chunks each), each send awaited, fsync=always | "
        f"**{r['produce_mb_per_s']} MB/s** | — |",
        f"| one consumer reassembling them (backlog read, acks) | "
        f"**{r['consume_mb_per_s']} MB/s** | — |",
        "",
        CHUNKED_END,
    ]
    return "\n".join(lines)
