"""Publish->ack of ``pigeon standalone`` against a previous commit's, alternating (ABBA):
``pigeon perf produce -r RATE --batch-delay-ms DELAY`` (1 unless given) against a fresh
standalone of each tree in turn, with the server's CPU per message over the produce run.

    python -m bench.standalone_ab --baseline 609a3e8 --storage journal --fsync never \\
        [--rounds 4] [--seconds 6] [--rate 10000] [--batch-delay-ms 1]

The baseline's packages are unpacked with ``git archive`` (:func:`bench.baseline.unpack`);
the working tree's are this checkout's.  Each run prints one line per side.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.baseline import ROOT, source_path, unpack

CLI = "import sys; from pigeon.core._cli import main; sys.argv[0] = 'pigeon'; main()"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(tree: Path, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIGEON_")}
    env["PYTHONPATH"] = source_path(tree)
    data = Path(tempfile.mkdtemp(dir=tmp))
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", CLI, "standalone", "--data-dir", str(data / "d"),
         "--port", str(port), "--bookie-port", str(_free_port()), "--http-port", "-1",
         "--kafka-port", "-1", "--fsync", args.fsync, "--storage", args.storage],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the standalone did not start") from None
                time.sleep(0.1)
        out = data / "r.json"
        cpu0 = _cpu_s(server.pid)
        subprocess.run(
            [sys.executable, "-c", CLI, "perf", "produce", "-u", f"pigeon://127.0.0.1:{port}",
             "-r", str(args.rate), "--batch-delay-ms", str(args.batch_delay_ms),
             "-d", str(args.seconds), "-q",
             "--json-out", str(out), "ab"],
            env=env, check=True, stdout=subprocess.DEVNULL, timeout=args.seconds + 60,
        )  # fmt: skip
        result: dict[str, Any] = json.loads(out.read_text())
        result["server_cpu_us_per_msg"] = (_cpu_s(server.pid) - cpu0) / result["messages"] * 1e6
        return result
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="commit to compare against")
    parser.add_argument("--storage", default="segment-files")
    parser.add_argument("--fsync", default="always")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rate", type=float, default=10000)
    parser.add_argument("--batch-delay-ms", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        trees = {"baseline": unpack(args.baseline, tmp), "working tree": ROOT}
        for i in range(args.rounds):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for side in order:
                r = one_run(trees[side], args, tmp)
                print(
                    f"{side}: p50 {r['latency_ms_p50']:.2f} ms, p99 {r['latency_ms_p99']:.2f} ms,"
                    f" {r['msg_per_s']:.0f} msg/s, server CPU"
                    f" {r['server_cpu_us_per_msg']:.1f} µs/msg",
                    flush=True,
                )


if __name__ == "__main__":
    main()
