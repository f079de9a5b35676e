"""Run benchmark scenarios against a PigeonMQ standalone started here, on loopback.

    python -m bench                       # standard scenario (30 s produce, 1 GiB catch-up)
    python -m bench --duration 10 --backlog-mb 256 --no-docs
    python -m bench --scenario cluster --duration 10 --baseline HEAD~3   # before/after

Results are data, not tests: JSON goes to bench/results/, a markdown table (with the exact
command and the machine) replaces the "Standard scenario" section of docs/benchmarks.md.
"""

# ruff: noqa: E501 - the markdown table rows are long f-strings
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN = "<!-- bench:standard:begin -->"
END = "<!-- bench:standard:end -->"
SMALL_BEGIN = "<!-- bench:small:begin -->"
CLUSTER_BEGIN = "<!-- bench:cluster:begin -->"
CLUSTER_END = "<!-- bench:cluster:end -->"
SMALL_END = "<!-- bench:small:end -->"
CHUNKED_BEGIN = "<!-- bench:chunked:begin -->"
CHUNKED_END = "<!-- bench:chunked:end -->"
ARROW_BEGIN = "<!-- bench:arrow:begin -->"
ARROW_END = "<!-- bench:arrow:end -->"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(proc: subprocess.Popen[bytes], port: int, what: str, log: str) -> None:
    """Wait (30 s at most) until ``proc`` accepts connections on ``port``."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited during start; see {log}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not start within 30 s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate ``proc``; kill it if it has not exited 20 s later."""
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


#: environment variable carrying the client settings (CA file, token file) of the secured
#: servers of this run, by service URL: child processes (spawned producers, latency
#: consumers) inherit it. No secret is in it: the token stays in its 0600 file.
CLIENTS_ENV = "BENCH_PIGEON_CLIENTS"


def register_client(url: str, *, ca_file: str | None = None, token_file: str | None = None) -> None:
    """Record how a client reaches ``url`` (see :func:`client_options`)."""
    table = json.loads(os.environ.get(CLIENTS_ENV, "{}"))
    table[url] = {"ca_file": ca_file, "token_file": token_file}
    os.environ[CLIENTS_ENV] = json.dumps(table)


def forget_client(url: str) -> None:
    table = json.loads(os.environ.get(CLIENTS_ENV, "{}"))
    table.pop(url, None)
    os.environ[CLIENTS_ENV] = json.dumps(table)


def client_options(url: str) -> dict[str, Any]:
    """``Client`` keywords for ``url``: the CA of a ``pigeon+ssl://`` server and the token
    (from its file) of one with authentication; none for a plain server."""
    spec = json.loads(os.environ.get(CLIENTS_ENV, "{}")).get(url)
    if not spec:
        return {}
    out: dict[str, Any] = {}
    if spec.get("ca_file"):
        out["tls_trust_certs_file_path"] = spec["ca_file"]
    if spec.get("token_file"):
        from pigeon.client import AuthenticationToken

        out["authentication"] = AuthenticationToken(Path(spec["token_file"]))
    return out


#: ``[broker]`` keys added to every standalone this process starts (``bench.compare
#: --broker-config KEY=VALUE``), e.g. ``cache_max_bytes`` to make a catch-up read storage
#: rather than the broker's tail cache
BROKER_EXTRA: dict[str, Any] = {}


class Standalone:
    """``pigeon standalone`` on free ports. ``config``: extra TOML tables for
    ``--config`` (security settings); ``tls``: also a native TLS port (``tls_port``,
    ``broker_service_port_tls``), whose URL is :attr:`url_tls`; ``storage``: the bookie's
    ledger storage (``--storage``; None: the default, ``segment-files``)."""

    def __init__(
        self,
        data_dir: Path,
        fsync: str = "always",
        kafka: bool = False,
        config: dict[str, dict[str, Any]] | None = None,
        tls: bool = False,
        storage: str | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.storage = storage
        self.config = {k: dict(v) for k, v in (config or {}).items()}
        if BROKER_EXTRA:
            self.config.setdefault("broker", {}).update(BROKER_EXTRA)
        self.tls_port = free_port() if tls else -1
        if tls:
            self.config.setdefault("broker", {})["broker_service_port_tls"] = self.tls_port
        self.port = free_port()
        # the Kafka front door on a free port, or off (-1)
        self.kafka_port = free_port() if kafka else -1
        self.bookie_port = free_port()
        self.http_port = free_port()
        self.fsync = fsync
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"pigeon://127.0.0.1:{self.port}"

    @property
    def url_tls(self) -> str:
        return f"pigeon+ssl://127.0.0.1:{self.tls_port}"

    def __enter__(self) -> Standalone:
        pigeon = Path(sys.executable).with_name("pigeon")
        self.log = open(self.data_dir.parent / "standalone.log", "wb")
        extra: list[str] = []
        if self.config:
            from pigeon.core.testing.servers import write_toml

            cfg = write_toml(self.data_dir.parent / "standalone.toml", self.config)
            extra = ["--config", str(cfg)]
        # BENCH_PIGEON_PROFILE=FILE runs the server under cProfile, timed by the event
        # loop thread's CPU clock (bench/_profile.py; written when the server stops)
        if self.storage:
            extra += ["--storage", self.storage]
        prof = os.environ.get("BENCH_PIGEON_PROFILE")
        pre = [sys.executable, str(Path(__file__).with_name("_profile.py")), prof] if prof else []
        self.proc = subprocess.Popen(
            [
                *pre,
                str(pigeon),
                "--log-level",
                "WARNING",
                "standalone",
                "--data-dir",
                str(self.data_dir),
                "--port",
                str(self.port),
                "--bookie-port",
                str(self.bookie_port),
                "--fsync",
                self.fsync,
                "--http-port",
                str(self.http_port),
                "--kafka-port",
                str(self.kafka_port),
                *extra,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_for_port(self.proc, self.port, "standalone", "standalone.log")
        # the admin API (and /metrics, read around every step) comes up a moment later
        wait_for_port(self.proc, self.http_port, "standalone", "standalone.log")
        if self.tls_port > 0:
            wait_for_port(self.proc, self.tls_port, "standalone", "standalone.log")
        if self.kafka_port > 0:
            wait_for_port(self.proc, self.kafka_port, "standalone", "standalone.log")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop(self.proc)
        self.log.close()


@dataclass
class Cluster:
    """3 bookies + 1 broker on a shared embedded metadata store (real processes), with
    the broker's ensemble size and write and ack quorums."""

    root: Path
    bookies: int = 3
    ensemble: int = 3
    qw: int = 2
    qa: int = 2
    replication: str = "quorum"
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    port: int = field(default_factory=free_port)

    @property
    def metadata(self) -> str:
        return f"embedded://{self.root / 'metadata'}?session_timeout=5"

    @property
    def url(self) -> str:
        return f"pigeon://127.0.0.1:{self.port}"

    def _start(self, args: list[str], port: int, log: str) -> None:
        pigeon = Path(sys.executable).with_name("pigeon")
        out = open(self.root / log, "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [str(pigeon), "--log-level", "WARNING", *args], stdout=out, stderr=subprocess.STDOUT
        )
        self.procs.append(proc)
        wait_for_port(proc, port, args[0], log)

    def __enter__(self) -> Cluster:
        for i in range(self.bookies):
            port = free_port()
            self._start(
                [
                    "bookie",
                    "--metadata",
                    self.metadata,
                    "--port",
                    str(port),
                    "--data-dir",
                    str(self.root / f"bookie-{i}"),
                    "--fsync",
                    "always",
                ],
                port,
                f"bookie-{i}.log",
            )
        config = self.root / "broker.toml"
        config.write_text(
            f"[broker]\nensemble_size = {self.ensemble}\nwrite_quorum = {self.qw}\n"
            f"ack_quorum = {self.qa}\n"
        )
        self._start(
            [
                "broker",
                "--metadata",
                self.metadata,
                "--port",
                str(self.port),
                "--http-port",
                str(free_port()),
                "--config",
                str(config),
                "--replication",
                self.replication,
            ],
            self.port,
            "broker.log",
        )
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            stop(proc)


def cluster_scenario(args: argparse.Namespace) -> dict[str, Any]:
    """1 KiB production to 3 bookies (E=3, Qw=2, Qa=2) beside a standalone, same run; then
    the leader-follower policy (E=Qw=2: two copies, Qa=2) on 3 bookies."""
    from pigeon.client._cli import run_perf_produce

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pigeon-bench-") as tmp:
        with Standalone(Path(tmp) / "standalone") as sa:
            results["standalone"] = run_perf_produce(
                sa.url, "bench-sa", size=1024, duration=args.duration, progress=False
            )
        print(json.dumps(results["standalone"]), file=sys.stderr)
        root = Path(tmp) / "cluster"
        root.mkdir()
        with Cluster(root) as cl:
            results["cluster"] = run_perf_produce(
                cl.url, "bench-cluster", size=1024, duration=args.duration, progress=False
            )
        print(json.dumps(results["cluster"]), file=sys.stderr)
        root = Path(tmp) / "cluster-lf"
        root.mkdir()
        with Cluster(root, ensemble=2, qw=2, qa=2, replication="leader-follower") as cl:
            results["cluster_lf"] = run_perf_produce(
                cl.url, "bench-cluster", size=1024, duration=args.duration, progress=False
            )
        print(json.dumps(results["cluster_lf"]), file=sys.stderr)
    return results


def render_cluster(results: dict[str, Any], command: str) -> str:
    sa, cl = results["standalone"], results["cluster"]
    return "\n".join(
        [
            *section_head(CLUSTER_BEGIN, command),
            "| setup (1 producer, 1 KiB, batching on, acked, fsync=always) | result | target |",
            "|---|---|---|",
            f"| standalone (1 bookie) | **{sa['mb_per_s']} MB/s** ({sa['msg_per_s']:,.0f} msg/s) | — |",
            f"| 3 bookies (E=3, Qw=2, Qa=2) + 1 broker, separate processes | **{cl['mb_per_s']} MB/s** "
            f"({cl['msg_per_s']:,.0f} msg/s); ratio to standalone {cl['mb_per_s'] / max(sa['mb_per_s'], 1e-9):.2f} | ≥ 80 MB/s |",
            *(
                [
                    f"| 3 bookies, leader-follower (E=Qw=2, Qa=2: the leader forwards) + 1 broker | **{lf['mb_per_s']} MB/s** "
                    f"({lf['msg_per_s']:,.0f} msg/s); ratio to standalone {lf['mb_per_s'] / max(sa['mb_per_s'], 1e-9):.2f} | — |"
                ]
                if (lf := results.get("cluster_lf"))
                else []
            ),
            "",
            CLUSTER_END,
        ]
    )


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Python {platform.python_version()}, {platform.system()} {platform.release()}"


def standard(args: argparse.Namespace) -> dict[str, Any]:
    from pigeon.client._cli import run_perf_consume, run_perf_produce

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pigeon-bench-") as tmp:
        data = Path(tmp) / "data"
        with Standalone(data) as sa:
            print(f"standalone at {sa.url}; producing for {args.duration}s", file=sys.stderr)
            results["produce_1k"] = run_perf_produce(
                sa.url, "bench-produce", size=1024, duration=args.duration, progress=False
            )
            print(json.dumps(results["produce_1k"]), file=sys.stderr)
            backlog = args.backlog_mb * 1024 * 1024
            n = backlog // 1024
            print(f"filling a {args.backlog_mb} MiB backlog ({n} messages)", file=sys.stderr)
            fill = fill_backlog(sa.url, "bench-backlog", n)
            results["backlog_fill"] = fill
            results["consume_backlog"] = run_perf_consume(
                sa.url,
                "bench-backlog",
                duration=max(60.0, args.duration * 2),
                max_messages=n,
                idle_timeout=10.0,
                progress=False,
            )
            print(json.dumps(results["consume_backlog"]), file=sys.stderr)
            results["storage_bytes"] = sum(f.stat().st_size for f in data.rglob("*") if f.is_file())
    return results


def small_messages(url: str, duration: float) -> dict[str, Any]:
    """``produce_100b`` and ``consume_100b``: 100-byte messages through the sync API, sent
    for ``duration`` seconds, then all consumed."""
    from pigeon.client._cli import run_perf_consume, run_perf_produce

    out: dict[str, Any] = {}
    out["produce_100b"] = run_perf_produce(
        url,
        "bench-small",
        size=100,
        duration=duration,
        progress=False,
        batch_max_messages=2000,
        batch_max_bytes=1 << 20,
    )
    print(json.dumps(out["produce_100b"]), file=sys.stderr)
    out["consume_100b"] = run_perf_consume(
        url,
        "bench-small",
        duration=max(60.0, duration * 2),
        max_messages=out["produce_100b"]["messages"],
        idle_timeout=10.0,
        progress=False,
    )
    print(json.dumps(out["consume_100b"]), file=sys.stderr)
    return out


def small_and_codecs(args: argparse.Namespace) -> dict[str, Any]:
    """100-byte messages through the sync API, and 1 KiB messages per codec."""
    from pigeon.client._cli import run_perf_produce

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pigeon-bench-") as tmp:  # noqa: SIM117
        with Standalone(Path(tmp) / "data") as sa:
            results.update(small_messages(sa.url, args.duration))
            results["produce_json_schema"] = schema_produce(sa.url, max(5.0, args.duration / 3))
            print(json.dumps(results["produce_json_schema"]), file=sys.stderr)
            for codec in args.codecs:
                key = f"produce_1k_{codec}"
                results[key] = run_perf_produce(
                    sa.url,
                    f"bench-codec-{codec}",
                    size=1024,
                    duration=max(5.0, args.duration / 3),
                    compression=codec,
                    progress=False,
                )
                print(json.dumps(results[key]), file=sys.stderr)
    return results


def schema_produce(url: str, duration: float) -> dict[str, Any]:
    """The sync API's ``send_async`` loop with a JsonSchema record (a 100-character str and
    an int) against the same loop sending the same JSON as bytes, each for ``duration``
    seconds, in this run: what encoding per message costs."""
    from pigeon.client import Client
    from pigeon.client.schema import Integer, JsonSchema, Record, String

    class Reading(Record):
        sensor = String(required=True)
        value = Integer(required=True)

    schema = JsonSchema(Reading)
    record = Reading(sensor="s" * 100, value=42)
    payload = schema.encode(record)
    out: dict[str, Any] = {}
    with Client(url) as client:
        for name, options, value in (
            ("bytes", {}, payload),
            ("json_schema", {"schema": schema}, record),
        ):
            producer = client.create_producer(
                f"bench-schema-{name}",
                batching_max_messages=2000,
                batching_max_bytes=1 << 20,
                **options,
            )
            sent = 0
            start = time.monotonic()
            while time.monotonic() - start < duration:
                for _ in range(1000):
                    producer.send_async(value)
                sent += 1000
            producer.flush()
            elapsed = time.monotonic() - start
            producer.close()
            out[f"{name}_msg_per_s"] = round(sent / elapsed)
    out["ratio"] = round(out["json_schema_msg_per_s"] / out["bytes_msg_per_s"], 2)
    out["message_bytes"] = len(payload)
    return out


def fill_backlog(url: str, topic: str, n: int, *, deadline: float = float("inf")) -> dict[str, Any]:
    """``n`` 1 KiB messages (fewer if ``deadline``, a time.monotonic(), comes first),
    after a subscription that retains them for the catch-up read."""
    from pigeon.client import Client

    payload = os.urandom(1024)
    start = time.perf_counter()
    sent = 0
    with Client(url, **client_options(url)) as client:
        client.subscribe(topic, "perf-sub", initial_position="earliest").close()
        with client.create_producer(
            topic, batching_max_messages=1000, batching_max_bytes=1 << 20
        ) as p:
            send = p.send_async
            while sent < n and time.monotonic() < deadline:
                chunk = min(1000, n - sent)
                for _ in range(chunk):
                    send(payload)
                sent += chunk
            p.flush()
    secs = time.perf_counter() - start
    return {
        "messages": sent,
        "seconds": round(secs, 2),
        "mb_per_s": round(sent * 1024 / secs / 1e6, 1),
    }


def section_head(begin: str, command: str) -> list[str]:
    """The first lines of a docs/benchmarks.md section: when, where, which command."""
    return [
        begin,
        f"Run on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {machine()}.",
        "",
        f"Command: `{command}`",
        "",
    ]


def render(results: dict[str, Any], command: str) -> str:
    p = results["produce_1k"]
    c = results["consume_backlog"]
    f = results["backlog_fill"]
    lines = [
        *section_head(BEGIN, command),
        "| scenario | result | target |",
        "|---|---|---|",
        f"| produce, 1 producer, 1 KiB messages, batching on, acked (fsync=always), {p['seconds']} s | "
        f"**{p['mb_per_s']} MB/s** ({p['msg_per_s']:,.0f} msg/s); publish latency p50 {p['latency_ms_p50']} ms, "
        f"p99 {p['latency_ms_p99']} ms, p99.9 {p['latency_ms_p999']} ms (at max rate, so latency is queueing) | ≥ 80 MB/s |",
        f"| consumer catch-up on a {c['bytes'] / 2**20:,.0f} MiB backlog, cumulative acks | "
        f"**{c['mb_per_s']} MB/s** ({c['msg_per_s']:,.0f} msg/s) | ≥ 150 MB/s |",
        f"| backlog fill (producer, same settings) | {f['mb_per_s']} MB/s | — |",
        "",
        END,
    ]
    return "\n".join(lines)


def render_small(results: dict[str, Any], command: str) -> str:
    p = results["produce_100b"]
    c = results["consume_100b"]
    lines = [
        *section_head(SMALL_BEGIN, command),
        "| scenario | result | target |",
        "|---|---|---|",
        f"| sync API producer, 100-byte messages, batching on | **{p['msg_per_s']:,.0f} msg/s** ({p['mb_per_s']} MB/s) | ≥ 300,000 msg/s |",
        f"| one consumer on the same data, cumulative acks | **{c['msg_per_s']:,.0f} msg/s** | ≥ 300,000 msg/s |",
    ]
    j = results.get("produce_json_schema")
    if j is not None:
        lines.append(
            f"| sync API producer, JsonSchema record ({j['message_bytes']} B) vs the same "
            f"JSON as bytes, same run | **{j['json_schema_msg_per_s']:,.0f} msg/s** vs "
            f"{j['bytes_msg_per_s']:,.0f} msg/s ({j['ratio']}x) | — |"
        )
    for key, r in results.items():
        if key.startswith("produce_1k_"):
            lines.append(
                f"| 1 KiB messages, codec `{r['compression']}` (MB/s before compression) | "
                f"{r['mb_per_s']} MB/s ({r['msg_per_s']:,.0f} msg/s) | — |"
            )
    lines += ["", SMALL_END]
    return "\n".join(lines)


def write_doc(
    section: str, begin: str = BEGIN, end: str = END, title: str = "Standard scenario"
) -> None:
    DOC.parent.mkdir(exist_ok=True)
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + section + tail
    else:
        text += f"\n## {title}\n\n" + section + "\n"
    DOC.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--duration", type=float, default=30.0, help="produce scenario seconds")
    parser.add_argument("--backlog-mb", type=int, default=1024, help="catch-up backlog size")
    parser.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md")
    parser.add_argument(
        "--scenario",
        choices=["standard", "small", "cluster", "chunked", "arrow", "all"],
        default="all",
        help="standard: 1 KiB produce + 1 GiB catch-up; small: 100 B sync API + codecs; "
        "cluster: 3 bookies beside a standalone; chunked: 50 MB messages in chunks "
        "arrow: 100 B rows through send_arrow / receive_arrow beside the per-message API "
        "(all: every one)",
    )
    parser.add_argument(
        "--chunked-messages", type=int, default=8, help="50 MB messages of the chunked scenario"
    )
    parser.add_argument("--codecs", nargs="*", default=["none", "gzip", "lz4", "zstd"])
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="run the scenario on commit REV and on the working tree, alternating, and"
        " print both and their ratio (see bench/baseline.py; implies --no-docs)",
    )
    parser.add_argument("--rounds", type=int, default=4, help="runs per side with --baseline")
    parser.add_argument("--json", type=Path, help="write the results here, not in bench/results/")
    args = parser.parse_args()
    command = ("python -m bench " + " ".join(sys.argv[1:])).strip()
    written: dict[str, Any] = {}  # every scenario's results, for --json

    def save(name: str, results: dict[str, Any]) -> None:
        """Into bench/results/, or (a child run of --baseline) all into --json's file."""
        if args.json:
            written.update(results)
            args.json.write_text(json.dumps(written, indent=2))
            return
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}.json"
        out.write_text(json.dumps(results, indent=2))
        print(f"results: {out.relative_to(ROOT)}", file=sys.stderr)

    if args.baseline:
        from bench.baseline import compare

        child = ["--scenario", args.scenario, "--duration", str(args.duration)]
        child += ["--backlog-mb", str(args.backlog_mb), "--codecs", *args.codecs]
        cmp = compare(args, child)
        save("baseline", {**cmp, "machine": machine(), "command": command})
        return
    for name in ("cluster", "small", "chunked", "arrow", "standard"):
        if args.scenario not in (name, "all"):
            continue
        run, render_section, markers, title = SCENARIOS[name]
        results = run(args)
        results["machine"] = machine()
        results["command"] = command
        save(name, results)
        section = render_section(results, command)
        print(section)
        if not args.no_docs:
            write_doc(section, *markers, title)


from bench.arrow import arrow_scenario, render_arrow  # noqa: E402
from bench.chunked import chunked_scenario, render_chunked  # noqa: E402

#: scenario -> (run, render, the markers of its docs/benchmarks.md section, its title)
SCENARIOS: dict[str, tuple[Any, Any, tuple[str, str], str]] = {
    "cluster": (cluster_scenario, render_cluster, (CLUSTER_BEGIN, CLUSTER_END), "3-bookie cluster"),
    "small": (
        small_and_codecs,
        render_small,
        (SMALL_BEGIN, SMALL_END),
        "Small messages and codecs",
    ),
    "standard": (standard, render, (BEGIN, END), "Standard scenario"),
    "chunked": (chunked_scenario, render_chunked, (CHUNKED_BEGIN, CHUNKED_END), "Chunked messages"),
    "arrow": (arrow_scenario, render_arrow, (ARROW_BEGIN, ARROW_END), "Arrow batches"),
}


if __name__ == "__main__":
    main()
