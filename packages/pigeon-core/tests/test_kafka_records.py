"""Kafka RecordBatch v2 in and out of stored entries, cross-checked against kafka-python's
independent implementation (``kafka.record.default_records``)."""

from __future__ import annotations

import random
import struct
import warnings
import zlib
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import cramjam
import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pigeon.core.batch import decode_batch, encode_batch, pack_entry_header, read_header
from pigeon.core.codecs import GZIP, NONE, Codec, CodecSet
from pigeon.core.errors import (
    CorruptFrame,
    CorruptRecordBatch,
    MessageTooLarge,
    PigeonError,
    UnsupportedRecordFormat,
)
from pigeon.core.kafka_records import (
    FORMAT_KAFKA,
    compress_records,
    count_records,
    encode_record_batch,
    kafka_batch_of_entry,
    kafka_batch_of_kept,
    read_batch_info,
    split_record_batches,
    wrap_record_batch,
)

with warnings.catch_warnings():  # kafka-python imports importlib.resources.read_text
    warnings.simplefilter("ignore", DeprecationWarning)
    import kafka.codec
    from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

CODECS = CodecSet([NONE, GZIP])
COMPRESSIONS = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
T0 = 1_700_000_000_000


@pytest.fixture(autouse=True)
def _kafka_python_snappy(monkeypatch: pytest.MonkeyPatch) -> None:
    """kafka-python needs python-snappy for snappy; give it raw snappy blocks from
    cramjam (the xerial framing around them stays kafka-python's own code)."""
    shim = SimpleNamespace(
        compress=lambda data: bytes(cramjam.snappy.compress_raw(data)),
        decompress=lambda data: bytes(cramjam.snappy.decompress_raw(data)),
    )
    monkeypatch.setattr(kafka.codec, "snappy", shim)


Record = tuple[bytes | None, bytes | None, int, list[tuple[str, bytes | None]]]


def sample_records(n: int = 20) -> list[Record]:
    """Keys (some null), values (some null, compressible), timestamps, headers."""
    out: list[Record] = []
    for i in range(n):
        key = None if i % 3 == 0 else f"key-{i}".encode()
        value = None if i % 7 == 5 else (b"value-%d-" % i) * 20
        headers: list[tuple[str, bytes | None]] = []
        if i % 2:
            headers = [("trace", b"abc%d" % i), ("n\u00e9", None), ("raw", b"\xff\x00\xfe")]
        out.append((key, value, T0 + 3 * i - (i % 4), headers))
    return out


def kafka_python_batch(records: list[Record], compression: int, **kw: Any) -> bytes:
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=compression,
        is_transactional=kw.get("is_transactional", False),
        producer_id=kw.get("producer_id", -1),
        producer_epoch=kw.get("producer_epoch", -1),
        base_sequence=kw.get("base_sequence", -1),
        batch_size=1 << 24,
    )
    for i, (key, value, ts, headers) in enumerate(records):
        assert builder.append(i, timestamp=ts, key=key, value=value, headers=headers)
    return bytes(builder.build())


def stored(batch: bytes, first_offset: int = 1000, publish_time: int = T0 + 5000) -> bytes:
    info = read_batch_info(batch)
    native = b"".join(
        wrap_record_batch(
            memoryview(batch), info, producer_name="kafka-p", sequence_id=7, publish_time=1
        )
    )
    return pack_entry_header(info.record_count, first_offset, publish_time) + native


def with_crc(batch: bytes | bytearray) -> bytes:
    """``batch`` with its CRC-32C recomputed (to reach the checks behind the CRC)."""
    out = bytearray(batch)
    struct.pack_into(">I", out, 17, crc32c.crc32c(bytes(out[21:])))
    return bytes(out)


def batch_of_records(records_section: bytes, count: int, attributes: int = 0) -> bytes:
    head = struct.pack(
        ">qiibIhiqqqhii",
        0,
        49 + len(records_section),
        0,
        2,
        0,
        attributes,
        count - 1,
        T0,
        T0,
        -1,
        -1,
        -1,
        count,
    )
    return with_crc(head + records_section)


# -- Kafka producer batches read by native consumers --------------------------------------


@pytest.mark.parametrize("codec", list(COMPRESSIONS))
def test_kafka_python_batches_decode_to_the_same_messages(codec: str) -> None:
    records = sample_records()
    batch = kafka_python_batch(records, COMPRESSIONS[codec])
    info = read_batch_info(batch)
    assert info.compression == COMPRESSIONS[codec]  # kafka-python really compressed it
    assert (info.record_count, info.last_offset_delta, info.size) == (20, 19, len(batch))
    assert info.first_timestamp == T0 and info.max_timestamp == max(r[2] for r in records)
    assert not info.is_transactional and not info.is_control and info.timestamp_type == 0

    entry = stored(batch)
    header = read_header(entry[32:])
    assert header.format_version == FORMAT_KAFKA and header.num_messages == 20
    assert (header.producer_name, header.sequence_id, header.publish_time) == ("kafka-p", 7, 1)
    assert header.codec == 0 and header.body_length == header.uncompressed_size == len(batch)
    assert bytes(entry[32 + header.body_offset :]) == batch  # stored as it came
    decoded = decode_batch(memoryview(entry)[32:], CODECS)
    assert len(decoded) == 20
    assert decoded.values() == [v or b"" for _, v, _, _ in records]
    assert decoded.keys() == [k for k, _, _, _ in records]
    assert [decoded.event_time(i) for i in range(20)] == [r[2] for r in records]
    props = decoded.all_properties()
    for i, (_, _, _, headers) in enumerate(records):
        expected = {k: (v or b"").decode("utf-8", "surrogateescape") for k, v in headers}
        assert props[i] == expected
        assert decoded.properties(i) == expected
    # the raw header bytes are in the property values column
    assert props[1]["raw"].encode("utf-8", "surrogateescape") == b"\xff\x00\xfe"
    assert decoded.header.property_entries == 30


def test_raw_snappy_of_librdkafka_decodes() -> None:
    records = sample_records(5)
    plain = kafka_python_batch(records, 0)
    raw = bytes(cramjam.snappy.compress_raw(plain[61:]))
    batch = bytearray(plain[:61] + raw)
    struct.pack_into(">ih", batch, 8, len(batch) - 12, 0)
    struct.pack_into(">h", batch, 21, 2)
    decoded = decode_batch(memoryview(stored(with_crc(batch)))[32:], CODECS)
    assert decoded.values() == [v or b"" for _, v, _, _ in records]


def test_batch_without_keys_headers_or_timestamps() -> None:
    batch = b"".join(encode_record_batch([b"a", b"", b"ccc"], [None] * 3, [-1, -1, -1]))
    decoded = decode_batch(memoryview(stored(batch))[32:], CODECS)
    assert decoded.values() == [b"a", b"", b"ccc"]
    assert not decoded.has_keys and not decoded.has_properties and not decoded.has_event_times
    assert decoded.keys() == [None, None, None]
    assert decoded.event_time(2) == 0


# -- native entries read by Kafka consumers ----------------------------------------------


def native_batch(
    values: list[bytes],
    keys: Sequence[str | bytes | None],
    props: Sequence[Mapping[str, str] | None],
    times: list[int],
    codec: Codec,
) -> bytes:
    """A native (format 1) batch of these messages, from producer ``p``."""
    return encode_batch(
        values,
        keys=keys,
        properties=props,
        event_times=times,
        producer_name="p",
        sequence_id=0,
        publish_time=T0,
        codec=codec,
    )


def kafka_python_read(buffers: list[bytes | memoryview]) -> tuple[DefaultRecordBatch, list[Any]]:
    batch = DefaultRecordBatch(b"".join(buffers))
    assert batch.validate_crc()
    return batch, list(batch)


@pytest.mark.parametrize("codec", [NONE, GZIP])
def test_native_entry_converts_to_a_record_batch_kafka_python_reads(codec: Any) -> None:
    values = [b"v%d" % i * (i + 1) for i in range(10)]
    keys = [None if i % 4 == 0 else (f"k{i}" if i % 2 else b"\xffk%d" % i) for i in range(10)]
    times = [0 if i % 3 == 0 else T0 + 10 * i for i in range(10)]
    props = [{"a": "1", "\u00e9t\u00e9": "\u00e7a"} if i % 2 else None for i in range(10)]
    native = native_batch(values, keys, props, times, codec)
    entry = pack_entry_header(10, 4242, T0 + 999) + native
    batch, recs = kafka_python_read(kafka_batch_of_entry(entry, CODECS))
    assert batch.base_offset == 4242 and batch.records_count == 10
    assert batch.producer_id == -1 and batch.timestamp_type == 0
    assert [r.offset for r in recs] == list(range(4242, 4252))
    assert [r.value for r in recs] == values
    assert [r.key for r in recs] == [k.encode() if isinstance(k, str) else k for k in keys]
    assert [r.timestamp for r in recs] == [t or T0 + 999 for t in times]
    assert [dict(r.headers) for r in recs] == [
        {k: v.encode() for k, v in (p or {}).items()} for p in props
    ]


def test_large_native_entry_converts() -> None:
    """Offsets and lengths past the one-byte and two-byte varint tables."""
    n, size = 10000, 20000
    values = [bytes([i % 251]) * (size if i == 7 else i % 300) for i in range(n)]
    native = encode_batch(values, producer_name="p", sequence_id=0, publish_time=T0, codec=NONE)
    entry = pack_entry_header(n, 0, T0) + native
    _, recs = kafka_python_read(kafka_batch_of_entry(entry, CODECS))
    assert [r.value for r in recs] == values and recs[-1].offset == n - 1


def test_kafka_entry_fetch_patches_only_the_base_offset() -> None:
    batch = kafka_python_batch(sample_records(), 1)
    entry = stored(batch, first_offset=123456789)
    out = kafka_batch_of_entry(entry, CODECS)
    assert isinstance(out[1], memoryview)  # the rest is not copied
    joined = b"".join(out)
    assert joined[8:] == batch[8:] and struct.unpack(">q", joined[:8])[0] == 123456789
    kbatch, recs = kafka_python_read(out)
    assert kbatch.base_offset == 123456789 and recs[3].offset == 123456792


# -- compacted entries: only the kept records, their own offsets -----------------------

KEPT = [1, 4, 8, 13]


def last_offset_delta(buffers: list[bytes | memoryview]) -> int:
    return int(struct.unpack_from(">i", b"".join(buffers), 23)[0])


@pytest.mark.parametrize("codec", ["none", "gzip", "zstd"])
def test_kept_records_of_a_kafka_entry_keep_their_offsets(codec: str) -> None:
    records = sample_records(20)
    entry = stored(kafka_python_batch(records, COMPRESSIONS[codec]), first_offset=500)
    out = kafka_batch_of_kept(entry, KEPT, CODECS)
    batch, recs = kafka_python_read(out)
    assert batch.base_offset == 500 and batch.records_count == len(KEPT)
    assert batch.compression_type == 0
    assert [r.offset for r in recs] == [500 + i for i in KEPT]  # gaps between them
    assert last_offset_delta(out) == 19  # a consumer goes on at 520
    assert [(r.key, r.value, r.timestamp) for r in recs] == [
        (records[i][0], records[i][1] or b"", records[i][2]) for i in KEPT
    ]
    assert [list(r.headers) for r in recs] == [records[i][3] for i in KEPT]


def test_kept_records_of_a_native_entry_and_all_kept() -> None:
    values = [b"v%d" % i for i in range(16)]
    keys = [f"k{i % 5}" for i in range(16)]
    props = [{"p": str(i)} if i % 2 else None for i in range(16)]
    native = native_batch(values, keys, props, [T0 + i for i in range(16)], NONE)
    entry = pack_entry_header(16, 70, T0) + native
    out = kafka_batch_of_kept(entry, KEPT, CODECS)
    _, recs = kafka_python_read(out)
    assert [(r.offset, r.key, r.value) for r in recs] == [
        (70 + i, keys[i].encode(), values[i]) for i in KEPT
    ]
    assert [dict(r.headers) for r in recs] == [
        {k: v.encode() for k, v in (props[i] or {}).items()} for i in KEPT
    ]
    assert last_offset_delta(out) == 15
    every = list(range(16))
    assert b"".join(kafka_batch_of_kept(entry, every, CODECS)) == b"".join(
        kafka_batch_of_entry(entry, CODECS)
    )
    for bad in ([], [3, 3], [16], [-1]):
        with pytest.raises(ValueError):
            kafka_batch_of_kept(entry, bad, CODECS)


@pytest.mark.parametrize("codec", list(COMPRESSIONS))
def test_encoded_batches_read_back_in_kafka_python(codec: str) -> None:
    records = sample_records(30)
    out = encode_record_batch(
        [v or b"" for _, v, _, _ in records],
        [k for k, _, _, _ in records],
        [t for _, _, t, _ in records],
        [[(k.encode(), v) for k, v in h] for _, _, _, h in records],
        base_offset=77,
        compression=COMPRESSIONS[codec],
    )
    batch, recs = kafka_python_read(out)
    assert batch.compression_type == COMPRESSIONS[codec]
    assert [(r.key, r.value, r.timestamp, r.headers) for r in recs] == [
        (k, v or b"", t, h) for k, v, t, h in records
    ]
    assert read_batch_info(b"".join(out)).base_offset == 77


# -- producer request checks -------------------------------------------------------------


def test_split_record_batches() -> None:
    a = kafka_python_batch(sample_records(3), 0)
    b = kafka_python_batch(sample_records(4), 4)
    parts = split_record_batches(memoryview(a + b))
    assert [bytes(p) for p in parts] == [a, b]
    with pytest.raises(CorruptRecordBatch, match="overruns"):
        split_record_batches(a + b[:-1])
    with pytest.raises(CorruptRecordBatch, match="truncated"):
        split_record_batches(a + b[:10])
    with pytest.raises(CorruptRecordBatch):
        split_record_batches(b"")
    old = bytearray(a)
    old[16] = 1
    with pytest.raises(UnsupportedRecordFormat, match="v1"):
        split_record_batches(a + old)


def test_read_batch_info_refuses_bad_batches() -> None:
    batch = kafka_python_batch(sample_records(5), 0)
    flipped = bytearray(batch)
    flipped[70] ^= 1
    with pytest.raises(CorruptRecordBatch, match="CRC"):
        read_batch_info(flipped)
    assert read_batch_info(flipped, verify_crc=False).record_count == 5
    with pytest.raises(CorruptRecordBatch):
        read_batch_info(batch[:-1])
    with pytest.raises(CorruptRecordBatch):
        read_batch_info(batch[:40])
    wrong = bytearray(batch)
    struct.pack_into(">i", wrong, 57, 6)
    with pytest.raises(CorruptRecordBatch, match="lastOffsetDelta"):
        read_batch_info(with_crc(wrong))
    struct.pack_into(">i", wrong, 57, 10**6)
    struct.pack_into(">i", wrong, 23, 10**6 - 1)
    with pytest.raises(CorruptRecordBatch, match="cannot hold"):
        read_batch_info(with_crc(wrong))
    magic0 = bytearray(batch)
    magic0[16] = 0
    with pytest.raises(UnsupportedRecordFormat, match="v0"):
        read_batch_info(magic0)
    txn = kafka_python_batch(
        sample_records(2), 0, is_transactional=True, producer_id=5, producer_epoch=0
    )
    with pytest.raises(UnsupportedRecordFormat, match="transaction"):
        read_batch_info(txn)
    control = bytearray(batch)
    struct.pack_into(">h", control, 21, 0x20)
    with pytest.raises(UnsupportedRecordFormat):
        read_batch_info(with_crc(control))
    # an idempotent (non-transactional) producer is fine
    idem = kafka_python_batch(sample_records(2), 0, producer_id=5, producer_epoch=1)
    assert read_batch_info(idem).producer_id == 5


def test_read_header_checks_format_2_lengths() -> None:
    entry = stored(kafka_python_batch(sample_records(2), 0))
    native = entry[32:]
    assert read_header(native).body_length == len(native) - read_header(native).body_offset
    with pytest.raises(CorruptFrame):
        read_header(native[:-1])
    with pytest.raises(CorruptFrame):
        read_header(native + b"\0")


def test_record_count_must_match_the_entry_header() -> None:
    batch = kafka_python_batch(sample_records(3), 0)
    info = read_batch_info(batch)
    fake = type(info)(*[4 if f == "record_count" else getattr(info, f) for f in info.__slots__])
    native = b"".join(
        wrap_record_batch(batch, fake, producer_name="p", sequence_id=0, publish_time=0)
    )
    with pytest.raises(CorruptRecordBatch, match="counts 4"):
        decode_batch(native, CODECS)


@pytest.mark.parametrize(
    "section",
    [
        b"\xff" * 12,  # a varint longer than 10 bytes
        b"\x10\x00\x00\x00\x01a\x01",  # a record that overruns its length
        b"\x0e\x00\x00\x02\x01\x01\x00",  # offset delta 1 for record 0
        b"\x0e\x00\x00\x00\x05\x01\x00",  # key length -3
        b"\x0c\x00\x00\x00\x01\x01\x00\x00",  # a byte after the last record
        b"",  # no record at all
    ],
)
def test_garbage_records_are_corrupt(section: bytes) -> None:
    batch = batch_of_records(section, 1)
    with pytest.raises(CorruptRecordBatch):  # from read_batch_info or from decode_batch
        info = read_batch_info(batch)
        native = wrap_record_batch(batch, info, producer_name="p", sequence_id=0, publish_time=0)
        decode_batch(b"".join(native), CODECS)


@pytest.mark.parametrize("codec", [1, 2, 3, 4])
def test_zip_bomb_is_refused(codec: int) -> None:
    section = compress_records(codec, b"\0" * (8 << 20))
    assert len(section) < 1 << 20
    batch = batch_of_records(section, 1, attributes=codec)
    native = b"".join(
        wrap_record_batch(
            batch, read_batch_info(batch), producer_name="p", sequence_id=0, publish_time=0
        )
    )
    with pytest.raises(MessageTooLarge):
        decode_batch(native, CODECS, max_uncompressed_size=1 << 20)
    # the default cap lets it through to the record parser, which finds garbage
    with pytest.raises(CorruptRecordBatch):
        decode_batch(native, CODECS)


def test_fuzzed_batches_raise_only_typed_errors() -> None:
    rng = random.Random(1414)
    seeds = [kafka_python_batch(sample_records(6), c) for c in COMPRESSIONS.values()] + [
        b"".join(encode_record_batch([b"x"], [None], [0]))
    ]
    outcomes = {"ok": 0, "error": 0}
    for _ in range(1500):
        seed = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(21, len(seed))
            if rng.random() < 0.15:
                del seed[pos:]
                struct.pack_into(">i", seed, 8, max(len(seed) - 12, 0))
                break
            seed[pos] = rng.randrange(256)
        mutated = with_crc(seed) if len(seed) >= 61 else bytes(seed)
        try:
            info = read_batch_info(mutated)
            native = b"".join(
                wrap_record_batch(mutated, info, producer_name="f", sequence_id=0, publish_time=0)
            )
            decoded = decode_batch(native, CODECS, max_uncompressed_size=1 << 20)
            decoded.values()
            decoded.keys()
            decoded.all_properties()
            outcomes["ok"] += 1
        except PigeonError:
            outcomes["error"] += 1
    assert outcomes["error"] > 100  # the mutations did reach the checks


def test_gzip_records_must_be_gzip() -> None:
    section = zlib.compress(b"\x0c\x00\x00\x00\x01\x01\x00", wbits=15)  # zlib, not gzip
    batch = batch_of_records(section, 1, attributes=1)
    native = b"".join(
        wrap_record_batch(
            batch, read_batch_info(batch), producer_name="p", sequence_id=0, publish_time=0
        )
    )
    with pytest.raises(CorruptRecordBatch, match="gzip"):
        decode_batch(native, CODECS)


def test_stored_crc_is_checked_on_decode() -> None:
    entry = bytearray(stored(kafka_python_batch(sample_records(3), 0)))
    entry[-1] ^= 0x40
    with pytest.raises(CorruptRecordBatch, match="CRC"):
        decode_batch(memoryview(entry)[32:], CODECS)


def test_unknown_compression_is_unsupported() -> None:
    batch = bytearray(kafka_python_batch(sample_records(3), 0))
    struct.pack_into(">h", batch, 21, 5)
    with pytest.raises(UnsupportedRecordFormat, match="compression id 5"):
        read_batch_info(with_crc(batch))


messages = st.lists(
    st.tuples(
        st.one_of(st.none(), st.binary(max_size=300)),
        st.binary(max_size=20000),
        st.integers(T0 - 10**6, T0 + 10**6),
        st.dictionaries(st.text(max_size=8), st.text(max_size=300), max_size=3),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(messages, st.integers(0, 2**62))
def test_native_to_kafka_to_native_round_trip(
    msgs: list[tuple[bytes | None, bytes, int, dict[str, str]]], first_offset: int
) -> None:
    """A native entry fetched as Kafka, produced back and read natively is unchanged
    (long values and headers take varints past the one- and two-byte fast paths)."""
    keys, values, times, props = (list(col) for col in zip(*msgs, strict=True))
    native = native_batch(values, keys, props, times, GZIP)
    kafka_batch = b"".join(
        kafka_batch_of_entry(pack_entry_header(len(msgs), first_offset, T0) + native, CODECS)
    )
    assert read_batch_info(kafka_batch).base_offset == first_offset
    decoded = decode_batch(memoryview(stored(kafka_batch))[32:], CODECS)
    assert decoded.values() == values
    assert decoded.keys() == keys
    assert [decoded.event_time(i) for i in range(len(msgs))] == times
    assert decoded.all_properties() == props


@pytest.mark.parametrize("codec", ["none", "gzip", "zstd"])
def test_a_batch_must_hold_the_records_it_counts(codec: str) -> None:
    """The count decides how many offsets a batch takes: a batch claiming more (or fewer)
    records than it holds is refused before it is stored, CRC or not."""
    batch = kafka_python_batch(sample_records(5), COMPRESSIONS[codec])
    assert count_records(batch, read_batch_info(batch), 1 << 20) == 5
    for count in (4, 6, 500):
        lying = bytearray(batch)
        struct.pack_into(">i", lying, 23, count - 1)  # lastOffsetDelta
        struct.pack_into(">i", lying, 57, count)  # recordCount
        refused = with_crc(lying)
        with pytest.raises(CorruptRecordBatch, match=r"says|cannot hold"):
            count_records(refused, read_batch_info(refused), 1 << 20)
    cut = batch_of_records(b"\x10" + b"\x00" * 3, 1)  # a record of 8 bytes with 3 present
    with pytest.raises(CorruptRecordBatch):
        count_records(cut, read_batch_info(cut, verify_crc=True), 1 << 20)
