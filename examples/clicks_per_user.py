"""Structured Streaming job: clicks per user per window, to PigeonMQ and to Parquet.

    spark-submit examples/clicks_per_user.py --service-url pigeon://127.0.0.1:6650

Reads JSON click events from the ``clicks`` topic, counts clicks (and distinct pages)
per user per one-minute event-time window, and writes every finished window

* to the ``clicks-per-user`` topic (key = user, value = JSON, event time = window end),
  exactly once, and
* to Parquet files under ``--output-dir``.

A window is finished once the watermark (latest event time seen minus ``--lateness``)
passes its end. Stop with Ctrl-C; start again with the same ``--checkpoint-dir`` and the
job continues where it stopped, without losing or repeating a window.
"""

from __future__ import annotations

import argparse
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from pigeon.spark import PigeonDataSource

CLICK = "user string, page string, ts long"


def clicks_per_user(
    spark: SparkSession,
    service_url: str,
    topic: str,
    *,
    window: str,
    lateness: str,
    max_per_trigger: int,
) -> DataFrame:
    """Finished windows: ``window_start, window_end, user, clicks, pages``."""
    raw = (
        spark.readStream.format("pigeon")
        .option("service_url", service_url)
        .option("topic", topic)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", str(max_per_trigger))
        .load()
    )
    clicks = raw.select(
        F.from_json(F.col("value").cast("string"), CLICK).alias("c"), "event_time"
    ).select("c.user", "c.page", F.coalesce("event_time", F.timestamp_millis("c.ts")).alias("time"))
    return (
        clicks.withWatermark("time", lateness)
        .groupBy(F.window("time", window), "user")
        .agg(F.count("*").alias("clicks"), F.approx_count_distinct("page").alias("pages"))
        .select(
            F.col("window.start").alias("window_start"),
            F.col("window.end").alias("window_end"),
            "user",
            "clicks",
            "pages",
        )
    )


def start(
    spark: SparkSession, args: argparse.Namespace, *, available_now: bool = False
) -> list[Any]:
    """Start both queries (to the topic, to Parquet); returns them."""
    windows = clicks_per_user(
        spark,
        args.service_url,
        args.input,
        window=args.window,
        lateness=args.lateness,
        max_per_trigger=args.max_per_trigger,
    )
    to_topic = windows.select(
        F.col("user").alias("key"),
        F.to_json(F.struct("window_start", "window_end", "user", "clicks", "pages")).alias("value"),
        F.col("window_end").alias("event_time"),
    )

    def trigger(writer: Any) -> Any:
        return (
            writer.trigger(availableNow=True)
            if available_now
            else writer.trigger(processingTime=args.trigger)
        )

    topic_query = trigger(
        to_topic.writeStream.format("pigeon")
        .queryName("clicks-per-user-to-topic")
        .outputMode("append")
        .option("service_url", args.service_url)
        .option("topic", args.output)
        # rows come out of a shuffle: number them in a fixed order (see docs/spark.md)
        .option("writeOrder", "sorted")
        .option("checkpointLocation", f"{args.checkpoint_dir}/topic")
    ).start()
    parquet_query = trigger(
        windows.writeStream.format("parquet")
        .queryName("clicks-per-user-to-parquet")
        .outputMode("append")
        .option("path", args.output_dir)
        .option("checkpointLocation", f"{args.checkpoint_dir}/parquet")
    ).start()
    return [topic_query, parquet_query]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--service-url", default="pigeon://127.0.0.1:6650")
    parser.add_argument("--input", default="clicks")
    parser.add_argument("--output", default="clicks-per-user")
    parser.add_argument("--output-dir", default="clicks-per-user-parquet")
    parser.add_argument("--checkpoint-dir", default="clicks-per-user-checkpoint")
    parser.add_argument("--window", default="1 minute")
    parser.add_argument("--lateness", default="10 seconds")
    parser.add_argument("--trigger", default="5 seconds")
    parser.add_argument("--max-per-trigger", type=int, default=100_000)
    parser.add_argument(
        "--available-now",
        action="store_true",
        help="process what is in the topic now, then stop",
    )
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    spark = SparkSession.builder.appName("clicks-per-user").getOrCreate()
    spark.dataSource.register(PigeonDataSource)
    queries = start(spark, args, available_now=args.available_now)
    try:
        for q in queries:
            q.awaitTermination()
    except KeyboardInterrupt:
        for q in queries:
            q.stop()


if __name__ == "__main__":
    main()
