"""How the admin API answers errors: the HTTP status of each error class, the JSON error
body, and the part of a rejected input a 422 answer echoes (see :mod:`pigeon.broker._admin`)."""

from __future__ import annotations

import math
import re
from typing import Any

from pigeon.core import check_name, check_subscription_name
from pigeon.core.errors import (
    AuthenticationError,
    AuthorizationError,
    BadVersion,
    CodecError,
    ConfigError,
    ConnectionClosed,
    ConsumerBusy,
    EntryNotFound,
    IncompatibleSchema,
    InvalidArgument,
    MetadataError,
    NodeExists,
    NoSuchNode,
    NotConfigured,
    NotEmpty,
    NotOwner,
    PigeonError,
    ProducerBlocked,
    ProducerBusy,
    SchemaNotFound,
    SegmentNotFound,
    ServiceUnavailable,
    StorageError,
    SubscriptionBusy,
    SubscriptionNotFound,
    Timeout,
    TopicExists,
    TopicNotFound,
)

__all__ = ["error_body", "error_location", "http_status", "json_safe", "name_rule"]


#: (error classes, HTTP status), first match wins (subclasses before their bases).
_STATUS: tuple[tuple[tuple[type[PigeonError], ...], int], ...] = (
    ((AuthenticationError,), 401),  # answered with "WWW-Authenticate: Bearer"
    ((AuthorizationError,), 403),
    (
        (
            TopicNotFound,
            SubscriptionNotFound,
            NoSuchNode,
            SegmentNotFound,
            EntryNotFound,
            SchemaNotFound,
        ),
        404,
    ),
    (
        (
            TopicExists,
            NodeExists,
            NotEmpty,
            BadVersion,
            ProducerBusy,
            ConsumerBusy,
            SubscriptionBusy,
            NotOwner,  # another broker serves it: ask that one
            NotConfigured,  # e.g. an offload on a broker without an offloader
            IncompatibleSchema,
        ),
        409,
    ),
    ((InvalidArgument, ConfigError, CodecError), 400),
    ((ProducerBlocked,), 429),
    ((Timeout,), 504),
    ((ServiceUnavailable, MetadataError, StorageError, ConnectionClosed), 503),
)


def http_status(exc: PigeonError) -> int:
    """The HTTP status an admin request failing with ``exc`` answers with."""
    for classes, status in _STATUS:
        if isinstance(exc, classes):
            return status
    return 500


def error_body(exc: PigeonError) -> dict[str, Any]:
    return {
        "error": type(exc).__name__,
        "message": exc.message,
        "code": exc.wire_code,
        "retriable": type(exc).retriable,
    }


#: what a 422 answer echoes of the rejected input: long strings and containers are cut
_ECHO_TEXT = 200

_ECHO_ITEMS = 20

_ECHO_DEPTH = 4

#: pydantic's names of union members in an error's "loc" ("constrained-float", "bool")
_TAG = re.compile(r"(constrained-|function-)[\w-]+(\[.*\])?|bool|int|float|str|literal\[.*\]")


def _is_tag(part: Any) -> bool:
    return isinstance(part, str) and _TAG.fullmatch(part) is not None


def _cut(text: str) -> str:
    if len(text) <= _ECHO_TEXT:
        return text
    return f"{text[:_ECHO_TEXT]}... ({len(text)} characters)"


def json_safe(value: Any, depth: int = 0) -> Any:
    """``value`` made JSON-compliant and small: NaN and ±Infinity become the strings
    ``"NaN"``, ``"Infinity"``, ``"-Infinity"``; long strings and containers are cut."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, str):
        return _cut(value)
    if isinstance(value, bytes):
        return _cut(value.decode("utf-8", errors="replace"))
    if isinstance(value, (list, tuple, dict)) and depth >= _ECHO_DEPTH:
        return "..."
    if isinstance(value, (list, tuple)):
        items = [json_safe(v, depth + 1) for v in value[:_ECHO_ITEMS]]
        return [*items, "..."] if len(value) > _ECHO_ITEMS else items
    if isinstance(value, dict):
        out = {_cut(str(k)): json_safe(v, depth + 1) for k, v in list(value.items())[:_ECHO_ITEMS]}
        if len(value) > _ECHO_ITEMS:
            out["..."] = f"{len(value) - _ECHO_ITEMS} more"
        return out
    if value is None or isinstance(value, (bool, int)):
        return value
    return _cut(str(value))


def name_rule(error: dict[str, Any]) -> str | None:
    """The documented name rule (:func:`pigeon.core.check_name`,
    :func:`~pigeon.core.check_subscription_name`) broken by the name a validation
    ``error`` (one of FastAPI's) rejected, when it is a tenant, namespace, topic or
    subscription in the path; None otherwise (or if the rule holds: a looser check)."""
    loc = tuple(error.get("loc") or ())
    value = error.get("input")
    if len(loc) != 2 or loc[0] != "path" or not isinstance(value, str):
        return None
    kind = loc[1]
    try:
        if kind in ("tenant", "namespace", "topic"):
            check_name(kind, value)
        elif kind == "subscription":
            check_subscription_name(value)
    except InvalidArgument as exc:
        return exc.message
    return None


def error_location(loc: Any) -> str:
    """Where in the request a validation error is (FastAPI's ``loc``, type tags left out)."""
    return _cut(".".join(str(p) for p in loc if not _is_tag(p)))
