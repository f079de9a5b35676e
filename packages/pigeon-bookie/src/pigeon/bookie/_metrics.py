"""Prometheus metrics of a bookie, and a minimal HTTP endpoint serving them.

``pigeon bookie --http-port P`` serves ``GET /metrics``; in ``pigeon standalone`` the
broker's ``/metrics`` includes these lines (the bookie runs in the same process).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import trio

from pigeon.core.rpc import listen_tcp
from pigeon.core.storage import LedgerStorage

__all__ = ["render_metrics", "serve_metrics"]

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render_metrics(
    store: LedgerStorage, address: str = "", *, connections: Mapping[str, int] | None = None
) -> str:
    """Prometheus exposition text of a ledger storage's statistics, and with
    ``connections`` (link -> connections served now: ``tcp``, ``in_process``) the
    ``pigeon_bookie_connections`` gauge."""
    st = store.statistics()
    label = f'{{bookie="{address}"}}' if address else ""
    rounds = max(st.flush_rounds, 1)
    rows = [
        ("pigeon_bookie_entries_written_total", "counter", "Entries appended.", st.entries_written),
        (
            "pigeon_bookie_bytes_written_total",
            "counter",
            "Bytes appended (record headers included).",
            st.bytes_written,
        ),
        (
            "pigeon_bookie_entries_read_total",
            "counter",
            "Entries returned by reads.",
            st.entries_read,
        ),
        (
            "pigeon_bookie_bytes_read_total",
            "counter",
            "Payload bytes returned by reads.",
            st.bytes_read,
        ),
        ("pigeon_bookie_fsyncs_total", "counter", "fsync/fdatasync calls.", st.fsyncs),
        (
            "pigeon_bookie_flush_rounds_total",
            "counter",
            "Group-commit flush rounds.",
            st.flush_rounds,
        ),
        (
            "pigeon_bookie_inline_flush_rounds_total",
            "counter",
            "Flush rounds run on the event loop (small rounds on a fast disk), not a thread.",
            st.inline_flush_rounds,
        ),
        (
            "pigeon_bookie_flush_seconds_total",
            "counter",
            "Time spent in flush rounds.",
            round(st.flush_seconds, 6),
        ),
        (
            "pigeon_bookie_flush_latency_seconds",
            "gauge",
            "Mean time of a flush round (fsync latency).",
            round(st.flush_seconds / rounds, 6),
        ),
        ("pigeon_bookie_segments", "gauge", "Segments stored.", st.segments),
        (
            "pigeon_bookie_disk_usage_bytes",
            "gauge",
            "Bytes of all segment files.",
            st.disk_usage_bytes,
        ),
        (
            "pigeon_bookie_corrupt_entries_total",
            "counter",
            "Damaged entries found by reads.",
            st.corrupt_entries_detected,
        ),
        (
            "pigeon_bookie_damaged_entries",
            "gauge",
            "Entries known damaged here (found at start or by reads, not repaired since).",
            st.damaged_entries,
        ),
        (
            "pigeon_bookie_torn_tails_total",
            "counter",
            "Segments whose torn tail was truncated when the store started.",
            st.torn_tails,
        ),
        (
            "pigeon_bookie_torn_entries_total",
            "counter",
            "Entries dropped with torn tails when the store started.",
            st.torn_entries,
        ),
        (
            "pigeon_bookie_repaired_entries_total",
            "counter",
            "Damaged entries rewritten from a good copy on another bookie.",
            st.repaired_entries,
        ),
        (
            "pigeon_bookie_read_only",
            "gauge",
            "1 when the bookie refuses writes.",
            int(st.read_only),
        ),
    ]
    out: list[str] = []
    for name, kind, help_text, value in rows:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        out.append(f"{name}{label} {value}")
    if connections is not None:
        name = "pigeon_bookie_connections"
        out.append(f"# HELP {name} Connections served now, by link (tcp, in_process).")
        out.append(f"# TYPE {name} gauge")
        where = f'bookie="{address}",' if address else ""
        for link, count in sorted(connections.items()):
            out.append(f'{name}{{{where}link="{link}"}} {count}')
    return "\n".join(out) + "\n"


async def serve_metrics(
    render: Callable[[], str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``GET /metrics`` over HTTP/1.1 (one response per connection)."""
    listeners = await listen_tcp(port, host, "metrics")
    sockname = listeners[0].socket.getsockname()

    async def handle(stream: trio.SocketStream) -> None:
        try:
            data = b""
            with trio.move_on_after(5):
                while b"\r\n\r\n" not in data and len(data) < 16384:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    data += chunk
            parts = data.split(b"\r\n", 1)[0].split()
            if len(parts) >= 2 and parts[0] == b"GET" and parts[1].split(b"?")[0] == b"/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE, render().encode()
            else:
                status, ctype, body = (
                    "404 Not Found",
                    "text/plain",
                    b"only GET /metrics is served here\n",
                )
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            await stream.send_all(head.encode() + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.info("metrics request failed error=%s", exc)
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started((sockname[0], sockname[1]))
