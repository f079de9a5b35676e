"""Option validation: every problem is reported, naming the option."""

from __future__ import annotations

import json
import re

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


def test_unknown_options_are_named_with_a_suggestion_in_their_case() -> None:
    text = problems({"service_url": URL, "topic": "t", "startingOffset": "earliest", "foo": "1"})
    assert "unknown option foo;" in text
    assert "unknown option startingOffset (did you mean startingOffsets?)" in text
    # as Spark hands them over (lower-cased): the suggestion is in the documented case
    text = problems({"service_url": URL, "topic": "t", "subscribepatern": "x"})
    assert "unknown option subscribepatern (did you mean subscribePattern?)" in text
    # nothing close: the known names are listed
    assert "(known: " in problems({"service_url": URL, "topic": "t", "zzz": "1"})


def test_kafka_source_names_are_aliases() -> None:
    opts = parse_source_options({"serviceUrl": URL, "subscribe": "a,b", "includeHeaders": "true"})
    assert opts.service_url == URL and opts.include_properties
    assert opts.topics == ("persistent://public/default/a", "persistent://public/default/b")
    # Spark lower-cases the names; service.url too
    opts = parse_source_options({"service.url": URL, "subscribe": "a", "includeheaders": "1"})
    assert opts.topics == ("persistent://public/default/a",) and opts.include_properties
    # a bare subscribePattern is over public/default (Kafka has no namespaces)
    opts = parse_source_options({"service_url": URL, "subscribePattern": "ev-.*|x"})
    assert opts.pattern == "persistent://public/default/(?:ev-.*|x)"
    assert opts.pattern_namespace == "public/default"
    full = parse_source_options({"service_url": URL, "subscribepattern": "persistent://t/n/a.*"})
    assert full.pattern == "persistent://t/n/a.*"
    assert "service_url and serviceUrl are the same option" in problems(
        {"service_url": URL, "serviceUrl": URL, "topic": "t"}
    )
    assert "(got topics, subscribePattern)" in problems(
        {"service_url": URL, "subscribe": "a", "subscribePattern": "b.*"}
    )


def test_kafka_bootstrap_servers_says_what_to_use() -> None:
    text = problems({"kafka.bootstrap.servers": "localhost:9092", "subscribe": "t"})
    assert "kafka.bootstrap.servers is the Kafka source's: give service_url (or serviceUrl)" in text
    assert "known:" not in text
    text = problems({"service_url": URL, "topic": "t", "kafka.group.id": "g"})
    assert "kafka.group.id configures a Kafka consumer" in text


def test_kafka_source_read_options() -> None:
    opts = parse_source_options(
        {
            "service_url": URL,
            "topic": "t",
            "startingOffsetsByTimestamp": json.dumps(
                {"t": {"0": 1000, "1": 2000}, "u-partition-3": 5, "v": {"-1": 7}}
            ),
            "endingTimestamp": "3000",
            "minOffsetsPerTrigger": "100",
            "maxTriggerDelay": "30s",
            "maxRecordsPerPartition": "500",
        }
    )
    p = "persistent://public/default/"
    assert opts.starting_by_timestamp == {
        f"{p}t-partition-0": 1000,
        f"{p}t-partition-1": 2000,
        f"{p}u-partition-3": 5,
        f"{p}v": 7,
    }
    assert opts.ending_timestamp == 3000 and opts.min_offsets_per_trigger == 100
    assert opts.max_trigger_delay_ms == 30_000 and opts.max_records_per_partition == 500
    assert parse_source_options({"service_url": URL, "topic": "t"}).max_trigger_delay_ms == 900_000
    assert (
        parse_source_options(
            {"service_url": URL, "topic": "t", "maxTriggerDelay": "250"}
        ).max_trigger_delay_ms
        == 250
    )


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"maxTriggerDelay": "soon"}, "maxTriggerDelay must be a time such as 15m"),
        ({"startingOffsetsByTimestamp": "[1]"}, "startingOffsetsByTimestamp must be a JSON"),
        ({"startingOffsetsByTimestamp": '{"t": {"x": 1}}'}, "partition of t must be a number"),
        ({"startingOffsetsByTimestamp": '{"t": {"0": -5}}'}, "must be ms since the epoch"),
        (
            {"startingTimestamp": "1", "startingOffsetsByTimestamp": '{"t": 1}'},
            "startingTimestamp and startingOffsetsByTimestamp conflict",
        ),
        (
            {"endingOffsets": "latest", "endingTimestamp": "5"},
            "endingOffsets and endingTimestamp conflict",
        ),
        (
            {"minOffsetsPerTrigger": "10", "maxOffsetsPerTrigger": "5"},
            "minOffsetsPerTrigger (10) is above maxOffsetsPerTrigger (5)",
        ),
        ({"maxRecordsPerPartition": "0"}, "maxRecordsPerPartition must be at least 1"),
        ({"allowAutoTopicCreation": "perhaps"}, "allowAutoTopicCreation must be true or false"),
    ],
)
def test_bad_kafka_source_options(options: dict[str, str], expected: str) -> None:
    assert expected in problems({"service_url": URL, "topic": "t", **options})


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
    assert "endingOffsets only applies to batch reads" in problems(
        {**base, "endingOffsets": "latest"}, mode="stream"
    )
    assert "maxOffsetsPerTrigger only applies to streaming reads" in problems(
        {**base, "maxOffsetsPerTrigger": "5"}, mode="batch"
    )
    assert "not allowed in a batch read" in problems(
        {**base, "startingOffsets": "latest"}, mode="batch"
    )
    text = problems({**base, "minOffsetsPerTrigger": "5", "maxTriggerDelay": "1m"}, mode="batch")
    assert "minOffsetsPerTrigger, maxTriggerDelay only apply to streaming reads" in text
    assert "endingOffsets, endingTimestamp only apply to batch reads" in problems(
        {**base, "endingOffsets": "latest", "endingTimestamp": "5"}, mode="stream"
    )
    # streams check for missing topics too (pigeon.spark._source._require_topics)
    parse_source_options({**base, "allowAutoTopicCreation": "true"}, mode="stream")
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
    with pytest.raises(OptionError, match="startingOffsets only applies to reading"):
        parse_sink_options({"service_url": URL, "topic": "o", "startingoffsets": "earliest"})
    with pytest.raises(OptionError, match="unknown option"):
        parse_sink_options({"service_url": URL, "topik": "o"})


def test_a_kafka_pattern_anchored_with_caret_matches_its_topics() -> None:
    """``subscribePattern=^orders-.*`` (as Kafka users write it) matched no topic: the ``^``
    ended up inside ``persistent://public/default/(?:^orders-.*)``."""
    opts = parse_source_options({"service_url": URL, "subscribePattern": "^orders-.*"})
    assert opts.pattern is not None
    regex = re.compile(opts.pattern)
    assert regex.fullmatch("persistent://public/default/orders-eu")
    assert not regex.fullmatch("persistent://public/default/xorders-eu")
