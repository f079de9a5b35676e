"""Option validation: every problem is reported, naming the option."""

from __future__ import annotations

import json

import pytest

from pigeon.spark._options import (
    EARLIEST,
    LATEST,
    OptionError,
    parse_sink_options,
    parse_source_options,
)

URL = "pigeon://127.0.0.1:6650"


def problems(options: dict[str, str], **kw: str) -> str:
    with pytest.raises(OptionError) as info:
        parse_source_options(options, **kw)  # type: ignore[arg-type]
    return str(info.value)


def test_minimal_read() -> None:
    opts = parse_source_options({"service_url": URL, "topic": "events"})
    assert opts.topics == ("persistent://public/default/events",)
    assert opts.fail_on_data_loss and not opts.include_properties
    assert opts.starting is None and opts.ending is None


def test_names_are_case_insensitive_as_spark_lowercases_them() -> None:
    opts = parse_source_options(
        {
            "service_url": URL,
            "topics": "a, b,a",
            "startingoffsets": "earliest",
            "failondataloss": "false",
            "includeproperties": "TRUE",
            "maxoffsetspertrigger": "10",
        }
    )
    assert opts.topics == ("persistent://public/default/a", "persistent://public/default/b")
    assert opts.starting == "earliest" and opts.max_offsets_per_trigger == 10
    assert not opts.fail_on_data_loss and opts.include_properties


def test_unknown_options_are_named() -> None:
    text = problems({"service_url": URL, "topic": "t", "startingOffset": "earliest", "foo": "1"})
    assert "unknown option(s) foo, startingOffset" in text


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"topic": "t"}, "service_url is required"),
        ({"service_url": "http://x", "topic": "t"}, "service_url must look like pigeon://"),
        ({"service_url": URL}, "give exactly one of topic, topics, topicsPattern"),
        ({"service_url": URL, "topic": "a", "topics": "b"}, "(got topic, topics)"),
        (
            {"service_url": URL, "topicsPattern": "ev.*"},
            "topicsPattern must start with persistent://",
        ),
        (
            {"service_url": URL, "topicsPattern": "persistent://a/b/("},
            "not a valid regular expression",
        ),
        ({"service_url": URL, "topic": "a b"}, "topic: invalid topic name"),
        (
            {
                "service_url": URL,
                "topic": "t",
                "startingOffsets": "earliest",
                "startingTimestamp": "5",
            },
            "startingOffsets and startingTimestamp conflict",
        ),
        ({"service_url": URL, "topic": "t", "startingOffsets": "{bad"}, "startingOffsets must be"),
        ({"service_url": URL, "topic": "t", "startingOffsets": '{"t": -3}'}, "offset of t must be"),
        (
            {"service_url": URL, "topic": "t", "endingOffsets": "earliest"},
            "endingOffsets must be 'latest'",
        ),
        (
            {"service_url": URL, "topic": "t", "endingOffsets": '{"t": -2}'},
            "endingOffsets: offset of t",
        ),
        (
            {"service_url": URL, "topic": "t", "minPartitions": "0"},
            "minPartitions must be at least 1",
        ),
        (
            {"service_url": URL, "topic": "t", "maxOffsetsPerTrigger": "x"},
            "maxOffsetsPerTrigger must be an integer",
        ),
        (
            {"service_url": URL, "topic": "t", "failOnDataLoss": "maybe"},
            "failOnDataLoss must be true or false",
        ),
    ],
)
def test_bad_read_options(options: dict[str, str], expected: str) -> None:
    assert expected in problems(options)


def test_mode_specific_options() -> None:
    base = {"service_url": URL, "topic": "t"}
    assert "only apply to batch reads" in problems(
        {**base, "endingOffsets": "latest"}, mode="stream"
    )
    assert "only apply to streaming reads" in problems(
        {**base, "maxOffsetsPerTrigger": "5"}, mode="batch"
    )
    assert "not allowed in a batch read" in problems(
        {**base, "startingOffsets": "latest"}, mode="batch"
    )
    # any mode (load time) accepts both; the reader checks when it is created
    parse_source_options({**base, "endingOffsets": "latest", "maxOffsetsPerTrigger": "5"})


def test_offsets_json_names_are_normalised() -> None:
    opts = parse_source_options(
        {
            "service_url": URL,
            "topic": "t",
            "startingOffsets": json.dumps(
                {"t-partition-0": 5, "persistent://public/default/t-partition-1": -2}
            ),
            "endingOffsets": '{"t-partition-0": -1}',
        }
    )
    assert opts.starting == {
        "persistent://public/default/t-partition-0": 5,
        "persistent://public/default/t-partition-1": EARLIEST,
    }
    assert opts.ending == {"persistent://public/default/t-partition-0": LATEST}


def test_several_problems_at_once() -> None:
    text = problems({"topic": "a", "topics": "b", "minPartitions": "-1"})
    assert (
        "service_url is required" in text and "exactly one of" in text and "minPartitions" in text
    )


def test_sink_options() -> None:
    assert parse_sink_options({"service_url": URL, "checkpointlocation": "/x"}).topic is None
    assert (
        parse_sink_options({"service_url": URL, "topic": "o"}).topic
        == "persistent://public/default/o"
    )
    with pytest.raises(OptionError, match="startingOffsets only apply to reading"):
        parse_sink_options({"service_url": URL, "topic": "o", "startingoffsets": "earliest"})
    with pytest.raises(OptionError, match="unknown option"):
        parse_sink_options({"service_url": URL, "topik": "o"})
