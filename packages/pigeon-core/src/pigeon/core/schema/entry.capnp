@0x896498a9fc72dec9;
# PigeonMQ entry (batch) header.
#
# An entry is what a producer sends as one batch, what a bookie stores and what a consumer
# splits. Byte layout (all integers little-endian; see pigeon/core/_batch.py):
#
#     u32 header_len | BatchHeader (standard unpacked single-segment message, header_len
#     bytes) | body (body_length bytes, compressed by `codec` as a whole)
#
# The uncompressed body holds the columns of the batch, each starting at a multiple of 8
# bytes from the start of the body (zero padding in between), in this order; a column that
# is absent (flag false) takes no bytes at all:
#
#     eventTimes         int64[n]                      if hasEventTimes
#     valueOffsets       int32[n+1]                    always (0, ..., valuesLength)
#     keyOffsets         int32[n+1]                    if hasKeys
#     keyValidity        bitmap, ceil(n/8) bytes       if hasKeys (Arrow LSB order, 1 = set)
#     propertyOffsets    int32[n+1]                    if hasProperties (into entries)
#     propertyKeyOffsets int32[m+1]                    if hasProperties (m = propertyEntries)
#     propertyValueOffsets int32[m+1]                  if hasProperties
#     values             valuesLength bytes
#     keys               keysLength bytes              if hasKeys
#     propertyKeys       propertyKeysLength bytes      if hasProperties (UTF-8)
#     propertyValues     propertyValuesLength bytes    if hasProperties (UTF-8)
#
# Every offsets column starts at 0, never decreases and ends at the length of its data.
# The layout is that of Arrow arrays: values = binary, keys = binary with a validity
# bitmap, properties = map<string, string> (list offsets + key and value string arrays).
#
# Fields are only ever added (with new numbers); a reader ignores fields it does not know
# and sees the default (0 / false / "") for fields an older writer did not set.

struct BatchHeader {
  # Describes one entry: who produced it, how many messages it holds and where each
  # column of the body is.

  formatVersion @0 :UInt8;
  # Version of the body layout: 1 = the columns described above; 2 = the body is a Kafka
  # RecordBatch v2 stored unchanged (codec 0, bodyLength = uncompressedSize = its size,
  # numMessages = its record count, column flags and lengths 0; see
  # pigeon/core/_kafka_records.py). A reader refuses others.

  producerName @1 :Text;
  # Name of the producer that built the batch (unique per topic); with sequenceId it is
  # the key of broker-side de-duplication.

  sequenceId @2 :UInt64;
  # Sequence id of the first message; message i of the batch has sequenceId + i.

  numMessages @3 :UInt32;
  # Number of messages n in the batch; at least 1.

  codec @4 :UInt8;
  # Wire id of the codec that compressed the body: 0 none, 1 gzip, 2 lz4, 3 zstd
  # (reserved); other ids belong to plugins.

  uncompressedSize @5 :UInt32;
  # Size of the body after decompression, padding included. It must equal the sum of the
  # column sizes (with padding) derived from the fields below.

  bodyLength @6 :UInt32;
  # Size of the body as stored (compressed); the entry is exactly
  # 4 + header_len + bodyLength bytes long.

  publishTime @7 :Int64;
  # Producer-side creation time of the batch, milliseconds since the Unix epoch.

  deliverAtTime @8 :Int64;
  # Delayed delivery: do not dispatch before this time (ms since the epoch); 0 = now.

  schemaVersion @9 :UInt32;
  # Version of the topic schema the values were encoded with, plus one (registry versions
  # start at 0, as Pulsar's do); 0 = none (bytes).

  hasKeys @10 :Bool;
  # True if the keyOffsets, keyValidity and keys columns are present (some message has a
  # key). A message without a key has a clear validity bit and an empty key range.

  hasEventTimes @11 :Bool;
  # True if the eventTimes column is present (some message has a non-zero event time).

  hasProperties @12 :Bool;
  # True if the three property offset columns and the two property data columns are
  # present (some message has at least one property).

  valuesLength @13 :UInt32;
  # Size in bytes of the values column (the last value offset).

  keysLength @14 :UInt32;
  # Size in bytes of the keys column (the last key offset); 0 without keys.

  propertyEntries @15 :UInt32;
  # Total number m of (key, value) property pairs over all messages (the last property
  # offset); 0 without properties.

  propertyKeysLength @16 :UInt32;
  # Size in bytes of the UTF-8 property keys column; 0 without properties.

  propertyValuesLength @17 :UInt32;
  # Size in bytes of the UTF-8 property values column; 0 without properties.

  # Chunking: a message too large for one entry is split into numChunks entries of one
  # message each (see pigeon/client/_chunks.py). Every chunk carries the message key; the
  # first also its properties and event time. numChunks 0 = not a chunk.

  chunkUuid @18 :Text;
  # Identifies the chunked message: "<producerName>-<sequence id of its first chunk>".
  # A resend after a reconnect keeps it (chunk i always has sequence id first + i).

  chunkId @19 :UInt32;
  # Index of this chunk, 0 .. numChunks - 1.

  numChunks @20 :UInt32;
  # Number of chunks of the message; 0 when the entry is not a chunk.

  totalChunkSize @21 :UInt32;
  # Size in bytes of the whole message value (the sum of the chunks' values).
}
