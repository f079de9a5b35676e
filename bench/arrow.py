"""The Arrow scenario: 100-byte rows produced with ``send_arrow`` and consumed with
``receive_arrow`` (cumulative acks), beside the per-message API's 100-byte produce and
consume on the same standalone, in the same run.

    python -m bench --scenario arrow --duration 10

Produce msg/s counts rows from the first ``send_arrow`` to the last receipt (``flush``:
every entry acknowledged by the broker, fsync=always); consume msg/s from the first
``receive_arrow`` to the last row, each record batch acknowledged cumulatively. The
``*_in_call_s`` fields are the seconds the caller's thread spent inside ``send_arrow`` /
``receive_arrow`` (building entries, wrapping them): what is left of the elapsed time is
waiting on the engine thread, the broker and the bookie.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROW_BYTES = 100
#: rows per send_arrow call (a 10 MB table)
TABLE_ROWS = 100_000
#: rows (and bytes) per entry: the producer's batching limits
ENTRY_ROWS = 20_000
ENTRY_BYTES = 4 << 20


def arrow_produce(url: str, topic: str, duration: float) -> dict[str, Any]:
    import pyarrow as pa

    from bench.__main__ import client_options
    from pigeon.client import Client

    values = pa.array([i.to_bytes(4, "little") * (ROW_BYTES // 4) for i in range(TABLE_ROWS)])
    table = pa.table({"value": values})
    rows = in_call = 0.0
    with Client(url, **client_options(url)) as client:
        client.subscribe(topic, "bench", initial_position="earliest").close()
        with client.create_producer(
            topic,
            batching_max_messages=ENTRY_ROWS,
            batching_max_bytes=ENTRY_BYTES,
            max_pending_messages=4 * TABLE_ROWS,
        ) as producer:
            start = time.perf_counter()
            while time.perf_counter() - start < duration:
                t0 = time.perf_counter()
                producer.send_arrow(table)
                in_call += time.perf_counter() - t0
                rows += TABLE_ROWS
            producer.flush()
            elapsed = time.perf_counter() - start
    return {
        "rows": int(rows),
        "seconds": round(elapsed, 2),
        "msg_per_s": round(rows / elapsed),
        "mb_per_s": round(rows * ROW_BYTES / elapsed / 1e6, 1),
        "in_call_s": round(in_call, 2),
        "entry_rows": ENTRY_ROWS,
    }


def arrow_consume(url: str, topic: str, rows: int) -> dict[str, Any]:
    from bench.__main__ import client_options
    from pigeon.client import Client, MessageId

    got = 0
    in_call = 0.0
    batches = 0
    with (
        Client(url, **client_options(url)) as client,
        client.subscribe(topic, "bench", receiver_queue_size=10 * ENTRY_ROWS) as consumer,
    ):
        start = time.perf_counter()
        while got < rows:
            t0 = time.perf_counter()
            rb = consumer.receive_arrow(10 * ENTRY_ROWS, timeout=30)
            last = MessageId.deserialize(rb.column("message_id")[rb.num_rows - 1].as_py())
            consumer.acknowledge_cumulative(last)
            in_call += time.perf_counter() - t0
            got += rb.num_rows
            batches += 1
        elapsed = time.perf_counter() - start
    return {
        "rows": got,
        "seconds": round(elapsed, 2),
        "msg_per_s": round(got / elapsed),
        "mb_per_s": round(got * ROW_BYTES / elapsed / 1e6, 1),
        "in_call_s": round(in_call, 2),
        "record_batches": batches,
    }


def client_ceilings(seconds: float = 2.0) -> dict[str, Any]:
    """Rows per second of the client's own work, on one core, no I/O: building entries
    from a table (``send_arrow``'s part) and record batches from those entries
    (``receive_arrow``'s part). What the end-to-end figures would be if the broker and
    the bookie cost nothing."""
    from types import SimpleNamespace

    import pyarrow as pa

    from pigeon.client import _arrow
    from pigeon.client._handles import codecs_of
    from pigeon.core import PluginManager
    from pigeon.core.batch import pack_entry_header

    codecs = codecs_of(PluginManager())
    none = codecs.by_name("none")
    values = pa.array([i.to_bytes(4, "little") * (ROW_BYTES // 4) for i in range(TABLE_ROWS)])
    rb = pa.record_batch({"value": values})

    def encode() -> list[bytes]:
        rows = _arrow.plan_rows(rb, value="value", key=None, properties=None, event_time=None)
        spans = _arrow.split_points(
            rows, max_messages=ENTRY_ROWS, max_bytes=ENTRY_BYTES, max_entry=5 << 20
        )
        return [
            _arrow.encode_entry(rows, s, e, producer_name="p", sequence_id=s, codec=none)
            for s, e in spans
        ]

    out: dict[str, Any] = {}
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        entries = encode()
        done += TABLE_ROWS
    out["encode_rows_per_s"] = round(done / (time.perf_counter() - start))
    stored = [
        SimpleNamespace(segment_id=1, entry_id=i, data=pack_entry_header(ENTRY_ROWS, 0, 1) + e)
        for i, e in enumerate(entries)
    ]
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for entry in stored:
            _arrow.entry_rows(entry, topic="t", partition=-1, codecs=codecs)
        done += TABLE_ROWS
    out["record_batch_rows_per_s"] = round(done / (time.perf_counter() - start))
    return out


def arrow_scenario(args: Any) -> dict[str, Any]:
    from bench.__main__ import Standalone, small_messages

    results: dict[str, Any] = {"client_ceilings": client_ceilings()}
    print(json.dumps(results["client_ceilings"]), file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="pigeon-bench-") as tmp:  # noqa: SIM117
        with Standalone(Path(tmp) / "data") as sa:
            results.update(small_messages(sa.url, args.duration))
            results["arrow_produce"] = arrow_produce(sa.url, "bench-arrow", args.duration)
            print(json.dumps(results["arrow_produce"]), file=sys.stderr)
            results["arrow_consume"] = arrow_consume(
                sa.url, "bench-arrow", results["arrow_produce"]["rows"]
            )
            print(json.dumps(results["arrow_consume"]), file=sys.stderr)
    return results


def render_arrow(results: dict[str, Any], command: str) -> str:
    from bench.__main__ import ARROW_BEGIN, ARROW_END, section_head

    p, c = results["arrow_produce"], results["arrow_consume"]
    cc = results["client_ceilings"]
    mp, mc = results["produce_100b"], results["consume_100b"]
    lines = [
        *section_head(ARROW_BEGIN, command),
        "| scenario | result | per-message API, same run | target |",
        "|---|---|---|---|",
        f"| produce 100-byte rows, `send_arrow` of {TABLE_ROWS:,}-row tables, entries of "
        f"{p['entry_rows']:,} rows, acked (fsync=always), {p['seconds']} s | "
        f"**{p['msg_per_s']:,.0f} msg/s** ({p['mb_per_s']} MB/s; {p['in_call_s']} s inside "
        f"`send_arrow`) | {mp['msg_per_s']:,.0f} msg/s ({p['msg_per_s'] / mp['msg_per_s']:.1f}x) "
        "| ≥ 5,000,000 msg/s |",
        f"| consume the same rows, `receive_arrow` + cumulative ack per record batch | "
        f"**{c['msg_per_s']:,.0f} msg/s** ({c['mb_per_s']} MB/s; {c['record_batches']:,} "
        f"record batches, {c['in_call_s']} s inside the calls) | {mc['msg_per_s']:,.0f} msg/s "
        f"({c['msg_per_s'] / mc['msg_per_s']:.1f}x) | ≥ 5,000,000 msg/s |",
        f"| client work alone, one core, no I/O: entries built from a table / record "
        f"batches built from entries | {cc['encode_rows_per_s']:,.0f} / "
        f"{cc['record_batch_rows_per_s']:,.0f} rows/s | — | — |",
        "",
        ARROW_END,
    ]
    return "\n".join(lines)
