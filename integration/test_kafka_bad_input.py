"""Bad input on the Kafka port of a real ``pigeon standalone`` hurts only its own connection.

Garbage, an HTTP request, a native PigeonMQ client, a huge size prefix, a truncated
request, an unsupported API or version, a Produce whose RecordBatch fails its CRC, and a
seeded fuzz loop of mutated valid requests.  Each one is refused (the connection closed
with one WARNING line, or answered with the Kafka error code), the server log never shows
a traceback, and a confluent-kafka producer and consumer connected since the module
started keep producing and consuming throughout.

Requests are built with ``kio``'s own writers (the types of the front door).  Every wait
is bounded.
"""

from __future__ import annotations

import dataclasses
import datetime
import gzip
import io
import os
import random
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _kafka import standalone, topic_name

from pigeon.core.kafka_records import encode_record_batch
from pigeon.core.testing.servers import Standalone

confluent_kafka = pytest.importorskip("confluent_kafka")
pytest.importorskip("kio")
from confluent_kafka import Consumer, Producer, TopicPartition  # noqa: E402
from kio.index import load_response_from_request  # noqa: E402
from kio.schema.errors import ErrorCode  # noqa: E402
from kio.schema.request_header.v1.header import RequestHeader as HeaderV1  # noqa: E402
from kio.schema.request_header.v2.header import RequestHeader as HeaderV2  # noqa: E402
from kio.serial import entity_reader, entity_writer  # noqa: E402

pytestmark = pytest.mark.integration

DEADLINE_S = 30.0
WITNESS = "witness"
#: the fuzz loop's seed and length (a failure names the iteration: rerun the same seed)
FUZZ_SEED = int(os.environ.get("PIGEON_KAFKA_FUZZ_SEED", "14"))
FUZZ_ROUNDS = int(os.environ.get("PIGEON_KAFKA_FUZZ_ROUNDS", "600"))


# ------------------------------------------------------------------ server and witness


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    with standalone(tmp_path_factory.mktemp("kafka-bad"), fsync="never") as sa:
        yield sa


class Witness:
    """A confluent-kafka producer and consumer, connected for the whole module."""

    def __init__(self, bootstrap: str) -> None:
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 1})
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": "witness",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
            }
        )
        self.sent = 0
        self.check("first")
        self.consumer.assign([TopicPartition(WITNESS, 0, 0)])
        self.received = 0
        self.receive()

    def check(self, what: str) -> None:
        """Produce one message through the long-lived producer (delivery confirmed)."""
        errors: list[Any] = []
        self.producer.produce(
            WITNESS,
            value=f"{self.sent}:{what}".encode(),
            on_delivery=lambda err, _m: errors.append(err),
        )
        assert self.producer.flush(DEADLINE_S) == 0, f"witness produce stuck after {what}"
        assert errors == [None], f"witness produce failed after {what}: {errors}"
        self.sent += 1

    def receive(self) -> None:
        """The long-lived consumer gets every message produced so far, in order."""
        deadline = time.monotonic() + DEADLINE_S
        while self.received < self.sent and time.monotonic() < deadline:
            msg = self.consumer.poll(0.2)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            assert msg.offset() == self.received
            assert msg.value().startswith(f"{self.received}:".encode())
            self.received += 1
        assert self.received == self.sent, f"witness consumer got {self.received}/{self.sent}"

    def still_working(self, what: str) -> None:
        self.check(what)
        self.receive()

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()


@pytest.fixture(scope="module")
def witness(server: Standalone) -> Iterator[Witness]:
    w = Witness(server.kafka_bootstrap)
    try:
        yield w
    finally:
        w.close()


class LogWatch:
    """The server log lines written since it was made."""

    def __init__(self, server: Standalone) -> None:
        self.server = server
        self.start = len(server.log_text())

    def new(self) -> str:
        return self.server.log_text()[self.start :]

    def wait_for(self, text: str) -> list[str]:
        """Wait (bounded) until a new line holds ``text``; the new lines."""
        deadline = time.monotonic() + DEADLINE_S
        while text not in self.new():
            assert time.monotonic() < deadline, f"{text!r} never logged; new:\n{self.new()}"
            time.sleep(0.05)
        return self.new().splitlines()


def assert_one_warning(lines: list[str], text: str) -> None:
    kafka = [
        line for line in lines if "logger=pigeon.broker._kafka" in line and "level=INFO" not in line
    ]
    assert len(kafka) == 1, kafka
    assert "level=WARNING" in kafka[0] and text in kafka[0], kafka[0]


def assert_no_traceback(server: Standalone) -> None:
    log = server.log_text()
    assert "Traceback" not in log and "level=ERROR" not in log, log[-4000:]
    assert server.running, f"server died; log:\n{server.log_tail()}"


# ------------------------------------------------------------------ raw Kafka requests


def request_bytes(request: Any, correlation_id: int, client_id: str | None = "bad-input") -> bytes:
    header_cls = HeaderV2 if type(request).__flexible__ else HeaderV1
    header = header_cls(
        request_api_key=type(request).__api_key__,
        request_api_version=type(request).__version__,
        correlation_id=correlation_id,
        client_id=client_id,
    )
    buf = io.BytesIO()
    entity_writer(header_cls)(buf, header)
    entity_writer(type(request))(buf, request)
    body = buf.getvalue()
    return struct.pack(">i", len(body)) + body


def connect(server: Standalone) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.kafka_port), timeout=DEADLINE_S)
    sock.settimeout(DEADLINE_S)
    return sock


def read_frame(sock: socket.socket) -> bytes | None:
    """One response frame (after its size), None when the server closed the connection."""
    head = recv_exactly(sock, 4)
    if head is None:
        return None
    (size,) = struct.unpack(">i", head)
    return recv_exactly(sock, size)


def recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    out = bytearray()
    while len(out) < n:
        try:
            chunk = sock.recv(n - len(out))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def read_response(sock: socket.socket, request: Any) -> tuple[int, Any]:
    frame = read_frame(sock)
    assert frame is not None, "the server closed the connection instead of answering"
    cls = load_response_from_request(type(request))
    (correlation_id,) = struct.unpack_from(">i", frame, 0)
    pos = 4
    if cls.__flexible__ and cls.__api_key__ != 18:
        pos += 1  # response header v1: empty tagged fields
    response, _ = entity_reader(cls)(frame, pos)
    return correlation_id, response


def assert_closed(sock: socket.socket) -> None:
    assert read_frame(sock) is None, "the server answered instead of closing"


def api_versions() -> Any:
    from kio.schema.api_versions.v3.request import ApiVersionsRequest

    return ApiVersionsRequest(client_software_name="bad-input", client_software_version="1")


def metadata(topic: str) -> Any:
    from kio.schema.metadata.v12.request import MetadataRequest, MetadataRequestTopic

    return MetadataRequest(
        topics=(MetadataRequestTopic(topic_id=None, name=topic),),
        allow_auto_topic_creation=True,
        include_topic_authorized_operations=False,
    )


def record_batch(n: int = 3) -> bytes:
    return b"".join(
        bytes(b)
        for b in encode_record_batch(
            [f"v{i}".encode() for i in range(n)],
            [b"k"] * n,
            [1_700_000_000_000 + i for i in range(n)],
        )
    )


def produce(topic: str, batch: bytes, partition: int = 0) -> Any:
    from kio.schema.produce.v9.request import (
        PartitionProduceData,
        ProduceRequest,
        TopicProduceData,
    )

    return ProduceRequest(
        transactional_id=None,
        acks=-1,
        timeout=datetime.timedelta(seconds=10),
        topic_data=(
            TopicProduceData(
                name=topic,
                partition_data=(PartitionProduceData(index=partition, records=batch),),
            ),
        ),
    )


def fetch(topic: str) -> Any:
    from kio.schema.fetch.v12.request import FetchPartition, FetchRequest, FetchTopic

    return FetchRequest(
        max_wait=datetime.timedelta(0),
        min_bytes=1,
        topics=(
            FetchTopic(
                topic=topic,
                partitions=(
                    FetchPartition(partition=0, fetch_offset=0, partition_max_bytes=65536),
                ),
            ),
        ),
        forgotten_topics_data=(),
    )


def list_offsets(topic: str) -> Any:
    from kio.schema.list_offsets.v7.request import (
        ListOffsetsPartition,
        ListOffsetsRequest,
        ListOffsetsTopic,
    )

    return ListOffsetsRequest(
        replica_id=-1,
        isolation_level=0,
        topics=(
            ListOffsetsTopic(
                name=topic,
                partitions=(ListOffsetsPartition(partition_index=0, timestamp=-1),),
            ),
        ),
    )


def find_coordinator() -> Any:
    from kio.schema.find_coordinator.v3.request import FindCoordinatorRequest

    return FindCoordinatorRequest(key="fuzz-group", key_type=0)


def offset_fetch(topic: str) -> Any:
    from kio.schema.offset_fetch.v7.request import OffsetFetchRequest, OffsetFetchRequestTopic

    return OffsetFetchRequest(
        group_id="fuzz-group",
        topics=(OffsetFetchRequestTopic(name=topic, partition_indexes=(0,)),),
        require_stable=False,
    )


def group_requests(topic: str) -> list[Any]:
    """One request of each group API (a consumer's life: join, sync, beat, commit, leave)."""
    from kio.schema.describe_groups.v5.request import DescribeGroupsRequest
    from kio.schema.heartbeat.v4.request import HeartbeatRequest
    from kio.schema.join_group.v5.request import JoinGroupRequest, JoinGroupRequestProtocol
    from kio.schema.leave_group.v4.request import LeaveGroupRequest, MemberIdentity
    from kio.schema.list_groups.v4.request import ListGroupsRequest
    from kio.schema.offset_commit.v8.request import (
        OffsetCommitRequest,
        OffsetCommitRequestPartition,
        OffsetCommitRequestTopic,
    )
    from kio.schema.sync_group.v5.request import SyncGroupRequest, SyncGroupRequestAssignment

    group, member = "fuzz-group", "fuzz-member"
    return [
        JoinGroupRequest(
            group_id=group,
            session_timeout=datetime.timedelta(seconds=6),
            rebalance_timeout=datetime.timedelta(seconds=1),
            member_id="",
            protocol_type="consumer",
            protocols=(JoinGroupRequestProtocol(name="range", metadata=b"\x00\x01"),),
        ),
        SyncGroupRequest(
            group_id=group,
            generation_id=1,
            member_id=member,
            protocol_type="consumer",
            protocol_name="range",
            assignments=(SyncGroupRequestAssignment(member_id=member, assignment=b"\x00"),),
        ),
        HeartbeatRequest(group_id=group, generation_id=1, member_id=member),
        OffsetCommitRequest(
            group_id=group,
            generation_id_or_member_epoch=-1,
            member_id="",
            topics=(
                OffsetCommitRequestTopic(
                    name=topic,
                    partitions=(
                        OffsetCommitRequestPartition(
                            partition_index=0, committed_offset=2, committed_metadata=None
                        ),
                    ),
                ),
            ),
        ),
        LeaveGroupRequest(group_id=group, members=(MemberIdentity(member_id=member),)),
        DescribeGroupsRequest(groups=(group,), include_authorized_operations=False),
        ListGroupsRequest(),
    ]


def topic_requests(topic: str) -> list[Any]:
    from kio.schema.create_partitions.v3.request import (
        CreatePartitionsRequest,
        CreatePartitionsTopic,
    )
    from kio.schema.create_topics.v5.request import CreatableTopic, CreateTopicsRequest
    from kio.schema.describe_configs.v4.request import (
        DescribeConfigsRequest,
        DescribeConfigsResource,
    )
    from kio.schema.init_producer_id.v4.request import InitProducerIdRequest

    return [
        CreateTopicsRequest(
            topics=(
                CreatableTopic(
                    name=f"{topic}-new",
                    num_partitions=1,
                    replication_factor=1,
                    assignments=(),
                    configs=(),
                ),
            )
        ),
        CreatePartitionsRequest(
            topics=(CreatePartitionsTopic(name=topic, count=2, assignments=None),),
            timeout=datetime.timedelta(seconds=5),
            validate_only=True,
        ),
        DescribeConfigsRequest(
            resources=(DescribeConfigsResource(resource_type=2, resource_name=topic),)
        ),
        InitProducerIdRequest(
            transactional_id=None, transaction_timeout=datetime.timedelta(seconds=60)
        ),
    ]


# ------------------------------------------------------------------ one bad input each


def test_garbage_bytes_close_only_that_connection(server: Standalone, witness: Witness) -> None:
    watch = LogWatch(server)
    with connect(server) as sock:
        sock.sendall(b"\x00\x00\x00\x10" + b"x" * 16)
        assert_closed(sock)
    assert_one_warning(watch.wait_for("not served"), "Kafka API 30840 version 30840")
    witness.still_working("garbage")
    assert_no_traceback(server)


def test_http_request_gets_a_400_that_names_the_kafka_port(
    server: Standalone, witness: Witness
) -> None:
    watch = LogWatch(server)
    with connect(server) as sock:
        sock.sendall(b"GET /admin/v2/clusters HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert b"This port speaks the Kafka protocol" in answer
    assert_one_warning(watch.wait_for("an HTTP client"), "not the Kafka protocol")
    witness.still_working("http")
    assert_no_traceback(server)


def test_native_client_on_the_kafka_port_fails_fast_with_a_clear_error(
    server: Standalone, witness: Witness
) -> None:
    from pigeon.client import Client
    from pigeon.core.errors import PigeonError

    watch = LogWatch(server)
    started = time.monotonic()
    with (
        pytest.raises(PigeonError) as refused,
        Client(f"pigeon://127.0.0.1:{server.kafka_port}", operation_timeout=DEADLINE_S) as c,
    ):
        c.list_topics()
    assert time.monotonic() - started < DEADLINE_S / 2, "the native client waited for a timeout"
    message = str(refused.value)
    assert "This port speaks the Kafka protocol" in message and "\n" not in message
    assert "broker port" in message
    assert_one_warning(watch.wait_for("a PigeonMQ client"), "not the Kafka protocol")
    witness.still_working("native client")
    assert_no_traceback(server)


def test_huge_size_prefix_closes_without_buffering(server: Standalone, witness: Witness) -> None:
    watch = LogWatch(server)
    with connect(server) as sock:
        sock.sendall(struct.pack(">i", 2**31 - 1) + b"\x00\x03\x00\x0c")
        assert_closed(sock)
    assert_one_warning(watch.wait_for("2147483647 bytes"), "not the Kafka protocol")
    witness.still_working("huge size")
    assert_no_traceback(server)


def test_truncated_request_then_hangup_logs_one_line(server: Standalone, witness: Witness) -> None:
    watch = LogWatch(server)
    frame = request_bytes(metadata(WITNESS), 5)
    with connect(server) as sock:
        sock.sendall(frame[: len(frame) // 2])
    assert_one_warning(watch.wait_for("into a request"), "closed the connection")
    witness.still_working("truncated")
    assert_no_traceback(server)


def test_request_that_does_not_parse_closes_its_connection(
    server: Standalone, witness: Witness
) -> None:
    watch = LogWatch(server)
    body = request_bytes(metadata(WITNESS), 6)[4:]
    cut = body[: len(body) - 6]  # the size says this is all: the topic array runs past it
    with connect(server) as sock:
        sock.sendall(struct.pack(">i", len(cut)) + cut)
        assert_closed(sock)
    assert_one_warning(watch.wait_for("malformed Kafka request"), "API 3 v12")
    witness.still_working("malformed")
    assert_no_traceback(server)


@pytest.mark.parametrize(
    ("head", "logged"),
    [
        (struct.pack(">hhih", 99, 0, 7, -1), "Kafka API 99 version 0 is not served"),
        (struct.pack(">hhih", 3, 50, 7, -1), "Kafka API 3 version 50 is not served"),
        (struct.pack(">hhih", 0, 2, 7, -1), "Kafka API 0 version 2 is not served"),
    ],
    ids=["unknown-api", "metadata-v50", "produce-v2"],
)
def test_unsupported_api_or_version_closes_the_connection(
    server: Standalone, witness: Witness, head: bytes, logged: str
) -> None:
    watch = LogWatch(server)
    with connect(server) as sock:
        sock.sendall(struct.pack(">i", len(head)) + head)
        assert_closed(sock)
    assert_one_warning(watch.wait_for(logged), "kafka request refused")
    witness.still_working(logged)
    assert_no_traceback(server)


def test_api_versions_of_an_unknown_version_is_answered_with_unsupported_version(
    server: Standalone, witness: Witness
) -> None:
    from kio.schema.api_versions.v0.request import ApiVersionsRequest

    with connect(server) as sock:
        head = struct.pack(">hhih", 18, 99, 41, -1)
        sock.sendall(struct.pack(">i", len(head)) + head)
        correlation_id, answer = read_response(sock, ApiVersionsRequest())
        assert correlation_id == 41
        assert answer.error_code == ErrorCode.unsupported_version
        assert {k.api_key: k.max_version for k in answer.api_keys}[0] == 9
        # the connection stays usable: the client retries with a version we serve
        sock.sendall(request_bytes(api_versions(), 42))
        correlation_id, answer = read_response(sock, api_versions())
        assert (correlation_id, answer.error_code) == (42, ErrorCode.none)
    witness.still_working("api versions v99")
    assert_no_traceback(server)


def test_produce_with_a_bad_crc_is_answered_corrupt_message_and_stores_nothing(
    server: Standalone, witness: Witness
) -> None:
    topic = topic_name("crc")
    good = record_batch()
    bad = bytearray(good)
    bad[-1] ^= 0x01  # a bit of the last record: the CRC-32C no longer matches
    watch = LogWatch(server)
    with connect(server) as sock:
        sock.sendall(request_bytes(metadata(topic), 1))
        read_response(sock, metadata(topic))
        # a good batch then a corrupt one for the same partition: neither is stored
        sock.sendall(request_bytes(produce(topic, good + bytes(bad)), 2))
        correlation_id, answer = read_response(sock, produce(topic, b""))
        assert correlation_id == 2
        (part,) = answer.responses[0].partition_responses
        assert part.error_code == ErrorCode.corrupt_message
        assert part.base_offset == -1
        # same connection, a good batch: stored at offset 0 (the refused ones took nothing)
        sock.sendall(request_bytes(produce(topic, good), 3))
        _, answer = read_response(sock, produce(topic, b""))
        (part,) = answer.responses[0].partition_responses
        assert (part.error_code, part.base_offset) == (ErrorCode.none, 0)
    assert_one_warning(watch.wait_for("CRC-32C"), "kafka produce refused")
    witness.still_working("bad crc")
    assert_no_traceback(server)


def batch_with_garbage_records() -> bytes:
    """A gzip RecordBatch whose CRC is right but whose records do not parse."""
    from pigeon.core._kafka_records import BATCH_HEADER_SIZE, crc32c

    good = record_batch(5)
    records = gzip.compress(b"\x01\x02 not records " * 10)
    head = bytearray(good[:BATCH_HEADER_SIZE])
    struct.pack_into(">h", head, 21, 1)  # attributes: gzip
    struct.pack_into(">i", head, 8, len(records) + BATCH_HEADER_SIZE - 12)
    struct.pack_into(">I", head, 17, crc32c(records, crc32c(memoryview(head)[21:])))
    return bytes(head) + records


def test_produce_of_a_batch_whose_records_do_not_parse_is_refused(
    server: Standalone, witness: Witness
) -> None:
    topic = topic_name("poison")
    with connect(server) as sock:
        sock.sendall(request_bytes(metadata(topic), 1))
        read_response(sock, metadata(topic))
        sock.sendall(request_bytes(produce(topic, batch_with_garbage_records()), 2))
        _, answer = read_response(sock, produce(topic, b""))
    (part,) = answer.responses[0].partition_responses
    assert part.error_code == ErrorCode.corrupt_message


def test_clients_that_reset_while_answers_are_written_leave_no_traceback(
    server: Standalone, witness: Witness
) -> None:
    requests = b"".join(request_bytes(metadata(WITNESS), i) for i in range(200))
    for _ in range(20):
        with connect(server) as sock:
            sock.sendall(requests)
            sock.recv(100)  # the answers are being written
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # closed with a reset: the server's next write or read fails
    witness.still_working("resets")
    assert_no_traceback(server)


def test_a_produce_refused_for_many_partitions_logs_one_line(
    server: Standalone, witness: Witness
) -> None:
    from kio.schema.produce.v9.request import ProduceRequest, TopicProduceData

    one = produce("", record_batch()).topic_data[0]
    request = ProduceRequest(
        transactional_id=None,
        acks=-1,
        timeout=datetime.timedelta(seconds=10),
        topic_data=(TopicProduceData(name="", partition_data=one.partition_data),) * 50,
    )
    watch = LogWatch(server)
    with connect(server) as sock:
        sock.sendall(request_bytes(request, 1))
        _, answer = read_response(sock, request)
    codes = {p.error_code for t in answer.responses for p in t.partition_responses}
    assert codes == {ErrorCode.invalid_topic_exception}
    assert_one_warning(watch.wait_for("more partitions"), "(and 49 more partitions)")
    witness.still_working("many refusals")
    assert_no_traceback(server)


def test_partition_counts_beyond_the_limit_are_refused(
    server: Standalone, witness: Witness
) -> None:
    from kio.schema.create_partitions.v3.request import (
        CreatePartitionsRequest,
        CreatePartitionsTopic,
    )
    from kio.schema.create_topics.v5.request import CreatableTopic, CreateTopicsRequest

    topic = topic_name("many")
    create = CreateTopicsRequest(
        topics=(
            CreatableTopic(
                name=topic,
                num_partitions=2**31 - 1,
                replication_factor=1,
                assignments=(),
                configs=(),
            ),
        )
    )
    grow = CreatePartitionsRequest(
        topics=(CreatePartitionsTopic(name=WITNESS, count=2**31 - 1, assignments=None),),
        timeout=datetime.timedelta(seconds=5),
        validate_only=False,
    )
    with connect(server) as sock:
        sock.sendall(request_bytes(create, 1))
        _, answer = read_response(sock, create)
        assert answer.topics[0].error_code != ErrorCode.none
        sock.sendall(request_bytes(grow, 2))
        _, answer = read_response(sock, grow)
        assert answer.results[0].error_code == ErrorCode.invalid_partitions
        sock.sendall(request_bytes(metadata(WITNESS), 3))
        _, answer = read_response(sock, metadata(WITNESS))
        assert len(answer.topics[0].partitions) == 1
    witness.still_working("partition counts")
    assert_no_traceback(server)


# ------------------------------------------------------------------ fuzz


def mutate(rng: random.Random, frame: bytes) -> bytes:
    """A mutation of a valid request frame: bit flips, a cut, bytes inserted or removed,
    an int32 field set to an extreme; the size prefix recomputed (mostly)."""
    body = bytearray(frame[4:])
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(5)
        pos = rng.randrange(len(body)) if body else 0
        if kind == 0 and body:
            body[pos] ^= 1 << rng.randrange(8)
        elif kind == 1:
            del body[pos:]
        elif kind == 2:
            body[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif kind == 3:
            del body[pos : pos + rng.randint(1, 8)]
        elif len(body) >= pos + 4:
            extreme = rng.choice([0, -1, 2**31 - 1, -(2**31), 1 << 24, 0x7F])
            body[pos : pos + 4] = struct.pack(">i", extreme)
    size = len(body) if rng.random() < 0.9 else rng.choice([len(body) + 3, 0, -5])
    return struct.pack(">i", size) + bytes(body)


_INTS = [0, -1, 1, 2, 127, -128, 32767, -32768, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63)]
_TEXTS = ["", ".", "..", "a/b", "x" * 300, "ключ", " ", "fuzz-group"]


def mutate_entity(rng: random.Random, entity: Any, rate: float = 0.3) -> Any:
    """``entity`` (a kio request) with hostile field values: extreme integers and
    durations, odd names, random bytes, arrays emptied or repeated.  Values a field's
    type cannot hold make the writer fail: the caller skips that example."""
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(entity):
        value = getattr(entity, f.name)
        if isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            items = [mutate_entity(rng, v, rate) for v in value]
            if rng.random() < rate / 2:
                items = rng.choice([[], items * rng.randint(2, 50)])
            changes[f.name] = tuple(items)
        elif dataclasses.is_dataclass(value):
            changes[f.name] = mutate_entity(rng, value, rate)
        elif rng.random() >= rate:
            continue
        elif isinstance(value, bool):
            changes[f.name] = not value
        elif isinstance(value, int):
            changes[f.name] = type(value)(rng.choice(_INTS))
        elif isinstance(value, datetime.timedelta):
            changes[f.name] = datetime.timedelta(milliseconds=rng.choice(_INTS[:10]))
        elif isinstance(value, str):
            changes[f.name] = rng.choice(_TEXTS)
        elif isinstance(value, bytes):
            changes[f.name] = rng.randbytes(rng.randint(0, 80))
    return dataclasses.replace(entity, **changes)


def test_fuzzed_field_values_are_answered_or_refused_without_a_traceback(
    server: Standalone, witness: Witness
) -> None:
    topic = topic_name("fields")
    requests = [
        api_versions(),
        metadata(topic),
        produce(topic, record_batch(5)),
        fetch(topic),
        list_offsets(topic),
        find_coordinator(),
        offset_fetch(topic),
        *group_requests(topic),
        *topic_requests(topic),
    ]
    with connect(server) as sock:
        for i, r in enumerate(requests):
            sock.sendall(request_bytes(r, i + 1))
            read_response(sock, r)
    rng = random.Random(FUZZ_SEED)
    sent = answered = 0
    for round_ in range(FUZZ_ROUNDS):
        base = rng.choice(requests)
        try:
            frame = request_bytes(mutate_entity(rng, base), round_ + 1)
        except Exception:  # a value its field's type cannot hold: kio refuses to write it
            continue
        sent += 1
        with socket.create_connection(("127.0.0.1", server.kafka_port), timeout=5) as sock:
            sock.settimeout(2.0)
            try:
                sock.sendall(frame)
                if read_frame(sock) is not None:
                    answered += 1
            except TimeoutError:
                pass  # a long poll or a join waiting for its group: the client's choice
            except (ConnectionResetError, BrokenPipeError):
                pass
        assert server.running, f"server died at round {round_}; log:\n{server.log_tail()}"
        if round_ % 100 == 99:
            witness.still_working(f"field fuzz round {round_}")
    assert sent > FUZZ_ROUNDS // 2 and answered > sent // 2, (sent, answered)
    witness.still_working("field fuzz")
    assert_no_traceback(server)


def test_fuzzed_requests_never_crash_or_traceback_and_real_clients_keep_working(
    server: Standalone, witness: Witness
) -> None:
    topic = topic_name("fuzz")
    corpus = [
        request_bytes(api_versions(), 1),
        request_bytes(metadata(topic), 2),
        request_bytes(produce(topic, record_batch(5)), 3),
        request_bytes(fetch(topic), 4),
        request_bytes(list_offsets(topic), 5),
        request_bytes(find_coordinator(), 6),
        request_bytes(offset_fetch(topic), 7),
        *(request_bytes(r, 10 + i) for i, r in enumerate(group_requests(topic))),
        *(request_bytes(r, 20 + i) for i, r in enumerate(topic_requests(topic))),
    ]
    with connect(server) as sock:  # every request is valid and answered before mutation
        for i, frame in enumerate(corpus):
            sock.sendall(frame)
            assert read_frame(sock) is not None, f"valid request {i} not answered"
    rng = random.Random(FUZZ_SEED)
    probe = request_bytes(api_versions(), 2_000_000)
    outcomes = {"answered": 0, "closed": 0, "silent": 0}
    for round_ in range(FUZZ_ROUNDS):
        frame = mutate(rng, rng.choice(corpus))
        with socket.create_connection(("127.0.0.1", server.kafka_port), timeout=5) as sock:
            sock.settimeout(1.0)
            try:
                sock.sendall(frame + probe)
                outcome = "closed"
                while (answer := read_frame(sock)) is not None:
                    if answer[:4] == struct.pack(">i", 2_000_000):
                        outcome = "answered"
                        break
            except TimeoutError:
                outcome = "silent"  # waiting for the rest of a frame, or a long poll
            except (ConnectionResetError, BrokenPipeError):
                outcome = "closed"
        outcomes[outcome] += 1
        assert server.running, f"server died at fuzz round {round_}; log:\n{server.log_tail()}"
        if round_ % 50 == 49:
            witness.still_working(f"fuzz round {round_}")
    assert outcomes["answered"] > 0 and outcomes["closed"] > 0, outcomes
    witness.still_working("fuzz")
    assert_no_traceback(server)


def idempotent_batch(producer_id: int, epoch: int, sequence: int) -> bytes:
    return b"".join(
        bytes(b)
        for b in encode_record_batch(
            [b"a", b"b"],
            [None, None],
            [1_700_000_000_000] * 2,
            producer_id=producer_id,
            producer_epoch=epoch,
            base_sequence=sequence,
        )
    )


def produce_answer(sock: socket.socket, topic: str, batch: bytes, correlation_id: int) -> Any:
    sock.sendall(request_bytes(produce(topic, batch), correlation_id))
    _, answer = read_response(sock, produce(topic, b""))
    (part,) = answer.responses[0].partition_responses
    return ErrorCode(part.error_code), int(part.base_offset)


def test_an_idempotent_producer_on_a_new_connection_takes_over_its_sequence(
    server: Standalone, witness: Witness
) -> None:
    """A client whose connection vanished without the server noticing (no FIN, no RST)
    goes on with the same producer id on a new one: it is the same producer, so it takes
    over (not ProducerBusy until the old connection times out), and a resent batch is
    still answered with its original offset."""
    topic = topic_name("takeover")
    pid = 987_654_321
    with connect(server) as old, connect(server) as new:
        old.sendall(request_bytes(metadata(topic), 1))
        read_response(old, metadata(topic))
        assert produce_answer(old, topic, idempotent_batch(pid, 0, 0), 2) == (ErrorCode.none, 0)
        # the resend of a stored batch, on the new connection: its original offset
        assert produce_answer(new, topic, idempotent_batch(pid, 0, 0), 3) == (ErrorCode.none, 0)
        assert produce_answer(new, topic, idempotent_batch(pid, 0, 2), 4) == (ErrorCode.none, 2)
    witness.still_working("takeover")


def test_sequence_gaps_and_fenced_epochs_are_refused_as_kafka_refuses_them(
    server: Standalone, witness: Witness
) -> None:
    """An idempotent batch that skips sequence numbers is OUT_OF_ORDER_SEQUENCE_NUMBER
    (the client resends in order); once an epoch is seen, batches of an older one are
    INVALID_PRODUCER_EPOCH; InitProducerId with the producer's id and epoch bumps the
    epoch (KIP-360), and refuses an older one."""
    from kio.schema.init_producer_id.v4.request import InitProducerIdRequest

    topic = topic_name("fence")
    pid = 123_456_789
    with connect(server) as sock:
        sock.sendall(request_bytes(metadata(topic), 1))
        read_response(sock, metadata(topic))
        assert produce_answer(sock, topic, idempotent_batch(pid, 0, 0), 2) == (ErrorCode.none, 0)
        gap = produce_answer(sock, topic, idempotent_batch(pid, 0, 5), 3)
        assert gap == (ErrorCode.out_of_order_sequence_number, -1)
        assert produce_answer(sock, topic, idempotent_batch(pid, 0, 2), 4) == (ErrorCode.none, 2)

        def init(epoch: int, correlation_id: int) -> Any:
            request = InitProducerIdRequest(
                transactional_id=None,
                transaction_timeout=datetime.timedelta(seconds=60),
                producer_id=pid,
                producer_epoch=epoch,
            )
            sock.sendall(request_bytes(request, correlation_id))
            return read_response(sock, request)[1]

        bumped = init(0, 5)
        assert (bumped.error_code, bumped.producer_id, bumped.producer_epoch) == (0, pid, 1)
        # the new epoch starts its sequence at 0; the old epoch is fenced from then on
        assert produce_answer(sock, topic, idempotent_batch(pid, 1, 0), 6) == (ErrorCode.none, 4)
        fenced = produce_answer(sock, topic, idempotent_batch(pid, 0, 4), 7)
        assert fenced == (ErrorCode.invalid_producer_epoch, -1)
        assert init(0, 8).error_code == ErrorCode.invalid_producer_epoch
    witness.still_working("fencing")
