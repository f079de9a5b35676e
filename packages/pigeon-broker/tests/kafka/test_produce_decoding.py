"""Produce requests are read without copying their records, into the same request kio
reads, in every version served; a malformed one is a typed error."""

from __future__ import annotations

import datetime
import importlib
import io
import struct

import pytest
from kio.serial import entity_reader, entity_writer

from pigeon.broker._kafka_wire import API_VERSIONS, PRODUCE_KEY, decode_request
from pigeon.core.errors import MalformedRequest

VERSIONS = range(API_VERSIONS[PRODUCE_KEY][0], API_VERSIONS[PRODUCE_KEY][1] + 1)


def frame(version: int, transactional_id: str | None = "tx-ï") -> tuple[bytes, object]:
    mod = importlib.import_module(f"kio.schema.produce.v{version}.request")
    req = mod.ProduceRequest(
        transactional_id=transactional_id,
        acks=-1,
        timeout=datetime.timedelta(milliseconds=30000),
        topic_data=(
            mod.TopicProduceData(
                name="orders",
                partition_data=(
                    mod.PartitionProduceData(index=0, records=b"batch-zero" * 50),
                    mod.PartitionProduceData(index=2, records=None),
                ),
            ),
            mod.TopicProduceData(
                name="empty", partition_data=(mod.PartitionProduceData(index=1, records=b""),)
            ),
        ),
    )
    hdr_cls = mod.ProduceRequest.__header_schema__
    header = hdr_cls(
        request_api_key=0, request_api_version=version, correlation_id=42, client_id="c"
    )
    buf = io.BytesIO()
    entity_writer(hdr_cls)(buf, header)
    entity_writer(mod.ProduceRequest)(buf, req)
    return buf.getvalue(), req


@pytest.mark.parametrize("version", list(VERSIONS))
def test_same_request_as_kio(version: int) -> None:
    for tid in ("tx-ï", None):
        data, req = frame(version, tid)
        header, ours = decode_request(bytearray(data))
        assert header.correlation_id == 42
        assert ours == req
        # kio's own reader agrees
        hdr_cls = type(req).__header_schema__
        _, used = entity_reader(hdr_cls)(data, 0)
        theirs, _ = entity_reader(type(req))(data, used)
        assert ours == theirs
        # the records are views of the received frame, not copies
        assert isinstance(ours.topic_data[0].partition_data[0].records, memoryview)


@pytest.mark.parametrize("version", [3, 9])
def test_truncated_request_is_malformed(version: int) -> None:
    data, _ = frame(version)
    for cut in (len(data) - 1, len(data) - 200, 20):
        with pytest.raises(MalformedRequest):
            decode_request(data[:cut])


def test_records_length_past_the_end_is_malformed() -> None:
    data, _ = frame(3)
    # the first partition's records length, made larger than the request
    at = data.index(b"batch-zero") - 4
    bad = data[:at] + struct.pack(">i", 10**6) + data[at + 4 :]
    with pytest.raises(MalformedRequest):
        decode_request(bad)
