"""pigeon-client: produce to and consume from PigeonMQ.

The synchronous API lives here; ``pigeon.client.trio`` has the same API for trio
programs (``async with`` / ``await``), ``pigeon.client.asyncio`` for asyncio ones, and
``pigeon.client.ranges`` the partition-level reads connectors use (the Spark source),
``pigeon.client.schema`` the message schemas (Records, AvroSchema, JsonSchema...).

    from pigeon.client import Client
    with Client("pigeon://127.0.0.1:6650") as client:
        with client.create_producer("events") as producer:
            producer.send(b"payload", key="k", properties={"a": "1"})
        with client.subscribe("events", "sub-1", initial_position="earliest") as consumer:
            msg = consumer.receive(timeout=5.0)
            consumer.acknowledge(msg)

TLS and credentials, with Pulsar's names::

    Client("pigeon+ssl://broker.example:6651",
           authentication=AuthenticationToken("file:///run/secrets/pigeon-token"),
           tls_trust_certs_file_path="/etc/pigeon/ca.pem")
"""

from __future__ import annotations

from pigeon.client._message import ChunkMessageId, EntryReceipt, Message, MessageId
from pigeon.client._options import DeadLetterPolicy, MultiplierRedeliveryBackoff
from pigeon.client._sync import Client, Consumer, Producer, Reader, TableView
from pigeon.core.auth import AuthenticationTLS, AuthenticationToken
from pigeon.core.errors import (
    AckNotPersisted,
    AlreadyClosed,
    AuthenticationError,
    AuthorizationError,
    ConnectionClosed,
    IncompatibleSchema,
    MessageTooLarge,
    PigeonError,
    ProducerBusy,
    ProducerFenced,
    ProducerQueueFull,
    SchemaSerializationError,
    Timeout,
    TlsError,
)

__all__ = [
    "AckNotPersisted",
    "AlreadyClosed",
    "AuthenticationError",
    "AuthenticationTLS",
    "AuthenticationToken",
    "AuthorizationError",
    "ChunkMessageId",
    "Client",
    "ConnectionClosed",
    "Consumer",
    "DeadLetterPolicy",
    "EntryReceipt",
    "IncompatibleSchema",
    "Message",
    "MessageId",
    "MessageTooLarge",
    "MultiplierRedeliveryBackoff",
    "PigeonError",
    "Producer",
    "ProducerBusy",
    "ProducerFenced",
    "ProducerQueueFull",
    "Reader",
    "SchemaSerializationError",
    "TableView",
    "Timeout",
    "TlsError",
]
