"""The hand-written Fetch response encoder gives the bytes kio writes, in every version
served, so Kafka clients read the same answer either way."""

from __future__ import annotations

import importlib

import pytest
from kio.schema.errors import ErrorCode

from pigeon.broker._kafka_wire import (
    FETCH_VERSIONS,
    ZERO,
    FetchAnswer,
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
