"""pigeon-spark: PigeonMQ as a Spark source and sink (format ``"pigeon"``).

    from pyspark.sql import SparkSession
    from pigeon.spark import PigeonDataSource

    spark = SparkSession.builder.getOrCreate()
    spark.dataSource.register(PigeonDataSource)
    df = (spark.read.format("pigeon")
          .option("service_url", "pigeon://127.0.0.1:6650")
          .option("topic", "events")
          .load())

Built on Spark 4's Python Data Source API: batch and micro-batch reads (pure offset-range
reads, so replays are exact), a batch sink (at-least-once) and an exactly-once streaming
sink. See docs/spark.md for the options and columns.
"""

from __future__ import annotations

from pigeon.spark._options import OptionError
from pigeon.spark._sink import PigeonCommitMessage
from pigeon.spark._source import DataLossError, PigeonDataSource, source_schema

__all__ = [
    "DataLossError",
    "OptionError",
    "PigeonCommitMessage",
    "PigeonDataSource",
    "register",
    "source_schema",
]


def register(spark: object) -> None:
    """Register the ``pigeon`` format with a SparkSession (same as
    ``spark.dataSource.register(PigeonDataSource)``)."""
    spark.dataSource.register(PigeonDataSource)  # type: ignore[attr-defined]
