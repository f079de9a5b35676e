"""Spark batch read from PigeonMQ beside Spark reading the same rows from Parquet.

    python -m bench.spark                 # 1 GiB of 1 KiB messages
    python -m bench.spark --mib 128       # smaller

Starts a ``pigeon standalone`` and a ``local[N]`` Spark session on loopback, produces
``--mib`` MiB of 1 KiB messages to a partitioned topic (``send_arrow``), writes the same
rows (every column of the ``pigeon`` source) to Parquet, then times full scans of both —
each materialises every column of every row through Spark's ``noop`` sink — and writes
of their ``key`` and ``value`` columns to a new topic (the ``pigeon`` sink) and to new
Parquet files, and prints rows/s for each and their ratios. A benchmark, not a test:
results are data.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.__main__ import Standalone, machine

SIZE = 1024


def produce(url: str, topic: str, n: int, partitions: int) -> float:
    """``n`` keyed messages sent as Arrow tables (``send_arrow``)."""
    import pyarrow as pa

    from pigeon.client import Client

    payload = os.urandom(SIZE * 64)
    rows = 64 * 63
    chunk = pa.table(
        {
            # distinct-ish values, 1000 keys
            "value": pa.array([payload[i * 16 : i * 16 + SIZE] for i in range(rows)]),
            "key": pa.array([b"k%d" % (i % 1000) for i in range(rows)]),
        }
    )
    start = time.perf_counter()
    with Client(url) as client:
        client.create_topic(topic, partitions)
        # A durable subscription that never acknowledges keeps the data whatever the
        # namespace's retention (Spark's readers do not hold data back).
        client.subscribe(topic, "bench-hold", initial_position="earliest").close()
        with client.create_producer(
            topic, batching_max_messages=1000, batching_max_bytes=1 << 20
        ) as producer:
            for first in range(0, n, rows):
                producer.send_arrow(chunk.slice(0, min(rows, n - first)), key="key")
            producer.flush()
    return time.perf_counter() - start


def timed(action: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="data size in MiB (default 1024)")
    parser.add_argument("--partitions", type=int, default=2, help="topic partitions (default 2)")
    parser.add_argument("--cores", type=int, default=2, help="Spark local[N] (default 2)")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs each, best kept")
    args = parser.parse_args()
    command = "python -m bench.spark " + shlex.join(sys.argv[1:])
    n = args.mib * 1024 * 1024 // SIZE

    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    from pigeon.spark import PigeonDataSource

    with (
        tempfile.TemporaryDirectory(prefix="pigeon-bench-spark-") as tmp,
        Standalone(Path(tmp) / "data", fsync="never") as sa,
    ):
        print(f"producing {n} messages of {SIZE} B ({args.mib} MiB)", file=sys.stderr)
        secs = produce(sa.url, "bench-spark", n, args.partitions)
        print(f"produced in {secs:.1f}s ({n / secs:,.0f} msg/s)", file=sys.stderr)

        spark = (
            SparkSession.builder.master(f"local[{args.cores}]")
            .config("spark.ui.enabled", "false")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.memory", "2g")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        spark.dataSource.register(PigeonDataSource)
        pigeon = (
            spark.read.format("pigeon")
            .option("service_url", sa.url)
            .option("topic", "bench-spark")
            .option("minPartitions", str(args.cores))
            .load()
        )
        parquet_dir = str(Path(tmp) / "parquet")
        t0 = time.perf_counter()
        pigeon.write.parquet(parquet_dir)
        print(f"wrote Parquet copy in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        parquet = spark.read.parquet(parquet_dir)
        assert parquet.count() == n, "Parquet copy is incomplete"

        def scan(df: Any) -> None:
            df.write.format("noop").mode("overwrite").save()

        t_parquet = timed(lambda: scan(parquet), args.repeat)
        t_pigeon = timed(lambda: scan(pigeon), args.repeat)

        # writing: the Parquet copy's key and value columns to a new topic (the pigeon
        # sink, send_arrow per task) and to new Parquet files
        rows = parquet.select("key", "value")
        runs = iter(range(1_000_000))

        def write_pigeon() -> None:
            topic = f"bench-spark-out-{next(runs)}"
            sink = rows.write.format("pigeon").mode("append")
            sink.option("service_url", sa.url).option("topic", topic).save()

        def write_parquet() -> None:
            rows.write.parquet(str(Path(tmp) / f"out-{next(runs)}"))

        w_parquet = timed(write_parquet, args.repeat)
        w_pigeon = timed(write_pigeon, args.repeat)
        spark.stop()

    mib = args.mib
    print()
    print(f"command: {command}")
    print(f"machine: {machine()}; Spark local[{args.cores}], topic of {args.partitions} partitions")
    print(f"{'source':<10} {'seconds':>8} {'rows/s':>12} {'MiB/s':>8}")
    for name, t in (("pigeon", t_pigeon), ("parquet", t_parquet)):
        print(f"{name:<10} {t:>8.2f} {n / t:>12,.0f} {mib / t:>8.1f}")
    print(f"pigeon / parquet throughput: {t_parquet / t_pigeon:.2f}")
    print(f"{'write to':<10} {'seconds':>8} {'rows/s':>12} {'MiB/s':>8}")
    for name, t in (("pigeon", w_pigeon), ("parquet", w_parquet)):
        print(f"{name:<10} {t:>8.2f} {n / t:>12,.0f} {mib / t:>8.1f}")
    print(f"pigeon / parquet write throughput: {w_parquet / w_pigeon:.2f}")


if __name__ == "__main__":
    main()
