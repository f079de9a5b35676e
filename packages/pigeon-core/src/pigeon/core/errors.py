"""The one error tree of PigeonMQ.

Every error a node can report to a peer is a subclass of :class:`PigeonError` with a
unique numeric wire ``code`` and a ``retriable`` flag.  A server encodes an error as
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
    "AlreadyClosed",
    "BadVersion",
    "BookieReadOnly",
    "CodecError",
    "ConfigError",
    "ConnectionClosed",
    "ConsumerBusy",
    "CorruptEntry",
    "CorruptFrame",
    "DataDirLocked",
    "EntryNotFound",
    "FrameTooLarge",
    "InternalError",
    "InvalidArgument",
    "InvalidEntryId",
    "InvalidTopicName",
    "MalformedRequest",
    "MessageTooLarge",
    "MetadataError",
    "NodeExists",
    "NotEnoughBookies",
    "NoSuchNode",
    "NotEmpty",
    "NotOwner",
    "NotSupported",
    "PigeonError",
    "PluginError",
    "ProducerBlocked",
    "ProducerBusy",
    "ProducerQueueFull",
    "ProtocolError",
    "ProtocolVersionMismatch",
    "SegmentFenced",
    "SegmentNotFound",
    "ServiceUnavailable",
    "SessionExpired",
    "StorageError",
    "SubscriptionBusy",
    "SubscriptionNotFound",
    "Timeout",
    "TopicExists",
    "TopicNotFound",
    "UnknownCodec",
    "UnknownMessageType",
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

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("code")
        if code is None:
            return
        other = PigeonError._by_code.get(code)
        if other is not None and other is not cls:
            raise TypeError(f"wire code {code} used by both {other.__name__} and {cls.__name__}")
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


class ProtocolError(PigeonError):
    """The peer broke the protocol; the connection is closed."""

    code = 100


class CorruptFrame(ProtocolError):
    """A frame could not be decoded (bad length, bad Cap'n Proto, garbage bytes)."""

    code = 101


class FrameTooLarge(ProtocolError):
    """A frame is larger than the configured ``max_frame_size``."""

    code = 102


class UnknownMessageType(ProtocolError):
    """A request of a type this node does not serve."""

    code = 103


class ProtocolVersionMismatch(ProtocolError):
    """The ``connect`` handshake named a protocol version this node does not speak."""

    code = 104


class ConnectionClosed(PigeonError):
    """The connection went away while a call was in flight."""

    code = 110
    retriable = True


class Timeout(PigeonError):
    """An operation did not finish in its time limit."""

    code = 111
    retriable = True


class ServiceUnavailable(PigeonError):
    """The node is starting, stopping, or cannot reach what it needs."""

    code = 112
    retriable = True


class AlreadyClosed(PigeonError):
    """The producer, consumer or client was closed."""

    code = 113


class InternalError(PigeonError):
    """The node failed while handling a request: a bug, logged there with its traceback.

    Not retried: the same request would fail the same way.
    """

    code = 120


# --- 2xx: client input -----------------------------------------------------------


class InvalidArgument(PigeonError):
    """A request carried a value out of its domain."""

    code = 200


class InvalidTopicName(InvalidArgument):
    """A topic name that does not parse (see ``pigeon.core.TopicName``)."""

    code = 201


class MessageTooLarge(InvalidArgument):
    """A message or batch over the broker's ``max_message_size``."""

    code = 202


class NotSupported(InvalidArgument):
    """The operation is not allowed here (e.g. cumulative ack on a shared subscription)."""

    code = 203


class MalformedRequest(InvalidArgument):
    """A frame that decodes, but whose request body does not: a pointer out of bounds,
    text that is not UTF-8, an enum value or union member this node does not know.

    Only this request is refused; the connection stays open.  The message names the
    request kind and the field.
    """

    code = 204


class ProducerQueueFull(PigeonError):
    """The producer's pending queue is full and ``block_if_queue_full`` is off."""

    code = 210
    retriable = True


class ProducerBlocked(PigeonError):
    """The broker refuses publishes: the backlog quota (producer_exception) is exceeded.

    Not retried by the client: the application decides whether to wait and send again.
    """

    code = 211


# --- 3xx: topics, producers, subscriptions ----------------------------------------


class TopicNotFound(PigeonError):
    code = 300


class SubscriptionNotFound(PigeonError):
    code = 301


class TopicExists(PigeonError):
    code = 305


class NotOwner(PigeonError):
    """This broker does not own the topic's bundle; look the topic up again."""

    code = 306
    retriable = True


class ProducerBusy(PigeonError):
    """A producer with the same name is already connected to the topic."""

    code = 302
    retriable = True


class ConsumerBusy(PigeonError):
    """An exclusive subscription already has a consumer."""

    code = 303
    retriable = True


class SubscriptionBusy(PigeonError):
    """The subscription exists with another type."""

    code = 304


# --- 4xx: storage ----------------------------------------------------------------


class StorageError(PigeonError):
    """An I/O error on a bookie."""

    code = 400
    retriable = True


class SegmentNotFound(StorageError):
    code = 401
    retriable = False


class SegmentFenced(StorageError):
    """The segment was fenced: the old writer may not append any more."""

    code = 402
    retriable = False


class EntryNotFound(StorageError):
    """The entry is past the last add confirmed, or was never written."""

    code = 403
    retriable = False


class InvalidEntryId(StorageError):
    """An add whose entry id is not the next one of the segment."""

    code = 404
    retriable = False


class CorruptEntry(StorageError):
    """A stored entry failed its checksum; it is never returned."""

    code = 405
    retriable = False


class BookieReadOnly(StorageError):
    """The bookie is read-only (disk full or an I/O error); write elsewhere."""

    code = 406
    retriable = True


class DataDirLocked(StorageError):
    """The data directory is in use by a running bookie (its LOCK is held)."""

    code = 407
    retriable = False


class NotEnoughBookies(StorageError):
    """Too few writable bookies are reachable to store an entry on the ack quorum; the
    write is refused (nothing was stored) and succeeds when bookies return."""

    code = 408
    retriable = True


class CodecError(PigeonError):
    """A compressed body could not be decoded."""

    code = 410


class UnknownCodec(CodecError):
    """A batch names a codec that is not registered on this node."""

    code = 411


# --- 5xx: metadata ---------------------------------------------------------------


class MetadataError(PigeonError):
    code = 500
    retriable = True


class NoSuchNode(MetadataError):
    code = 501
    retriable = False


class NodeExists(MetadataError):
    code = 502
    retriable = False


class BadVersion(MetadataError):
    """A compare-and-set lost: the node's version is not the expected one."""

    code = 503
    retriable = False


class NotEmpty(MetadataError):
    """Delete of a node that still has children."""

    code = 504
    retriable = False


class SessionExpired(MetadataError):
    """The metadata session expired; its ephemeral nodes are gone."""

    code = 505
    retriable = False


# --- 6xx: configuration and plugins ----------------------------------------------


class ConfigError(PigeonError):
    """A bad configuration value; the message names the key."""

    code = 600


class PluginError(PigeonError):
    """A plugin is missing or failed to register."""

    code = 601
