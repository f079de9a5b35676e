"""The public names of pigeon.spark: nothing private leaks, nothing public is missing."""

from __future__ import annotations

import pytest

pytest.importorskip("pyspark")

import pigeon.spark


def test_all_is_exactly_the_public_names() -> None:
    public = {n for n in vars(pigeon.spark) if not n.startswith("_") and n != "annotations"}
    assert set(pigeon.spark.__all__) == public
    for name in pigeon.spark.__all__:
        assert getattr(pigeon.spark, name).__module__.startswith("pigeon.spark")


def test_format_name() -> None:
    assert pigeon.spark.PigeonDataSource.name() == "pigeon"
