"""The options dataclasses: what every face's keyword signature builds, in one place."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

import pigeon.client
import pigeon.client.asyncio
import pigeon.client.trio
from pigeon.client import MessageId
from pigeon.client._engine import parse_service_urls
from pigeon.client._options import (
    ConsumerOptions,
    ProducerOptions,
    QueueingProducerOptions,
    ReaderOptions,
)
from pigeon.core.errors import InvalidArgument

FACES = [pigeon.client.Client, pigeon.client.trio.Client, pigeon.client.asyncio.Client]


def defaults(options: type[Any]) -> dict[str, Any]:
    return {
        f.name: f.default
        for f in dataclasses.fields(options)
        if f.default is not dataclasses.MISSING
    }


@pytest.mark.parametrize("face", FACES, ids=lambda c: c.__module__)
@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("create_producer", ProducerOptions),
        ("subscribe", ConsumerOptions),
        ("create_reader", ReaderOptions),
    ],
)
def test_every_face_keyword_is_an_option_with_the_same_default(
    face: type[Any], method: str, options: type[Any]
) -> None:
    params = inspect.signature(getattr(face, method)).parameters
    if options is ProducerOptions and face is not pigeon.client.trio.Client:
        options = QueueingProducerOptions
    fields = defaults(options)
    for name, param in params.items():
        if name == "self" or param.default is inspect.Parameter.empty:
            continue
        assert name in fields, f"{face.__module__}.{method}({name}=) is no {options.__name__} field"
        assert param.default == fields[name], (face.__module__, method, name)


def test_only_the_trio_face_lacks_block_if_queue_full() -> None:
    """The trio face's send always waits for space; the others offer the choice."""
    have = {
        face.__module__: "block_if_queue_full" in inspect.signature(face.create_producer).parameters
        for face in FACES
    }
    assert have == {
        "pigeon.client._sync": True,
        "pigeon.client.trio": False,
        "pigeon.client.asyncio": True,
    }


@pytest.mark.parametrize(
    ("start", "inclusive", "expected"),
    [
        ("earliest", False, ("earliest", -1)),
        ("latest", True, ("latest", -1)),
        (MessageId(1, 2, 0, -1, 41), False, ("earliest", 42)),
        (MessageId(1, 2, 0, -1, 41), True, ("earliest", 41)),
    ],
)
def test_reader_start_position(start: Any, inclusive: bool, expected: tuple[str, int]) -> None:
    options = ReaderOptions("t", start, start_message_id_inclusive=inclusive)
    assert options.start_position() == expected


@pytest.mark.parametrize("start", ["first", MessageId(1, 2), 7])
def test_a_bad_reader_start_raises_when_the_options_are_built(start: Any) -> None:
    with pytest.raises(InvalidArgument):
        ReaderOptions("t", start)


MESSAGE = ["value", "key", "properties", "event_time", "deliver_at", "deliver_after"]


@pytest.mark.parametrize(
    ("producer", "extra"),
    [
        (pigeon.client.Producer, ["timeout", "sequence_id"]),
        (pigeon.client.trio.Producer, []),
        (pigeon.client.asyncio.Producer, ["timeout"]),
    ],
    ids=lambda x: getattr(x, "__module__", ""),
)
def test_each_face_send_takes_the_message_and_its_own_keywords(
    producer: type[Any], extra: list[str]
) -> None:
    params = inspect.signature(producer.send).parameters
    assert list(params) == ["self", *MESSAGE, *extra]
    assert [p.kind for p in params.values()][2:] == [inspect.Parameter.KEYWORD_ONLY] * (
        len(MESSAGE) - 1 + len(extra)
    )


@pytest.mark.parametrize(
    "face", [*FACES, pigeon.client.Producer, pigeon.client.trio.Producer], ids=str
)
def test_methods_built_from_options_are_awaitable_exactly_on_the_async_faces(
    face: type[Any],
) -> None:
    is_async = face.__module__ != "pigeon.client._sync"
    for name in ("create_producer", "subscribe", "create_reader", "send"):
        if hasattr(face, name):
            assert inspect.iscoroutinefunction(getattr(face, name)) is is_async, name


@pytest.mark.parametrize(
    ("options", "kwargs", "named"),
    [
        (ConsumerOptions, {"ack_receipt_enabled": "no"}, "ack_receipt_enabled"),
        (ConsumerOptions, {"read_compacted": "false"}, "read_compacted"),
        (
            ConsumerOptions,
            {"auto_ack_oldest_chunked_message_on_queue_full": "no"},
            "auto_ack_oldest_chunked_message_on_queue_full",
        ),
        (ConsumerOptions, {"max_pending_chunked_message": True}, "max_pending_chunked_message"),
        (
            ConsumerOptions,
            {"expire_time_of_incomplete_chunked_message": True},
            "expire_time_of_incomplete_chunked_message",
        ),
        (ConsumerOptions, {"ack_timeout": "30"}, "ack_timeout"),
        (
            ConsumerOptions,
            {
                "ack_timeout": "30",
                "ack_timeout_redelivery_backoff": pigeon.client.MultiplierRedeliveryBackoff(),
            },
            "ack_timeout",
        ),
        (ReaderOptions, {"read_compacted": 1}, "read_compacted"),
        (ProducerOptions, {"chunking_enabled": "false"}, "chunking_enabled"),
        (ProducerOptions, {"batching_enabled": "false"}, "batching_enabled"),
        (ProducerOptions, {"chunk_max_message_size": True}, "chunk_max_message_size"),
    ],
)
def test_a_bad_option_type_raises_invalid_argument_naming_it(
    options: Any, kwargs: dict[str, Any], named: str
) -> None:
    args = ("t", "s") if options is ConsumerOptions else ("t",)
    with pytest.raises(InvalidArgument, match=rf"^{named} must be"):
        options(*args, **kwargs)


def test_a_backoff_delay_is_a_number_not_a_bool() -> None:
    with pytest.raises(InvalidArgument, match=r"^min_delay must be"):
        pigeon.client.MultiplierRedeliveryBackoff(min_delay=True)


@pytest.mark.parametrize(
    ("url", "addresses"),
    [
        ("pigeon://127.0.0.1:6650", [("127.0.0.1", 6650)]),
        ("pigeon://h1:1,h2:65535/", [("h1", 1), ("h2", 65535)]),
        ("pigeon://[::1]:6650", [("::1", 6650)]),
        ("pigeon://example", [("example", 6650)]),
        ("pigeon+ssl://example", [("example", 6651)]),
    ],
)
def test_service_url_addresses(url: str, addresses: list[tuple[str, int]]) -> None:
    assert parse_service_urls(url) == addresses


@pytest.mark.parametrize(
    "url",
    [
        "pigeon://127.0.0.1:99999",
        "pigeon://127.0.0.1:0",
        "pigeon://127.0.0.1:-1",
        "pigeon://127.0.0.1:port",
        "pigeon://127.0.0.1:",
        "pigeon://[::1",
        "pigeon://host:6650/path",
    ],
)
def test_a_bad_host_port_in_a_service_url_is_refused_at_once(url: str) -> None:
    """``-u pigeon://127.0.0.1:99999`` or ``pigeon://[::1`` retried until the operation
    timeout; the URL is refused when parsed, naming the bad part."""
    with pytest.raises(InvalidArgument, match="in service URL"):
        parse_service_urls(url)
