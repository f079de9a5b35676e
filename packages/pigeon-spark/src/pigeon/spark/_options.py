"""Option parsing and validation for the ``pigeon`` format. No I/O, no Spark.

Spark hands a data source its options with lower-cased names; every name is matched
case-insensitively and reported in the spelling the documentation uses. Problems are
collected and raised together as one :class:`OptionError` naming every bad option, so a
user fixes them in one go.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pigeon.core import TopicName
from pigeon.core.errors import InvalidTopicName

__all__ = [
    "EARLIEST",
    "ClientSecurity",
    "LATEST",
    "OptionError",
    "SinkOptions",
    "SourceOptions",
    "check_names",
    "parse_sink_options",
    "parse_source_options",
]

#: In offsets JSON, like Spark's Kafka source: -2 = earliest available, -1 = latest.
EARLIEST = -2
LATEST = -1

#: credentials and TLS of the client, with pigeon-client's (Pulsar's) keyword names
_SECURITY = (
    "auth_token",
    "auth_token_file",
    "tls_trust_certs_file_path",
    "tls_allow_insecure_connection",
)
#: the same in camelCase, as Pulsar's Spark connector spells client settings
_SECURITY_CAMEL = {
    "authToken": "auth_token",
    "authTokenFile": "auth_token_file",
    "tlsTrustCertsFilePath": "tls_trust_certs_file_path",
    "tlsAllowInsecureConnection": "tls_allow_insecure_connection",
}
_SOURCE = (
    "service_url",
    *_SECURITY,
    "topic",
    "topics",
    "topicsPattern",
    "startingOffsets",
    "endingOffsets",
    "startingTimestamp",
    "maxOffsetsPerTrigger",
    "minPartitions",
    "failOnDataLoss",
    "includeProperties",
    "decodeSchema",
    "pollTimeoutMs",
)
_SINK = ("service_url", *_SECURITY, "topic", "writeOrder")
#: Spark passes these to sinks on its own (writeStream's checkpointLocation, queryName).
_SPARK = ("checkpointLocation", "queryName")
_STREAM_ONLY = ("maxOffsetsPerTrigger",)
_BATCH_ONLY = ("endingOffsets",)

CANONICAL = {name.lower(): name for name in (*_SOURCE, *_SINK, *_SPARK)}
CANONICAL.update((camel.lower(), snake) for camel, snake in _SECURITY_CAMEL.items())


class OptionError(ValueError):
    """One or more options of the ``pigeon`` format are unknown, conflicting or invalid."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("pigeon: " + "; ".join(problems))


def _canonical(options: Mapping[str, str]) -> dict[str, str]:
    return {CANONICAL.get(k.lower(), k): v for k, v in options.items()}


def check_names(options: Mapping[str, str]) -> None:
    """Fail on option names neither the source nor the sink knows."""
    unknown = sorted(k for k in options if k.lower() not in CANONICAL)
    if unknown:
        known = ", ".join(sorted({*_SOURCE, *_SINK}, key=str.lower))
        raise OptionError([f"unknown option(s) {', '.join(unknown)} (known: {known})"])


def _bool(opts: dict[str, str], name: str, default: bool, problems: list[str]) -> bool:
    raw = opts.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    problems.append(f"{name} must be true or false, got {raw!r}")
    return default


def _int(opts: dict[str, str], name: str, problems: list[str], *, minimum: int) -> int | None:
    raw = opts.get(name)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        problems.append(f"{name} must be an integer, got {raw!r}")
        return None
    if value < minimum:
        problems.append(f"{name} must be at least {minimum}, got {value}")
        return None
    return value


def _service_url(opts: dict[str, str], problems: list[str]) -> str:
    url = opts.get("service_url", "").strip()
    if not url:
        problems.append("service_url is required (e.g. pigeon://127.0.0.1:6650)")
    elif not url.startswith(("pigeon://", "pigeon+ssl://")):
        problems.append(
            f"service_url must look like pigeon://host:port or pigeon+ssl://host:port, got {url!r}"
        )
    return url


@dataclass(frozen=True)
class ClientSecurity:
    """The client's credentials and TLS settings (the ``auth_token``,
    ``auth_token_file``, ``tls_trust_certs_file_path`` and
    ``tls_allow_insecure_connection`` options).  Its repr never shows the token."""

    auth_token: str = field(default="", repr=False)
    auth_token_file: str = ""
    tls_trust_certs_file_path: str = ""
    tls_allow_insecure_connection: bool = False

    def client_keywords(self) -> dict[str, Any]:
        """The ``pigeon.client.Client`` keywords (a token file is read again for each
        new connection, so a rotated token is picked up)."""
        from pigeon.core.auth import AuthenticationToken

        authentication = None
        if self.auth_token_file:
            authentication = AuthenticationToken(Path(self.auth_token_file))
        elif self.auth_token:
            authentication = AuthenticationToken(self.auth_token)
        return {
            "authentication": authentication,
            "tls_trust_certs_file_path": self.tls_trust_certs_file_path or None,
            "tls_allow_insecure_connection": self.tls_allow_insecure_connection,
        }


def _security(opts: dict[str, str], problems: list[str]) -> ClientSecurity:
    token, token_file = opts.get("auth_token", ""), opts.get("auth_token_file", "").strip()
    if token and token_file:
        problems.append("give auth_token or auth_token_file, not both")
    return ClientSecurity(
        auth_token=token.strip(),
        auth_token_file=token_file,
        tls_trust_certs_file_path=opts.get("tls_trust_certs_file_path", "").strip(),
        tls_allow_insecure_connection=_bool(opts, "tls_allow_insecure_connection", False, problems),
    )


def _topic(name: str, option: str, problems: list[str]) -> str:
    try:
        return TopicName.parse(name.strip()).full
    except InvalidTopicName as exc:
        problems.append(f"{option}: {exc}")
        return name


OffsetSpec = Literal["earliest", "latest"] | dict[str, int]


def _offsets(
    opts: dict[str, str], name: str, problems: list[str], *, allowed: tuple[str, ...]
) -> OffsetSpec | None:
    raw = opts.get(name)
    if raw is None:
        return None
    text = raw.strip()
    if text.lower() in allowed:
        return "earliest" if text.lower() == "earliest" else "latest"
    try:
        doc = json.loads(text)
    except ValueError:
        words = " or ".join(repr(a) for a in allowed)
        problems.append(
            f"{name} must be {words} or a JSON object of partition offsets, got {raw!r}"
        )
        return None
    if not isinstance(doc, dict) or not doc:
        problems.append(f"{name} JSON must be a non-empty object {{partition topic: offset}}")
        return None
    out: dict[str, int] = {}
    for topic, offset in doc.items():
        full = _topic(str(topic), name, problems)
        lowest = EARLIEST if "earliest" in allowed else LATEST
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < lowest:
            meaning = "-2 (earliest), -1 (latest)" if lowest == EARLIEST else "-1 (latest)"
            problems.append(
                f"{name}: offset of {topic} must be an integer >= 0 or {meaning}, got {offset!r}"
            )
            continue
        out[full] = offset
    return out


@dataclass(frozen=True)
class SourceOptions:
    service_url: str
    #: exactly one of these is set
    topics: tuple[str, ...] = ()
    pattern: str | None = None
    starting: OffsetSpec | None = None
    ending: OffsetSpec | None = None
    starting_timestamp: int | None = None
    max_offsets_per_trigger: int | None = None
    min_partitions: int | None = None
    fail_on_data_loss: bool = True
    include_properties: bool = False
    #: AVRO/JSON schema topics: ``value`` is the decoded record, ``data`` the bytes
    decode_schema: bool = True
    poll_timeout_ms: int = 30_000
    security: ClientSecurity = ClientSecurity()

    @property
    def pattern_namespace(self) -> str:
        """``tenant/namespace`` a ``topicsPattern`` lists topics of."""
        assert self.pattern is not None
        m = re.match(r"^\^?(?:persistent|non-persistent)://([^/]+)/([^/]+)/", self.pattern)
        assert m is not None  # checked when parsed
        return f"{m.group(1)}/{m.group(2)}"


def _begin(
    options: Mapping[str, str], allowed: Collection[str], other_side: str
) -> tuple[dict[str, str], list[str], str]:
    """Canonical options, the problems found so far, and the service URL of one read/write."""
    check_names(options)
    opts = _canonical(options)
    problems: list[str] = []
    url = _service_url(opts, problems)
    extra = sorted(k for k in opts if k not in allowed and k not in _SPARK)
    if extra:
        problems.append(f"option(s) {', '.join(extra)} only apply to {other_side}")
    return opts, problems, url


def parse_source_options(
    options: Mapping[str, str], *, mode: Literal["any", "batch", "stream"] = "any"
) -> SourceOptions:
    """Validate the options of a read (``mode``: which kind, if known yet)."""
    opts, problems, url = _begin(options, _SOURCE, "writing")
    security = _security(opts, problems)

    chosen = [k for k in ("topic", "topics", "topicsPattern") if k in opts]
    topics: tuple[str, ...] = ()
    pattern: str | None = None
    if len(chosen) != 1:
        problems.append(
            "give exactly one of topic, topics, topicsPattern"
            + (f" (got {', '.join(chosen)})" if chosen else "")
        )
    elif chosen[0] == "topic":
        topics = (_topic(opts["topic"], "topic", problems),)
    elif chosen[0] == "topics":
        names = [t for t in opts["topics"].split(",") if t.strip()]
        if not names:
            problems.append("topics must list at least one topic (comma-separated)")
        topics = tuple(dict.fromkeys(_topic(t, "topics", problems) for t in names))
    else:
        pattern = opts["topicsPattern"]
        try:
            re.compile(pattern)
        except re.error as exc:
            problems.append(f"topicsPattern is not a valid regular expression: {exc}")
        if not re.match(r"^\^?(?:persistent|non-persistent)://[^/]+/[^/]+/", pattern):
            problems.append(
                "topicsPattern must start with persistent://tenant/namespace/ "
                f"(it matches full topic names), got {pattern!r}"
            )

    starting = _offsets(opts, "startingOffsets", problems, allowed=("earliest", "latest"))
    ending = _offsets(opts, "endingOffsets", problems, allowed=("latest",))
    timestamp = _int(opts, "startingTimestamp", problems, minimum=0)
    if starting is not None and timestamp is not None:
        problems.append("startingOffsets and startingTimestamp conflict: give one of them")
    max_per_trigger = _int(opts, "maxOffsetsPerTrigger", problems, minimum=1)
    min_partitions = _int(opts, "minPartitions", problems, minimum=1)
    poll = _int(opts, "pollTimeoutMs", problems, minimum=1)
    fail = _bool(opts, "failOnDataLoss", True, problems)
    props = _bool(opts, "includeProperties", False, problems)
    decode = _bool(opts, "decodeSchema", True, problems)

    if mode == "stream":
        wrong = [k for k in _BATCH_ONLY if k in opts]
        if wrong:
            problems.append(f"{', '.join(wrong)} only apply to batch reads, not streaming")
    elif mode == "batch":
        wrong = [k for k in _STREAM_ONLY if k in opts]
        if wrong:
            problems.append(f"{', '.join(wrong)} only apply to streaming reads, not batch")
        if isinstance(starting, dict) and LATEST in starting.values():
            problems.append("startingOffsets: -1 (latest) is not allowed in a batch read")
        if starting == "latest":
            problems.append("startingOffsets=latest is not allowed in a batch read")
    if isinstance(ending, dict) and EARLIEST in ending.values():
        problems.append("endingOffsets: -2 (earliest) is not allowed")

    if problems:
        raise OptionError(problems)
    return SourceOptions(
        service_url=url,
        topics=topics,
        pattern=pattern,
        starting=starting,
        ending=ending,
        starting_timestamp=timestamp,
        max_offsets_per_trigger=max_per_trigger,
        min_partitions=min_partitions,
        fail_on_data_loss=fail,
        include_properties=props,
        decode_schema=decode,
        poll_timeout_ms=poll or 30_000,
        security=security,
    )


@dataclass(frozen=True)
class SinkOptions:
    service_url: str
    #: the ``topic`` option: overrides a ``topic`` column
    topic: str | None = None
    #: streaming sink: number rows in input order, or sorted (see pigeon.spark._sink)
    write_order: Literal["input", "sorted"] = "input"
    security: ClientSecurity = ClientSecurity()


def parse_sink_options(options: Mapping[str, str]) -> SinkOptions:
    """Validate the options of a write (batch or streaming)."""
    opts, problems, url = _begin(options, _SINK, "reading")
    security = _security(opts, problems)
    topic = _topic(opts["topic"], "topic", problems) if "topic" in opts else None
    order = opts.get("writeOrder", "input").strip().lower()
    if order not in ("input", "sorted"):
        problems.append(f"writeOrder must be input or sorted, got {opts['writeOrder']!r}")
    if problems:
        raise OptionError(problems)
    return SinkOptions(
        service_url=url,
        topic=topic,
        write_order="sorted" if order == "sorted" else "input",
        security=security,
    )
