"""The one error tree of PigeonMQ.

Every error a node can report to a peer is a subclass of :class:`PigeonError` with a
unique numeric wire ``code`` and a ``retriable`` flag, both given in its class statement
(``class TopicNotFound(PigeonError, code=300)``).  A server encodes an error as
``(code, message)`` on the wire; the receiving side rebuilds the same class with
:func:`error_from_code`, so ``except TopicNotFound`` works the same in the broker, the
client and the tests.  Unknown codes (a newer peer) come back as plain
:class:`PigeonError` carrying the code they had.

Codes are grouped: 1xx protocol/transport, 2xx client input, 3xx topics and
subscriptions, 4xx storage, 5xx metadata, 6xx configuration and plugins.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "AckNotPersisted",
    "AlreadyClosed",
    "AuthenticationError",
    "AuthorizationError",
    "BadVersion",
    "BookieReadOnly",
    "CodecError",
    "ConfigError",
    "ConnectionClosed",
    "ConsumerBusy",
    "CorruptEntry",
    "CorruptFrame",
    "CorruptRecordBatch",
    "DataDirLocked",
    "EntryNotFound",
    "FrameTooLarge",
    "IncompatibleSchema",
    "InternalError",
    "InvalidArgument",
    "InvalidEntryId",
    "InvalidSchemaData",
    "InvalidSubscriptionName",
    "InvalidTopicName",
    "MalformedRequest",
    "MessageTooLarge",
    "MetadataError",
    "NodeExists",
    "NotConfigured",
    "NotEnoughBookies",
    "NoSuchNode",
    "NotEmpty",
    "NotOwner",
    "NotSupported",
    "OffloadError",
    "PigeonError",
    "PluginError",
    "ProducerBlocked",
    "ProducerBusy",
    "ProducerFenced",
    "ProducerQueueFull",
    "ProtocolError",
    "ProtocolVersionMismatch",
    "SchemaNotFound",
    "SchemaSerializationError",
    "SegmentFenced",
    "SegmentNotFound",
    "ServiceUnavailable",
    "SessionExpired",
    "StorageError",
    "SubscriptionBusy",
    "SubscriptionNotFound",
    "Timeout",
    "TlsError",
    "TopicExists",
    "TopicNotFound",
    "UnknownCodec",
    "UnknownMessageType",
    "UnsupportedRecordFormat",
    "error_from_code",
]


class PigeonError(Exception):
    """Base of every PigeonMQ error.

    ``code`` is the wire code (unique per class); ``retriable`` tells a client whether
    repeating the same call later may succeed (after a reconnect, a lookup, a failover).
    """

    code: ClassVar[int] = 1
    retriable: ClassVar[bool] = False
    _by_code: ClassVar[dict[int, type[PigeonError]]] = {}

    def __init_subclass__(
        cls, *, code: int | None = None, retriable: bool | None = None, **kwargs: object
    ) -> None:
        """``class TopicNotFound(PigeonError, code=300)``: every error class of the tree
        names its own wire code (a class without one rebuilds as its parent), and may
        change ``retriable``; otherwise it inherits its parent's."""
        super().__init_subclass__(**kwargs)
        if retriable is not None:
            cls.retriable = retriable
        if code is None:
            return
        other = PigeonError._by_code.get(code)
        if other is not None and other is not cls:
            raise TypeError(f"wire code {code} used by both {other.__name__} and {cls.__name__}")
        cls.code = code
        PigeonError._by_code[code] = cls

    def __init__(self, message: str = "", *, code: int | None = None) -> None:
        super().__init__(message or self.__class__.__name__)
        if code is not None and code != type(self).code:
            self.wire_code = code
        else:
            self.wire_code = type(self).code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


def error_from_code(code: int, message: str) -> PigeonError:
    """Rebuild the error a peer reported as ``(code, message)``."""
    cls = PigeonError._by_code.get(code)
    if cls is None:
        return PigeonError(message, code=code)
    return cls(message)


# --- 1xx: protocol and transport -------------------------------------------------


class ProtocolError(PigeonError, code=100):
    """The peer broke the protocol; the connection is closed."""


class CorruptFrame(ProtocolError, code=101):
    """A frame could not be decoded (bad length, bad Cap'n Proto, garbage bytes)."""


class FrameTooLarge(ProtocolError, code=102):
    """A frame is larger than the configured ``max_frame_size``."""


class UnknownMessageType(ProtocolError, code=103):
    """A request of a type this node does not serve."""


class ProtocolVersionMismatch(ProtocolError, code=104):
    """The ``connect`` handshake named a protocol version this node does not speak."""


class TlsError(ProtocolError, code=106):
    """A TLS handshake was refused: a certificate that is not trusted, expired or for
    another host, a client certificate missing, or a plaintext peer on a TLS port (or the
    other way round).  Not retriable: the configuration must change."""


class CorruptRecordBatch(CorruptFrame, code=105):
    """A Kafka RecordBatch that does not decode: truncated, bad CRC-32C, lengths or record
    count that do not add up, a record that runs past its batch, garbage varints."""


class ConnectionClosed(PigeonError, code=110, retriable=True):
    """The connection went away while a call was in flight."""


class Timeout(PigeonError, code=111, retriable=True):
    """An operation did not finish in its time limit."""


class ServiceUnavailable(PigeonError, code=112, retriable=True):
    """The node is starting, stopping, or cannot reach what it needs."""


class AlreadyClosed(PigeonError, code=113):
    """The producer, consumer or client was closed."""


class InternalError(PigeonError, code=120):
    """The node failed while handling a request: a bug, logged there with its traceback.

    Not retried: the same request would fail the same way.
    """


# --- 2xx: client input -----------------------------------------------------------


class InvalidArgument(PigeonError, code=200):
    """A request carried a value out of its domain."""


class InvalidTopicName(InvalidArgument, code=201):
    """A topic name that does not parse (see ``pigeon.core.TopicName``)."""


class InvalidSubscriptionName(InvalidArgument, code=206):
    """A subscription name outside the rule of ``pigeon.core.check_subscription_name``."""


class MessageTooLarge(InvalidArgument, code=202):
    """A message or batch over the broker's ``max_message_size``."""


class NotSupported(InvalidArgument, code=203):
    """The operation is not allowed here (e.g. cumulative ack on a shared subscription)."""


class UnsupportedRecordFormat(NotSupported, code=205):
    """A well-formed Kafka record batch this node does not accept: message format v0/v1
    (magic 0 or 1), a transactional or control batch (transactions are not supported),
    an unknown compression codec."""


class MalformedRequest(InvalidArgument, code=204):
    """A frame that decodes, but whose request body does not: a pointer out of bounds,
    text that is not UTF-8, an enum value or union member this node does not know.

    Only this request is refused; the connection stays open.  The message names the
    request kind and the field.
    """


class ProducerQueueFull(PigeonError, code=210, retriable=True):
    """The producer's pending queue is full and ``block_if_queue_full`` is off."""


class ProducerBlocked(PigeonError, code=211):
    """The broker refuses publishes: the backlog quota (producer_exception) is exceeded.

    Not retried by the client: the application decides whether to wait and send again.
    """


class AuthenticationError(PigeonError, code=220):
    """Who the client is could not be established: no credentials, or a token that is
    malformed, wrongly signed or expired (the message says which, never the secret)."""


class AuthorizationError(PigeonError, code=221):
    """The role is known but may not do this (produce, consume, an admin operation on a
    tenant, namespace or topic); the message names the role and the action."""


# --- 3xx: topics, producers, subscriptions ----------------------------------------


class TopicNotFound(PigeonError, code=300):
    """The topic does not exist."""


class SubscriptionNotFound(PigeonError, code=301):
    """The topic has no subscription of that name."""


class TopicExists(PigeonError, code=305):
    """A topic of that name exists already."""


class NotOwner(PigeonError, code=306, retriable=True):
    """This broker does not own the topic's bundle; look the topic up again."""


class ProducerBusy(PigeonError, code=302, retriable=True):
    """A producer with the same name is already connected to the topic."""


class ProducerFenced(PigeonError, code=307):
    """The producer was fenced off its topic: a producer with access mode
    ``exclusive_with_fencing`` took the topic (or a newer exclusive producer did, raising
    the topic epoch past this one's).  It cannot send on; create a new producer."""


class AckNotPersisted(PigeonError, code=308, retriable=True):
    """An acknowledgement sent with ``ack_receipt_enabled`` was not confirmed as stored in
    the subscription's cursor (the consumer was not connected, the topic moved, or the
    cursor write failed): the message may be delivered again."""


class ConsumerBusy(PigeonError, code=303, retriable=True):
    """An exclusive subscription already has a consumer."""


class SubscriptionBusy(PigeonError, code=304):
    """The subscription exists with another type."""


class IncompatibleSchema(PigeonError, code=310):
    """A producer's or consumer's schema is refused by the topic's schema registry: not
    compatible with a stored version under the namespace's
    ``schema_compatibility_strategy`` (the message names the version, the strategy and
    the rule), or a new version while ``is_allow_auto_update_schema`` is off."""


class SchemaNotFound(PigeonError, code=311):
    """The topic has no schema (or no version of that number)."""


class SchemaSerializationError(PigeonError, code=312):
    """A value could not be encoded with the producer's schema, or a message could not
    be decoded with the schema version it was written with."""


class InvalidSchemaData(InvalidArgument, code=313):
    """A schema definition that cannot be used: not JSON, not an Avro record schema, an
    unknown schema type."""


# --- 4xx: storage ----------------------------------------------------------------


class StorageError(PigeonError, code=400, retriable=True):
    """An I/O error on a bookie."""


class SegmentNotFound(StorageError, code=401, retriable=False):
    """The bookie holds no segment of that id (never written, or deleted)."""


class SegmentFenced(StorageError, code=402, retriable=False):
    """The segment was fenced: the old writer may not append any more."""


class EntryNotFound(StorageError, code=403, retriable=False):
    """The entry is past the last add confirmed, or was never written."""


class InvalidEntryId(StorageError, code=404, retriable=False):
    """An add whose entry id is not the next one of the segment."""


class CorruptEntry(StorageError, code=405, retriable=False):
    """A stored entry failed its checksum; it is never returned."""


class BookieReadOnly(StorageError, code=406, retriable=True):
    """The bookie is read-only (disk full or an I/O error); write elsewhere."""


class DataDirLocked(StorageError, code=407, retriable=False):
    """The data directory is in use by a running bookie (its LOCK is held)."""


class NotEnoughBookies(StorageError, code=408, retriable=True):
    """Too few writable bookies are reachable to store an entry on the ack quorum; the
    write is refused (nothing was stored) and succeeds when bookies return."""


class OffloadError(StorageError, code=409, retriable=True):
    """The object store holding offloaded segments failed (unreachable, refused, a
    partial upload); an offload is retried later and the bookie copy stays."""


class CodecError(PigeonError, code=410):
    """A compressed body could not be decoded."""


class UnknownCodec(CodecError, code=411):
    """A batch names a codec that is not registered on this node."""


# --- 5xx: metadata ---------------------------------------------------------------


class MetadataError(PigeonError, code=500, retriable=True):
    """The metadata store failed or could not be reached."""


class NoSuchNode(MetadataError, code=501, retriable=False):
    """The metadata node does not exist."""


class NodeExists(MetadataError, code=502, retriable=False):
    """A metadata node exists already at that path."""


class BadVersion(MetadataError, code=503, retriable=False):
    """A compare-and-set lost: the node's version is not the expected one."""


class NotEmpty(MetadataError, code=504, retriable=False):
    """Delete of a node that still has children."""


class SessionExpired(MetadataError, code=505, retriable=False):
    """The metadata session expired; its ephemeral nodes are gone."""


# --- 6xx: configuration and plugins ----------------------------------------------


class ConfigError(PigeonError, code=600):
    """A bad configuration value; the message names the key."""


class NotConfigured(PigeonError, code=602):
    """The node is not set up for this request (an offload on a broker without
    ``managed_ledger_offload_driver``): a request that is valid elsewhere."""


class PluginError(PigeonError, code=601):
    """A plugin is missing or failed to register."""
