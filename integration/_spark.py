"""A local Spark session for the integration tests that read PigeonMQ through the
``pigeon`` Spark format (pyspark is imported here only when a session is made: a module
that needs it skips with ``importorskip`` first)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest


@contextmanager
def local_spark(app_name: str) -> Iterator[Any]:
    """A ``local[2]`` SparkSession on loopback, its workers on this interpreter (the venv
    with pigeon-spark), UTC, the ``pigeon`` format registered; stopped on the way out."""
    from pyspark.sql import SparkSession

    from pigeon.spark import PigeonDataSource

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPARK_LOCAL_IP", "127.0.0.1")
        mp.setenv("PYSPARK_PYTHON", sys.executable)
        mp.setenv("PYSPARK_DRIVER_PYTHON", sys.executable)
        session = (
            SparkSession.builder.master("local[2]")
            .appName(app_name)
            .config("spark.ui.enabled", "false")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.sql.session.timeZone", "UTC")
            .getOrCreate()
        )
        session.sparkContext.setLogLevel("ERROR")
        session.dataSource.register(PigeonDataSource)
        try:
            yield session
        finally:
            session.stop()
