@0x99eb2efa60ca763d;
# PigeonMQ wire protocol: every message between client and broker, and between broker
# (or anything holding a segment writer) and bookie.
#
# Framing (see pigeon/core/_framing.py): each frame on a TCP stream is
#
#     u32 little-endian frame_length | Cap'n Proto message (standard, unpacked) | payload
#
# The Cap'n Proto message is self-delimiting (its segment table gives its size), so the
# bytes after it, up to frame_length, are the frame's *payload*: entry data that is
# carried as-is (a producer's batch, stored entries read from a bookie, entries pushed to
# a consumer) and so is never copied into or out of a Cap'n Proto Data field.
#
# Every request carries a non-zero requestId; its answer (success or `error`) carries the
# same id. requestId 0 marks a message that wants no answer (flow permits, pushes from
# the server to the client).

# ---------------------------------------------------------------- shared structures

struct ErrorInfo {
  # A typed error: `code` is the wire code of a class in pigeon.core.errors.
  code @0 :UInt32;
  message @1 :Text;
}

struct Connect {
  # First frame a client sends on a connection.
  protocolVersion @0 :UInt32;   # the version the client speaks (currently 1)
  clientName @1 :Text;          # free-form, for logs and stats
  features @2 :List(Text);      # optional capabilities the client supports
  frameType @3 :Text;           # the root struct it speaks ("BrokerFrame", "BookieFrame"):
                                # a server of the other one refuses it; empty: not said
  authMethod @4 :Text;          # the authentication provider ("token", "tls"); empty: none
  authData @5 :Data;            # its credentials (a token); never logged
}

struct Connected {
  # The server's answer to Connect.
  protocolVersion @0 :UInt32;   # the version the server chose
  serverName @1 :Text;
  features @2 :List(Text);
  maxFrameSize @3 :UInt32;      # frames above this size close the connection
  maxMessageSize @4 :UInt32;    # a single batch (entry) above this is refused
  frameType @5 :Text;           # the root struct the server speaks; empty: not said
  authRole @6 :Text;            # the role the server authenticated; empty: no authentication
}

struct Position {
  # Where a message lives: an entry of a segment, and an index inside the entry's batch.
  segmentId @0 :Int64;
  entryId @1 :Int64;
  batchIndex @2 :Int32;         # -1: the whole entry
  batchSize @3 :UInt32;         # messages in the entry (needed for batch-index acks)
  offset @4 :Int64;             # the message's partition offset (-1: unknown)
  count @5 :UInt32;             # in an individual Ack: this many consecutive messages of
                                # the entry from batchIndex / offset (0 or 1: one);
                                # the Arrow consumer acknowledges a run of rows this way
}

# ---------------------------------------------------------------- client <-> broker

enum SubscriptionType {
  exclusive @0;
  shared @1;
  failover @2;
  keyShared @3;
}

enum InitialPosition {
  latest @0;
  earliest @1;
}

enum AckType {
  individual @0;
  cumulative @1;
}

struct Lookup {
  topic @0 :Text;
}

struct LookupResult {
  brokerUrl @0 :Text;           # pigeon://host:port of the owner
  partitions @1 :UInt32;        # 0: not partitioned
  topic @2 :Text;               # the topic's full name
}

struct SchemaInfo {
  # A producer's or consumer's schema (Pulsar's SchemaInfo). type "" (the default of an
  # unset field): no schema, the values are bytes.
  type @0 :Text;                # "BYTES", "STRING", "JSON", "AVRO"
  definition @1 :Text;          # JSON and AVRO: an Avro record schema (JSON text); else ""
}

enum ProducerAccessMode {
  # Pulsar's ProducerAccessMode (docs/messaging.md, "Producer access modes").
  shared @0;                    # any number of producers
  exclusive @1;                 # the only producer, or ProducerBusy
  waitForExclusive @2;          # the answer waits until it is the only producer (FIFO)
  exclusiveWithFencing @3;      # the only producer; the others are fenced (ProducerFenced)
}

struct CreateProducer {
  producerId @0 :UInt64;        # chosen by the client, unique per connection
  topic @1 :Text;
  producerName @2 :Text;        # empty: the broker assigns a unique name
  accessMode @3 :ProducerAccessMode;
  schemaInfo @4 :SchemaInfo;    # the producer's schema, checked against the topic's registry
  topicEpoch @5 :Int64 = -1;    # a re-attach: the topicEpoch its last producerCreated gave
                                # (-1: a new producer). Below the topic's epoch an
                                # exclusive-mode producer is fenced.
}

struct ProducerCreated {
  producerName @0 :Text;
  lastSequenceId @1 :Int64;     # highest sequence id stored for this producer name, -1 if none
  maxMessageSize @2 :UInt32;
  topic @3 :Text;
  schemaVersion @4 :Int64;      # the registry version of the producer's schema; -1: none
  topicEpoch @5 :Int64;         # the topic's producer epoch (raised by each new exclusive
                                # producer; persisted with the topic)
}

struct Send {
  # Payload: one batch (pigeon.core._batch), stored as one entry.
  producerId @0 :UInt64;
  sequenceId @1 :UInt64;        # of the batch's first message
  numMessages @2 :UInt32;
}

struct SendReceipt {
  producerId @0 :UInt64;
  sequenceId @1 :UInt64;
  segmentId @2 :Int64;
  entryId @3 :Int64;
  firstOffset @4 :Int64;        # partition offset of the batch's first message
  duplicate @5 :Bool;           # the broker had stored this sequence already
}

struct CloseProducer {
  producerId @0 :UInt64;
}

struct Subscribe {
  consumerId @0 :UInt64;        # chosen by the client, unique per connection
  topic @1 :Text;
  subscription @2 :Text;
  subType @3 :SubscriptionType;
  initialPosition @4 :InitialPosition;
  consumerName @5 :Text;
  priority @6 :Int32;
  durable @7 :Bool;             # false for readers: the cursor is not persisted
  startOffset @8 :Int64;        # non-durable cursors: first offset to read, -1 = initialPosition
  schemaInfo @9 :SchemaInfo;    # the consumer's schema: it must read the topic's data
  readCompacted @10 :Bool;      # the compacted view up to the horizon, then the log after it
}

struct Subscribed {
  topic @0 :Text;
}

struct Flow {
  # Grant more permits (messages) to the broker for this consumer. No answer.
  consumerId @0 :UInt64;
  permits @1 :UInt32;
}

struct DeliveredEntry {
  segmentId @0 :Int64;
  entryId @1 :Int64;
  size @2 :UInt32;              # bytes of this entry in the payload
  redeliveryCount @3 :UInt32;
  ackedIndexes @4 :List(UInt32);  # batch indexes already acknowledged (skip them)
}

struct MessagePush {
  # Server push (requestId 0). Payload: the entries' bytes one after another, each a
  # stored entry (broker header + batch), sizes as listed.
  consumerId @0 :UInt64;
  entries @1 :List(DeliveredEntry);
}

struct Ack {
  # requestId 0: no answer (grouped acks).  A non-zero requestId (ack_receipt_enabled)
  # is answered `ok` once the cursor holding these acks is stored in the metadata
  # store, or `error` (AckNotPersisted) if that cannot be confirmed.
  consumerId @0 :UInt64;
  ackType @1 :AckType;
  positions @2 :List(Position);
}

struct RedeliverUnacked {
  consumerId @0 :UInt64;
  positions @1 :List(Position);   # empty: every unacknowledged message of this consumer
}

struct CloseConsumer {
  consumerId @0 :UInt64;
}

struct Unsubscribe {
  consumerId @0 :UInt64;
}

struct Seek {
  consumerId @0 :UInt64;
  union {
    position @1 :Position;
    offset @2 :Int64;
    timestamp @3 :Int64;        # publish time, ms since epoch
  }
}

struct GetLastMessageId {
  consumerId @0 :UInt64;
}

struct LastMessageId {
  position @0 :Position;        # segmentId -1 when the topic is empty
  offset @1 :Int64;             # offset of the last message, -1 when empty
  markDeleteOffset @2 :Int64;   # offset of the next message the cursor will deliver
}

struct ClosedByBroker {
  # Server push: the broker closed this producer/consumer (topic unloaded or deleted).
  producerId @0 :UInt64;
  consumerId @1 :UInt64;
  isProducer @2 :Bool;
  reason @3 :Text;
}

struct CreateTopic {
  # Create a topic explicitly; partitions > 0 makes a partitioned topic whose partitions
  # are the topics `<name>-partition-<i>`. Answer: ok.
  topic @0 :Text;
  partitions @1 :UInt32;
}

struct ListTopics {
  namespace @0 :Text;           # "tenant/namespace"
}

struct TopicList {
  topics @0 :List(Text);        # full names; partitioned topics by their base name
}

struct GetSchema {
  # One version of a topic's schema. Answer: schemaResponse.
  topic @0 :Text;
  version @1 :Int64;            # -1: the latest
}

struct SchemaResponse {
  version @0 :Int64;
  schemaInfo @1 :SchemaInfo;
}

struct BrokerFrame {
  requestId @0 :UInt64;
  union {
    connect @1 :Connect;
    connected @2 :Connected;
    error @3 :ErrorInfo;
    ok @4 :Void;
    ping @5 :Void;
    lookup @6 :Lookup;
    lookupResult @7 :LookupResult;
    createProducer @8 :CreateProducer;
    producerCreated @9 :ProducerCreated;
    send @10 :Send;
    sendReceipt @11 :SendReceipt;
    closeProducer @12 :CloseProducer;
    subscribe @13 :Subscribe;
    subscribed @14 :Subscribed;
    flow @15 :Flow;
    message @16 :MessagePush;
    ack @17 :Ack;
    redeliverUnacked @18 :RedeliverUnacked;
    closeConsumer @19 :CloseConsumer;
    unsubscribe @20 :Unsubscribe;
    seek @21 :Seek;
    getLastMessageId @22 :GetLastMessageId;
    lastMessageId @23 :LastMessageId;
    closedByBroker @24 :ClosedByBroker;
    createTopic @25 :CreateTopic;
    listTopics @26 :ListTopics;
    topicList @27 :TopicList;
    getSchema @28 :GetSchema;
    schemaResponse @29 :SchemaResponse;
  }
}

# ---------------------------------------------------------------- writer <-> bookie

struct AddEntry {
  # Payload: the entry bytes.
  segmentId @0 :Int64;
  entryId @1 :Int64;
  lac @2 :Int64;                # writer's last-add-confirmed, piggybacked
  recovery @3 :Bool;            # recovery add: accepted on a fenced segment, idempotent
  resend @4 :Bool;              # an entry already stored with identical bytes is acked
  # Leader-follower replication: the receiving bookie (the segment's leader) stores the
  # entry, forwards it to these followers (in order, one stream per follower) and
  # answers once it is durable here and ``forwardAcks`` followers confirmed it (or every
  # forward ended).  A follower that never saw entries from ``syncFrom`` on is first
  # brought up to date from the leader's copy.
  forwardTo @5 :List(Text);
  forwardAcks @6 :UInt8;
  syncFrom @7 :Int64;
}

struct AddResponse {
  segmentId @0 :Int64;
  entryId @1 :Int64;
  copies @2 :UInt8;             # durable copies (leader-follower; 0: not counted)
  lostReplicas @3 :List(Text);  # followers the leader could not reach for this entry
}

struct ReadEntries {
  segmentId @0 :Int64;
  firstEntryId @1 :Int64;
  lastEntryId @2 :Int64;        # inclusive
  maxBytes @3 :UInt32;
  maxCount @4 :UInt32;
}

struct EntrySize {
  entryId @0 :Int64;
  size @1 :UInt32;
}

struct ReadResponse {
  # Payload: the entries' bytes one after another, sizes as listed.
  segmentId @0 :Int64;
  entries @1 :List(EntrySize);
}

struct SegmentRef {
  segmentId @0 :Int64;
}

struct SegmentState {
  segmentId @0 :Int64;
  lastEntryId @1 :Int64;        # -1: empty
  lac @2 :Int64;
  fenced @3 :Bool;
  sizeBytes @4 :UInt64;
}

struct BookieFrame {
  requestId @0 :UInt64;
  union {
    connect @1 :Connect;
    connected @2 :Connected;
    error @3 :ErrorInfo;
    ok @4 :Void;
    ping @5 :Void;
    addEntry @6 :AddEntry;
    addResponse @7 :AddResponse;
    readEntries @8 :ReadEntries;
    readResponse @9 :ReadResponse;
    readLac @10 :SegmentRef;
    fence @11 :SegmentRef;
    segmentInfo @12 :SegmentRef;
    segmentState @13 :SegmentState;
    deleteSegment @14 :SegmentRef;
  }
}
