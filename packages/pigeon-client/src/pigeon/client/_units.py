"""Numbers, sizes, durations and plurals as a person writes them (the CLI's one convention).

- counts: thousands separated by commas, the noun agreeing: ``1 message``, ``2 messages``,
  ``12,345 messages`` (:func:`plural`);
- sizes: decimal SI units with one decimal above a kilobyte: ``512 B``, ``1.5 kB``,
  ``16.9 MB`` (:func:`size`), and rates the same with ``/s``: ``16.9 MB/s`` (:func:`rate`);
- durations: whole units from days down to seconds, largest first, as many as needed to
  be exact: ``1 d``, ``4 h``, ``1 h 30 min``, ``90 ms`` below a second (:func:`duration`).

The dashboard (``pigeon.broker`` ``dashboard/units.js``) follows the same rules.
:func:`field` picks a form by a JSON field's name (``*_s`` seconds, ``*_ms``
milliseconds, ``*_bytes`` sizes, ``*_bytes_per_s`` and ``msg_throughput_*`` byte rates,
``msg_rate_*`` message rates, ``time`` and ``*_at`` points in time), so tables and
``key value`` lists read the same everywhere; nested values (a health check's details, a
cache's counters) are inlined as ``name value`` pairs, lists comma-separated; yes/no
values as ``true``/``false``, as ``set-policies`` and the TOML config take them.
:func:`heading` names a table's column in words, its unit left to the values
(``free_disk_bytes`` is ``FREE DISK``, its cells ``73.2 GB``).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

_SIZE_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")
#: fields that are sizes in bytes besides ``*_bytes`` and ``bytes_*``
_SIZES = ("size", "storage_size", "bytes")
_DURATION_UNITS = (("d", 86400), ("h", 3600), ("min", 60), ("s", 1))


def number(value: float, digits: int = 1) -> str:
    """``86400`` -> ``86,400``; ``2.25`` -> ``2.2`` (``digits`` after the point, none when
    the value is whole)."""
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.{digits}f}"


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 message``, ``0 messages``, ``1,000 messages`` (``nouns``: an irregular plural)."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"


def size(value: float) -> str:
    """Bytes in decimal SI units: ``999 B``, ``1.5 kB``, ``16.9 MB``; negative values
    (``-1``: "unlimited"/"off" in policies) are shown as they are."""
    if value < 0:
        return number(value)
    i = 0
    while value >= 1000 and i < len(_SIZE_UNITS) - 1:
        value /= 1000
        i += 1
    return f"{int(value)} B" if i == 0 else f"{value:.1f} {_SIZE_UNITS[i]}"


def rate(bytes_per_s: float) -> str:
    """A byte rate: ``16.9 MB/s``."""
    return size(bytes_per_s) + "/s"


def duration(seconds: float) -> str:
    """``86400`` -> ``1 d``; ``5400`` -> ``1 h 30 min``; ``0.25`` -> ``250 ms``; ``0`` ->
    ``0 s``; negative values (``-1``: forever in policies) are shown as they are."""
    if seconds < 0:
        return number(seconds)
    if 0 < seconds < 1:
        return f"{number(seconds * 1000)} ms"
    whole = int(seconds)
    parts = []
    for unit, length in _DURATION_UNITS:
        if whole >= length:
            parts.append(f"{whole // length:,} {unit}")
            whole %= length
    fraction = seconds - int(seconds)
    if fraction:
        tail = f"{fraction:.3f}".rstrip("0").lstrip("0")
        if parts and parts[-1].endswith(" s"):
            parts[-1] = parts[-1][:-2] + tail + " s"
        else:
            parts.append(f"0{tail} s")
    return " ".join(parts) or "0 s"


#: column headings that are not the field's name in words
_HEADINGS = {
    "msgs_in": "messages in",
    "msgs_out": "messages out",
    "msg_rate_in": "rate in",
    "msg_rate_out": "rate out",
    "msg_throughput_in": "throughput in",
    "msg_throughput_out": "throughput out",
    "subscription_count": "subscriptions",
    "storage_size": "storage",
    "backlog_bytes": "backlog size",
    "read_only": "read-only",
    "bytes": "size",
}


def words(name: str) -> str:
    """A JSON field's name as words, its unit suffix dropped (the value carries the
    unit): ``free_disk_bytes`` -> ``free disk``, ``write_bytes_per_s`` -> ``write rate``,
    ``latency_ms`` -> ``latency``."""
    if name in _HEADINGS:
        return _HEADINGS[name]
    for suffix, instead in (("_bytes_per_s", "_rate"), ("_bytes", ""), ("_ms", ""), ("_s", "")):
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)] + instead
            break
    return name.replace("_", " ")


def heading(name: str) -> str:
    """A table column's heading: :func:`words` in capitals (``FREE DISK``)."""
    return words(name).upper()


def timestamp(seconds: float) -> str:
    """A point in time, local, ISO 8601 to the second: ``2026-11-27T05:59:49``."""
    return dt.datetime.fromtimestamp(seconds).isoformat(timespec="seconds")


def _span(pair: Any) -> str:
    """A half-open offset range ``[start, end)`` as ``start-last`` (``start`` alone)."""
    start, end = pair
    return str(start) if end - start <= 1 else f"{start}-{end - 1}"


def _nested(name: str, value: list[Any] | dict[str, Any]) -> str:
    """A list or dict inlined as text: ``hits 0, misses 2, bytes 191 B``; ``1:0`` for a
    ``*_position`` (segment:entry); ``0-4, 7`` for ``*_ranges``; ``-`` when empty."""
    if not value:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{words(str(k))} {field(str(k), v)}" for k, v in value.items())
    if name.endswith("position") and all(isinstance(x, int) for x in value):
        return ":".join(str(x) for x in value)
    if name.endswith("_ranges"):
        return ", ".join(_span(r) if isinstance(r, list) and len(r) == 2 else str(r) for r in value)
    return ", ".join(field(name, x) if isinstance(x, (list, dict)) else str(x) for x in value)


def field(name: str, value: Any) -> str:
    """``value`` of the JSON field ``name`` as text (see the module's rules); ``-`` for
    None; lists and dicts inlined (:func:`_nested`)."""
    if value is None:
        return "-"
    if isinstance(value, (list, dict)):
        return _nested(name, value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if not isinstance(value, (int, float)):
        return str(value) or "-"
    if value != value or abs(value) >= 1e18:  # NaN, or too large to mean anything
        return repr(value)
    if name in ("time", "last_publish_time") or name.endswith("_at") or name == "ctime":
        if value <= 0:
            return "-"
        ms = name in ("time", "last_publish_time")
        return timestamp(value / 1000 if ms else value)
    if name.endswith("_bytes_per_s") or name.startswith("msg_throughput"):
        return rate(value)
    if name.startswith("msg_rate"):
        return f"{number(value)} msg/s"
    if name.endswith("_bytes") or name.startswith("bytes_") or name in _SIZES:
        return size(value)
    if name.endswith("_ms") and not name.endswith("timestamp_ms"):
        return duration(value / 1000)
    if name.endswith("_s"):
        return duration(value)
    if name.endswith("_offset") or name.endswith("_id") or name in ("id", "offset"):
        return str(value)  # identifiers, not amounts
    return number(value, 2)
