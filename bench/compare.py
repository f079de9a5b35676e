"""PigeonMQ side by side with the peers a user would choose instead (same machine, same run).

    python -m bench.compare                      # the default suite, about 16 minutes
    python -m bench.compare --repeat 1 --duration 3 --latency-duration 3 --backlog-mb 64 --no-docs
    python -m bench.compare --scenarios catchup --systems nats --repeat 1 --no-docs
    python -m bench.compare --systems pigeon-kafka tansu --scenarios produce catchup \
        --repeat 1 --duration 5 --backlog-mb 512 --baseline aeeac33   # before/after

    python -m bench.compare --systems pigeon pigeon-journal pigeon-offloaded --scenarios \
        catchup --backlog-mb 256 --broker-config cache_max_bytes=1048576   # storages

Every server (PigeonMQ standalone, nats-server with JetStream, redis-server, Tansu) is
started here on 127.0.0.1, on a free port, in a temporary directory, and stopped by PID.
RabbitMQ streams are not measured (see ``bench.peers.rabbitmq_status``).

Scenarios, per system and repetition (``--scenarios``), each bounded to 60 s:

* ``produce``: max produce rate, 1 KiB and 100 B messages, one producer (``--duration``).
* ``latency``: end-to-end latency at each of ``--rates`` MB/s (``--latency-duration``, the
  first second is warm-up; the consumer may lag at most 10 s after the producer's end).
  A rate a system cannot sustain is reported with its achieved rate and marked.
* ``multi``: N producers on N topics, one process each, for N in ``--producers`` above 1
  (N = 1 is the ``produce`` row); ``--duration`` after every process is connected.
* ``catchup``: fill a ``--backlog-mb`` MiB backlog of 1 KiB messages (at most 35 s), then
  time one consumer reading all of it (fill + read at most 58 s).

JSON goes to bench/results/compare-*.json, charts to docs/img/, and a table replaces the
section between the bench:peers markers of docs/benchmarks.md. With ``--no-docs`` the
document is left alone and the charts go to a temporary directory (its path is printed)
instead of docs/img/, so that a trial run leaves nothing behind in the work tree.
"""

# ruff: noqa: RUF001, E501 - the report text uses en dashes and multiplication signs
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from bench.__main__ import BROKER_EXTRA, DOC, RESULTS, machine, write_doc
from bench.catchup import catchup
from bench.latency import latency
from bench.peers import (
    PIGEONS,
    PRODUCE,
    SERVERS,
    STORAGE,
    bookie_counters,
    bookie_delta,
    produce_many,
    rabbitmq_status,
)
from bench.report import (
    IMG,
    SECURITY_BEGIN,
    SHORT,
    collect,
    med,
    multi_keys,
    render,
    section,
    unsustained,
)

SCENARIOS = ["produce", "latency", "multi", "catchup"]
DEFAULTS = {
    "repeat": 3,
    "duration": 8.0,
    "latency_duration": 8.0,
    "rates": [1.0, 10.0, 50.0],
    "diag_rates": [10.0],
    "producers": [1, 4, 16],
    "backlog_mb": 1024,
    "time_budget": 1140.0,
}


def log(*a: Any) -> None:
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def run_system(system: str, args: argparse.Namespace, rep: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sc = set(args.scenarios)
    with tempfile.TemporaryDirectory(prefix=f"pigeon-compare-{system}-") as tmp:  # noqa: SIM117
        with SERVERS[system](Path(tmp)) as srv:
            url = srv.url
            steps: list[tuple[str, Any]] = []
            if "produce" in sc:
                steps += [
                    ("produce_1k", lambda: PRODUCE[system](url, f"t1k{rep}", 1024, args.duration)),
                    ("produce_100b", lambda: PRODUCE[system](url, f"t100{rep}", 100, args.duration)),
                ]  # fmt: skip
            if "latency" in sc:
                for mb in args.rates:
                    steps.append(
                        (f"e2e_{mb:g}mb", lambda mb=mb: latency(system, url, f"lat{mb:g}x{rep}", mb, args.latency_duration, linger_ms=args.linger_ms))
                    )  # fmt: skip
                if system in ("pigeon", "pigeon-journal"):
                    # diagnostic: publish->ack latency alone at a fixed rate (no consumer)
                    from pigeon.client._cli import run_perf_produce

                    for mb in args.diag_rates:
                        steps.append(
                            (f"publish_ack_{mb:g}mb", lambda mb=mb: run_perf_produce(
                                url, f"pub{mb:g}x{rep}", size=1024, rate=mb * 1e6 / 1024,
                                duration=args.latency_duration, batch_delay_ms=args.linger_ms, progress=False,
                                sample_every=4))
                        )  # fmt: skip
            if "multi" in sc:
                for n in args.producers:
                    if n > 1:
                        steps.append(
                            (f"produce_1k_{n}p", lambda n=n: produce_many(system, url, f"m{rep}n{n}", 1024, args.duration, n))
                        )  # fmt: skip
            if "catchup" in sc:
                steps.append(
                    ("catchup", lambda: catchup(system, url, f"bk{rep}", args.backlog_mb, server_cpu=lambda: cpu_seconds(server_pid(srv))))
                )  # fmt: skip
            pid = server_pid(srv)
            for key, step in steps:
                t = time.monotonic()
                cpu = cpu_seconds(pid)
                mine = own_cpu_seconds()
                bookie = bookie_counters(url)
                try:
                    out[key] = step()
                except Exception as exc:  # record and continue with the next scenario
                    traceback.print_exc()
                    out[key] = {"error": repr(exc)}
                out[key].update(bookie_delta(bookie, bookie_counters(url)))
                out[key]["wall_seconds"] = round(time.monotonic() - t, 2)
                if cpu is not None:
                    # the server's CPU time (all threads) over the step, fill included
                    used = (cpu_seconds(pid) or cpu) - cpu
                    out[key]["server_cpu_seconds"] = round(used, 2)
                    if out[key].get("messages"):
                        n = out[key]["messages"]
                        out[key]["server_cpu_us_per_msg"] = round(used / n * 1e6, 3)
                if key.startswith("produce_") and key.count("_") == 1 and out[key].get("messages"):
                    # one producer runs in this process (PigeonMQ's client: two threads)
                    used = own_cpu_seconds() - mine
                    out[key]["client_cpu_us_per_msg"] = round(used / out[key]["messages"] * 1e6, 3)
                brief = {k: v for k, v in out[key].items() if k != "cdf_ms"}
                log(system, key, f"{time.monotonic() - t:.1f}s", json.dumps(brief))
    return out


def server_pid(srv: Any) -> int | None:
    proc = getattr(srv, "proc", None) or getattr(getattr(srv, "sa", None), "proc", None)
    return proc.pid if proc is not None else None


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process (every thread) so far."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux), or None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def charts(res: dict[str, Any], img: Path = IMG, prefix: str = "peers-") -> list[Path]:
    try:
        import matplotlib
    except ImportError:  # requirements-bench.txt has it; a bare venv still gets the tables
        log("charts skipped: matplotlib is not installed")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    reps = res["repetitions"]
    systems = res["systems"]
    labels = [SHORT[s] for s in systems]
    colors = {
        "pigeon": "#2a7ab9",
        "pigeon-kafka": "#7a4ab9",
        "nats": "#27aa5e",
        "redis": "#d6452f",
        "tansu": "#999999",
        "pigeon-journal": "#e08a1e",
        "pigeon-offloaded": "#b9772a",
        "pigeon-tls": "#5a9ad9",
        "pigeon-tls-auth": "#8abaf0",
    }

    def spread(key: str, field: str) -> tuple[list[float], list[float], list[float]]:
        meds, lo, hi = [], [], []
        for s in systems:
            v = collect(reps, s, key, field)
            m = med(v) if v else 0.0
            meds.append(m)
            lo.append(m - min(v) if v else 0)
            hi.append(max(v) - m if v else 0)
        return meds, lo, hi

    if any(collect(reps, s, "produce_1k", "mb_per_s") for s in systems):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, (key, field, title) in zip(
            axes,
            [("produce_1k", "mb_per_s", "1 KiB produce, MB/s"), ("produce_100b", "msg_per_s", "100 B produce, msg/s")],
            strict=True,
        ):  # fmt: skip
            meds, lo, hi = spread(key, field)
            ax.bar(labels, meds, yerr=[lo, hi], capsize=4, color=[colors[s] for s in systems])
            ax.set_title(title)
            ax.grid(axis="y", alpha=0.3)
        fig.suptitle(
            "Max produce throughput, 1 producer, acked (median, min–max bars); *Tansu = memory storage"
        )
        fig.tight_layout()
        written.append(img / f"{prefix}throughput.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    rates = [
        mb for mb in res["args"]["rates"]
        if any(collect(reps, s, f"e2e_{mb:g}mb", "latency_ms_p50") for s in systems)
    ]  # fmt: skip
    if rates:
        fig, axes = plt.subplots(1, len(rates) + 1, figsize=(4.6 * (len(rates) + 1), 4))
        width = 0.8 / len(systems)
        for ax, mb in zip(axes, rates, strict=False):
            key = f"e2e_{mb:g}mb"
            for i, s in enumerate(systems):
                vals = [
                    med(collect(reps, s, key, f))
                    for f in ("latency_ms_p50", "latency_ms_p99", "latency_ms_p999")
                ]
                xs = [j + i * width for j in range(3)]
                label = SHORT[s] + (" †" if unsustained(reps, s, key) else "")
                ax.bar(xs, vals, width, label=label, color=colors[s])
            ax.set_xticks(
                [j + width * (len(systems) - 1) / 2 for j in range(3)], ["p50", "p99", "p99.9"]
            )
            ax.set_yscale("log")
            ax.set_ylabel("ms (log)")
            ax.set_title(f"end-to-end latency at {mb:g} MB/s (1 KiB)", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=8)
        ax = axes[-1]
        mb = 10.0 if 10.0 in rates else rates[-1]
        for s in systems:
            cdf = None
            for r in reps:  # last repetition with data
                v = r.get(s, {}).get(f"e2e_{mb:g}mb", {})
                if isinstance(v, dict) and v.get("cdf_ms"):
                    cdf = v["cdf_ms"]
            if cdf:
                ax.plot(cdf, [q / 100 for q in range(len(cdf))], label=SHORT[s], color=colors[s])
        ax.set_xscale("log")
        ax.set_xlabel("ms (log)")
        ax.set_ylabel("fraction of messages")
        ax.set_title(f"latency CDF at {mb:g} MB/s (last repetition)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.suptitle("† = did not sustain the target rate (see the table)", fontsize=9)
        fig.tight_layout()
        written.append(img / f"{prefix}latency.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    counts = [1, *(int(k.split("_")[2][:-1]) for k, _ in multi_keys(res))]
    has_multi = any(collect(reps, s, k, "msg_per_s") for s in systems for k, _ in multi_keys(res))
    has_catchup = any(collect(reps, s, "catchup", "mb_per_s") for s in systems)
    if has_multi or has_catchup:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        ax = axes[0]
        for s in systems:
            xs, ys, lo, hi = [], [], [], []
            for c in counts:
                v = collect(reps, s, "produce_1k" if c == 1 else f"produce_1k_{c}p", "msg_per_s")
                if v:
                    xs.append(c)
                    ys.append(med(v))
                    lo.append(med(v) - min(v))
                    hi.append(max(v) - med(v))
            if xs:
                ax.errorbar(
                    xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=SHORT[s], color=colors[s]
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.set_xlabel("producers (1 topic and 1 process each)")
        ax.set_ylabel("msg/s, all producers")
        ax.set_ylim(bottom=0)
        ax.set_title("1 KiB produce vs number of producers", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax = axes[1]
        meds, lo, hi = spread("catchup", "mb_per_s")
        ax.bar(labels, meds, yerr=[lo, hi], capsize=4, color=[colors[s] for s in systems])
        ax.set_title(
            f"catch-up on a {res['args'].get('backlog_mb', 1024):,} MiB backlog, MB/s", fontsize=10
        )
        ax.grid(axis="y", alpha=0.3)
        fig.suptitle("Median, min–max bars; *Tansu = memory storage", fontsize=9)
        fig.tight_layout()
        written.append(img / f"{prefix}scaling.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def strip_baseline(argv: list[str]) -> list[str]:
    """``argv`` without ``--baseline REV`` and ``--rounds N``."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--baseline", "--rounds"):
            skip = True
        elif not a.startswith(("--baseline=", "--rounds=")):
            out.append(a)
    return out


def figures(res: dict[str, Any]) -> dict[str, float]:
    """The figures of one run (medians over its repetitions): msg/s and the server's CPU
    per message, per system and step."""
    vals: dict[str, list[float]] = {}
    for rep in res["repetitions"]:
        for system, steps in rep.items():
            for key, v in steps.items():
                if not isinstance(v, dict):
                    continue
                for field in (
                    "msg_per_s",
                    "server_cpu_us_per_msg",
                    "client_cpu_us_per_msg",
                    "read_server_cpu_us_per_msg",
                ):
                    if v.get(field) is not None:
                        vals.setdefault(f"{system} {key} {field}", []).append(float(v[field]))
    return {k: statistics.median(v) for k, v in vals.items()}


def baseline_compare(rev: str, rounds: int, child_args: list[str]) -> None:
    """``python -m bench.compare CHILD_ARGS --no-docs`` on ``rev``'s packages and on the
    working tree's, alternating (ABBA), each in a child process whose ``PYTHONPATH`` is
    this harness plus one tree's package sources (the servers it starts inherit it).
    Prints every figure's medians per side and their ratio (working tree / ``rev``):
    on a shared machine, the server's CPU per message moves far less than msg/s."""
    from bench.baseline import ROOT, source_path, unpack

    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "work": []}
    with tempfile.TemporaryDirectory(prefix="pigeon-compare-baseline-") as tmp:
        paths = {"baseline": source_path(unpack(rev, Path(tmp))), "work": source_path(ROOT)}
        for i in range(max(1, rounds)):
            for side in ("baseline", "work") if i % 2 == 0 else ("work", "baseline"):
                out = Path(tmp) / f"{side}-{i}.json"
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), paths[side]]))
                cmd = [
                    sys.executable,
                    "-m",
                    "bench.compare",
                    *child_args,
                    "--no-docs",
                    "--json",
                    str(out),
                ]
                subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
                got = figures(json.loads(out.read_text()))
                log(f"round {i + 1} {side}: {got}")
                runs[side].append(got)
    names = [k for k in runs["baseline"][0] if all(k in r for r in runs["baseline"] + runs["work"])]
    print(
        f"| figure (median of {len(runs['work'])} runs each, alternating) | {rev} | working tree | ratio |"
    )
    print("|---|---|---|---|")
    for name in names:
        base = statistics.median(r[name] for r in runs["baseline"])
        work = statistics.median(r[name] for r in runs["work"])
        fmt = "{:,.0f}" if name.endswith("msg_per_s") and "cpu" not in name else "{:,.2f}"
        print(f"| {name} | {fmt.format(base)} | {fmt.format(work)} | {work / base:.2f} |")


def broker_config(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as a ``[broker]`` table (VALUE as JSON, else a string)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--broker-config: expected KEY=VALUE, got {pair!r}")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


def scratch_dir(name: str) -> Path:
    """Where a --no-docs run puts its charts: outside the work tree."""
    return Path(tempfile.mkdtemp(prefix=f"pigeon-{name}-"))


def main() -> None:
    d = DEFAULTS
    ap = argparse.ArgumentParser(
        prog="python -m bench.compare",
        description="PigeonMQ side by side with NATS JetStream, Redis streams and Tansu. "
        "The defaults take about 16 minutes on 2 cores (at most ~19 with --time-budget).",
    )
    ap.add_argument("--repeat", type=int, default=d["repeat"], help="repetitions (1-10)")
    ap.add_argument(
        "--duration", type=float, default=d["duration"], help="seconds per produce scenario"
    )
    ap.add_argument(
        "--latency-duration", type=float, default=d["latency_duration"],
        help="seconds per end-to-end latency scenario (the first is warm-up)",
    )  # fmt: skip
    ap.add_argument("--rates", type=float, nargs="+", default=d["rates"], help="MB/s")
    ap.add_argument(
        "--linger-ms", type=float, default=0.0,
        help="the latency scenarios' producer batching delay (PigeonMQ batching_max_delay_ms,"
        " Kafka linger.ms); 0 (the default): a batch leaves as soon as the client can send"
        " it, or when the one in flight is answered",
    )  # fmt: skip
    ap.add_argument(
        "--diag-rates", type=float, nargs="*", default=d["diag_rates"],
        help="MB/s of the PigeonMQ-only publish->ack diagnostic (no consumer)",
    )  # fmt: skip
    ap.add_argument(
        "--producers", type=int, nargs="+", default=d["producers"],
        help="producer counts (1 = the 1 KiB produce row; more run in separate processes)",
    )  # fmt: skip
    ap.add_argument("--backlog-mb", type=int, default=d["backlog_mb"], help="catch-up backlog, MiB")
    ap.add_argument(
        "--scenarios", nargs="+", default=SCENARIOS, choices=SCENARIOS, help="what to run"
    )
    ap.add_argument(
        "--systems", nargs="+", choices=list(SERVERS),
        default=[s for s in SERVERS if s not in STORAGE],
        help="default: all but the storage variants (nox -s bench_storage runs those)",
    )  # fmt: skip
    ap.add_argument("--no-multi", dest="multi", action="store_false", help="skip N producers")
    ap.add_argument(
        "--no-docs", action="store_true",
        help="leave docs/ alone: charts go to a temporary directory instead of docs/img/",
    )  # fmt: skip
    ap.add_argument(
        "--time-budget", type=float, default=d["time_budget"],
        help="seconds: start no repetition that would end after this (estimated from the "
        "longest one so far)",
    )  # fmt: skip
    ap.add_argument(
        "--render", metavar="JSON", help="only re-render docs/charts from a result file"
    )
    ap.add_argument(
        "--baseline", metavar="REV",
        help="run the same command on commit REV's packages and on the working tree's, "
        "alternating --rounds times each, and print the medians of both and their ratio "
        "(see baseline_compare; implies --no-docs)",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3, help="runs per side with --baseline")
    ap.add_argument(
        "--broker-config", metavar="KEY=VALUE", nargs="+", default=[],
        help="[broker] keys for every PigeonMQ standalone of the run (VALUE read as JSON, "
        "else as a string), e.g. cache_max_bytes=1048576 for a catch-up from storage",
    )  # fmt: skip
    ap.add_argument("--json", metavar="PATH", help=argparse.SUPPRESS)  # a --baseline child's
    args = ap.parse_args()
    BROKER_EXTRA.update(broker_config(args.broker_config))
    if args.baseline:
        baseline_compare(args.baseline, args.rounds, strip_baseline(sys.argv[1:]))
        return
    if args.render:
        res = json.loads(Path(args.render).read_text())
        res["render_command"] = "python -m bench.compare " + " ".join(sys.argv[1:])
        if args.no_docs:
            written = (
                []
                if section(res["systems"])[0] == SECURITY_BEGIN
                else charts(res, scratch_dir(Path(args.render).stem), section(res["systems"])[3])
            )
            print("charts: " + ", ".join(str(w) for w in written), file=sys.stderr)
        else:
            begin, end, title, prefix = section(res["systems"])
            if begin != SECURITY_BEGIN:
                charts(res, IMG, prefix)
            write_doc(render(res, res["command"]), begin, end, title=title)
        print(render(res, res["command"]))
        return
    if not args.multi and "multi" in args.scenarios:
        args.scenarios.remove("multi")
    if not any(s in PIGEONS for s in args.systems):
        args.systems.insert(0, "pigeon")
    command = "python -m bench.compare " + " ".join(sys.argv[1:])
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = Path(args.json) if args.json else RESULTS / f"compare-{stamp}.json"
    res: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "command": command,
        "args": {k: v for k, v in vars(args).items() if k != "render"},
        "systems": args.systems,
        "rabbitmq": rabbitmq_status(),
        "repetitions": [],
    }
    log(res["rabbitmq"])
    t0 = time.monotonic()
    longest = 0.0
    for rep in range(max(1, min(args.repeat, 10))):
        elapsed = time.monotonic() - t0
        if rep and elapsed + longest > args.time_budget:
            log(
                f"time budget: {elapsed:.0f} s spent, a repetition takes up to {longest:.0f} s, "
                f"budget {args.time_budget:.0f} s; stopping after {rep} repetitions"
            )
            break
        t_rep = time.monotonic()
        r: dict[str, Any] = {}
        for s in args.systems:
            try:
                r[s] = run_system(s, args, rep)
            except Exception as exc:
                traceback.print_exc()
                r[s] = {"error": repr(exc)}
        longest = max(longest, time.monotonic() - t_rep)
        res["repetitions"].append(r)
        res["seconds"] = round(time.monotonic() - t0, 1)
        path.write_text(json.dumps(res, indent=1))
        log("repetition", rep + 1, f"took {time.monotonic() - t_rep:.0f} s; written to", path)
    begin, end, title, prefix = section(args.systems)
    if begin == SECURITY_BEGIN:  # a table only
        written = []
        if not args.no_docs:
            write_doc(render(res, command), begin, end, title=title)
    elif args.no_docs:
        written = charts(res, scratch_dir(path.stem), prefix)
    else:
        written = charts(res, IMG, prefix)
        write_doc(render(res, command), begin, end, title=title)
    print(render(res, command))
    print(f"results: {path}", file=sys.stderr)
    print("charts: " + ", ".join(str(w) for w in written), file=sys.stderr)
    _ = DOC


if __name__ == "__main__":
    main()
