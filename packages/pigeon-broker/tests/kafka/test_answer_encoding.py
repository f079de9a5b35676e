"""The hand-written Fetch and Produce response encoders give the bytes kio writes, in
every version served, so Kafka clients read the same answer either way."""

from __future__ import annotations

import importlib

import pytest
from kio.schema.errors import ErrorCode

from pigeon.broker._kafka_wire import (
    FETCH_VERSIONS,
    PRODUCE_VERSIONS,
    ZERO,
    FetchAnswer,
    ProduceAnswer,
    build,
    encode_response,
    part,
)
from pigeon.core.errors import NotSupported

TOPICS = [
    (
        "orders",
        [
            # records as several buffers (a stored batch: 8-byte base offset + the rest)
            (0, 0, 1200, 1200, 7, [b"\0" * 8, memoryview(b"batch-one" * 300), b"tail"]),
            (1, ErrorCode.offset_out_of_range.value, 50, 50, 0, []),
        ],
    ),
    ("ünïcode-topic", [(3, 0, 0, 0, 0, [])]),
]


def kio_response(version: int) -> bytes:
    cls = importlib.import_module(f"kio.schema.fetch.v{version}.response").FetchResponse
    responses = tuple(
        part(
            cls,
            "FetchableTopicResponse",
            topic=topic,
            partitions=tuple(
                part(
                    cls,
                    "PartitionData",
                    partition_index=index,
                    error_code=ErrorCode(error),
                    high_watermark=high,
                    last_stable_offset=stable,
                    log_start_offset=start,
                    aborted_transactions=None,
                    preferred_read_replica=-1,
                    records=b"".join(bytes(b) for b in records),
                )
                for index, error, high, stable, start, records in partitions
            ),
        )
        for topic, partitions in TOPICS
    )
    answer = build(
        cls, throttle_time=ZERO, error_code=ErrorCode.none, session_id=0, responses=responses
    )
    return encode_response(123456, answer)


@pytest.mark.parametrize("version", list(FETCH_VERSIONS))
def test_same_bytes_as_kio(version: int) -> None:
    ours = FetchAnswer(version, TOPICS).buffers(123456)
    assert b"".join(bytes(b) for b in ours) == kio_response(version)
    # the records are sent as they are stored, not copied into a joined buffer
    assert any(isinstance(b, memoryview) for b in ours)


def test_empty_response() -> None:
    for version in FETCH_VERSIONS:
        empty = b"".join(bytes(b) for b in FetchAnswer(version, []).buffers(7))
        cls = importlib.import_module(f"kio.schema.fetch.v{version}.response").FetchResponse
        expected = encode_response(
            7,
            build(cls, throttle_time=ZERO, error_code=ErrorCode.none, session_id=0, responses=()),
        )
        assert empty == expected


def test_unserved_version_is_refused() -> None:
    with pytest.raises(NotSupported):
        FetchAnswer(13, [])


PRODUCED = [
    ("orders", [(0, 0, 1200, None), (1, ErrorCode.not_leader_or_follower.value, -1, "moved")]),
    ("ünïcode-topic", [(3, ErrorCode.invalid_producer_epoch.value, -1, "fenced by epoch 2")]),
]


def kio_produce_response(version: int) -> bytes:
    cls = importlib.import_module(f"kio.schema.produce.v{version}.response").ProduceResponse
    responses = tuple(
        part(
            cls,
            "TopicProduceResponse",
            name=topic,
            partition_responses=tuple(
                part(
                    cls,
                    "PartitionProduceResponse",
                    index=index,
                    error_code=ErrorCode(error),
                    base_offset=offset,
                    log_append_time=None,
                    log_start_offset=-1,
                    record_errors=(),
                    error_message=message,
                )
                for index, error, offset, message in partitions
            ),
        )
        for topic, partitions in PRODUCED
    )
    return encode_response(99, build(cls, responses=responses, throttle_time=ZERO))


@pytest.mark.parametrize("version", list(PRODUCE_VERSIONS))
def test_produce_answer_same_bytes_as_kio(version: int) -> None:
    ours = b"".join(bytes(b) for b in ProduceAnswer(version, PRODUCED).buffers(99))
    assert ours == kio_produce_response(version)
    assert b"".join(bytes(b) for b in ProduceAnswer(version, []).buffers(5)) == encode_response(
        5,
        build(
            importlib.import_module(f"kio.schema.produce.v{version}.response").ProduceResponse,
            responses=(),
            throttle_time=ZERO,
        ),
    )


def test_unserved_produce_version_is_refused() -> None:
    with pytest.raises(NotSupported):
        ProduceAnswer(10, [])
