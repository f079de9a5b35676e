"""Option parsing and validation for the ``pigeon`` format. No I/O, no Spark.

Spark hands a data source its options with lower-cased names; every name is matched
case-insensitively and reported in the spelling the documentation uses. Problems are
collected and raised together as one :class:`OptionError` naming every bad option, so a
user fixes them in one go.

The names of Spark's Kafka source are accepted where they mean the same thing
(:data:`KAFKA_ALIASES`: ``subscribe`` is ``topics``, ``includeHeaders`` is
``includeProperties``...), and the Kafka source's other read options that have a meaning
here are options of their own (``subscribePattern``, ``endingTimestamp``,
``startingOffsetsByTimestamp``, ``minOffsetsPerTrigger``, ``maxTriggerDelay``,
``maxRecordsPerPartition``). An unknown name gets a "did you mean" from the known ones.
"""

from __future__ import annotations

import difflib
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
    "KAFKA_ALIASES",
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
    "subscribePattern",
    "startingOffsets",
    "endingOffsets",
    "startingTimestamp",
    "startingOffsetsByTimestamp",
    "endingTimestamp",
    "maxOffsetsPerTrigger",
    "minOffsetsPerTrigger",
    "maxTriggerDelay",
    "minPartitions",
    "maxRecordsPerPartition",
    "failOnDataLoss",
    "includeProperties",
    "decodeSchema",
    "pollTimeoutMs",
    "allowAutoTopicCreation",
)
_SINK = ("service_url", *_SECURITY, "topic", "writeOrder")
#: Spark passes these to sinks on its own (writeStream's checkpointLocation, queryName).
_SPARK = ("checkpointLocation", "queryName")
_STREAM_ONLY = ("maxOffsetsPerTrigger", "minOffsetsPerTrigger", "maxTriggerDelay")
_BATCH_ONLY = ("endingOffsets", "endingTimestamp")
#: the topic choices of a read: exactly one is given
_TOPIC_CHOICES = ("topic", "topics", "topicsPattern", "subscribePattern")

#: Spark's Kafka source's name -> the option it means here (the same meaning)
KAFKA_ALIASES = {
    "subscribe": "topics",
    "includeHeaders": "includeProperties",
    "serviceUrl": "service_url",
    "service.url": "service_url",
}

CANONICAL = {name.lower(): name for name in (*_SOURCE, *_SINK, *_SPARK)}
CANONICAL.update((camel.lower(), snake) for camel, snake in _SECURITY_CAMEL.items())
CANONICAL.update((alias.lower(), name) for alias, name in KAFKA_ALIASES.items())
#: every accepted spelling (for "did you mean"), lower-cased -> as documented
_SPELLINGS = {
    name.lower(): name for name in (*_SOURCE, *_SINK, *_SPARK, *_SECURITY_CAMEL, *KAFKA_ALIASES)
}


class OptionError(ValueError):
    """One or more options of the ``pigeon`` format are unknown, conflicting or invalid."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("pigeon: " + "; ".join(problems))


def _only(names: Collection[str], where: str) -> str:
    """``X only applies to ...`` / ``X, Y only apply to ...``."""
    verb = "applies" if len(names) == 1 else "apply"
    return f"{', '.join(names)} only {verb} to {where}"


def _canonical(options: Mapping[str, str], problems: list[str]) -> dict[str, str]:
    """Options by their documented name; two spellings of one option are a problem."""
    out: dict[str, str] = {}
    given: dict[str, str] = {}
    for key, value in options.items():
        name = CANONICAL.get(key.lower(), key)
        if name in out:
            problems.append(f"{given[name]} and {key} are the same option: give one of them")
            continue
        out[name] = value
        given[name] = key
    return out


def _unknown(name: str) -> str:
    """The problem with an option name nobody knows, in the case it was given."""
    lowered = name.lower()
    if lowered == "kafka.bootstrap.servers":
        return (
            f"{name} is the Kafka source's: give service_url (or serviceUrl), the "
            "pigeon://host:port of any broker (its binary port, 6650 by default)"
        )
    if lowered.startswith("kafka."):
        return f"{name} configures a Kafka consumer: the pigeon source has no such setting"
    close = difflib.get_close_matches(lowered, list(_SPELLINGS), n=1, cutoff=0.75)
    hint = f" (did you mean {_SPELLINGS[close[0]]}?)" if close else ""
    return f"unknown option {name}{hint}"


def check_names(options: Mapping[str, str]) -> None:
    """Fail on option names neither the source nor the sink knows (one problem per
    name, with the closest known name when there is one)."""
    unknown = sorted((k for k in options if k.lower() not in CANONICAL), key=str.lower)
    if unknown:
        problems = [_unknown(k) for k in unknown]
        if not any("did you mean" in p or "kafka." in p.lower() for p in problems):
            known = ", ".join(sorted({*_SOURCE, *_SINK, *KAFKA_ALIASES}, key=str.lower))
            problems[-1] += f" (known: {known})"
        raise OptionError(problems)


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


#: units of ``maxTriggerDelay`` (Spark's time strings; a bare number is milliseconds)
_DURATION_UNITS = {
    "": 1,
    "ms": 1,
    "s": 1000,
    "m": 60_000,
    "min": 60_000,
    "h": 3_600_000,
    "d": 86_400_000,
}


def _duration_ms(opts: dict[str, str], name: str, default: int, problems: list[str]) -> int:
    """A time like Spark's ``15m``, ``30s``, ``500ms`` (a bare number: milliseconds)."""
    raw = opts.get(name)
    if raw is None:
        return default
    m = re.fullmatch(r"\s*(\d+)\s*([a-z]*)\s*", raw.lower())
    if m is None or m.group(2) not in _DURATION_UNITS:
        problems.append(f"{name} must be a time such as 15m, 30s or 500ms, got {raw!r}")
        return default
    return int(m.group(1)) * _DURATION_UNITS[m.group(2)]


def _service_url(opts: dict[str, str], problems: list[str]) -> str:
    url = opts.get("service_url", "").strip()
    if not url:
        problems.append("service_url is required (or serviceUrl; e.g. pigeon://127.0.0.1:6650)")
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


def _by_timestamp(opts: dict[str, str], problems: list[str]) -> dict[str, int] | None:
    """``startingOffsetsByTimestamp``: ``{partition topic: ms}``, from Kafka's form
    ``{"topic": {"0": ms, "1": ms}}`` (partition ``0`` of a non-partitioned topic is the
    topic itself, see :func:`pigeon.spark._plan.by_timestamp`) or from
    ``{"topic-partition-0": ms}`` as ``startingOffsets`` keys them."""
    name = "startingOffsetsByTimestamp"
    raw = opts.get(name)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not doc:
        problems.append(
            f'{name} must be a JSON object such as {{"events": {{"0": 1700000000000}}}}, '
            f"got {raw!r}"
        )
        return None
    out: dict[str, int] = {}

    def add(topic: str, ms: Any) -> None:
        if isinstance(ms, bool) or not isinstance(ms, int) or ms < 0:
            problems.append(f"{name}: timestamp of {topic} must be ms since the epoch, got {ms!r}")
            return
        out[_topic(topic, name, problems)] = ms

    for topic, value in doc.items():
        if not isinstance(value, dict):
            add(str(topic), value)
            continue
        for index, ms in value.items():
            if not str(index).lstrip("-").isdigit():
                problems.append(f"{name}: partition of {topic} must be a number, got {index!r}")
            elif int(index) < 0:
                add(str(topic), ms)
            else:
                add(f"{topic}-partition-{int(index)}", ms)
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
    #: ``startingOffsetsByTimestamp``: ``{partition topic: ms}``
    starting_by_timestamp: dict[str, int] | None = None
    #: ``endingTimestamp`` (batch): end each partition at its first message at/after it
    ending_timestamp: int | None = None
    max_offsets_per_trigger: int | None = None
    #: ``minOffsetsPerTrigger``: wait for this many new messages, at most
    #: ``max_trigger_delay_ms`` (``maxTriggerDelay``)
    min_offsets_per_trigger: int | None = None
    max_trigger_delay_ms: int = 15 * 60_000
    min_partitions: int | None = None
    max_records_per_partition: int | None = None
    #: batch: a topic that does not exist reads as empty (and is created) instead of
    #: failing with TopicNotFound
    allow_auto_topic_creation: bool = False
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
    problems: list[str] = []
    opts = _canonical(options, problems)
    url = _service_url(opts, problems)
    extra = sorted(k for k in opts if k not in allowed and k not in _SPARK)
    if extra:
        problems.append(_only(extra, other_side))
    return opts, problems, url


def parse_source_options(
    options: Mapping[str, str], *, mode: Literal["any", "batch", "stream"] = "any"
) -> SourceOptions:
    """Validate the options of a read (``mode``: which kind, if known yet)."""
    opts, problems, url = _begin(options, _SOURCE, "writing")
    security = _security(opts, problems)

    chosen = [k for k in _TOPIC_CHOICES if k in opts]
    topics: tuple[str, ...] = ()
    pattern: str | None = None
    if len(chosen) != 1:
        problems.append(
            "give exactly one of topic, topics, topicsPattern"
            + (
                f" (got {', '.join(chosen)})"
                if chosen
                else " (or Kafka's names for them: subscribe, subscribePattern)"
            )
        )
    elif chosen[0] == "topic":
        topics = (_topic(opts["topic"], "topic", problems),)
    elif chosen[0] == "topics":
        names = [t for t in opts["topics"].split(",") if t.strip()]
        if not names:
            problems.append("topics must list at least one topic (comma-separated)")
        topics = tuple(dict.fromkeys(_topic(t, "topics", problems) for t in names))
    else:
        pattern = opts[chosen[0]]
        if chosen[0] == "subscribePattern" and "://" not in pattern:
            # Kafka's topics have no namespace: a bare pattern is over public/default;
            # a leading ^ (Kafka users write ^orders-.*) would anchor inside the full
            # name and match nothing: the pattern is matched whole anyway
            pattern = f"persistent://public/default/(?:{pattern.removeprefix('^')})"
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
    by_timestamp = _by_timestamp(opts, problems)
    ending_timestamp = _int(opts, "endingTimestamp", problems, minimum=0)
    starts = [
        k
        for k in ("startingOffsets", "startingTimestamp", "startingOffsetsByTimestamp")
        if k in opts
    ]
    if len(starts) > 1:
        problems.append(f"{' and '.join(starts)} conflict: give one of them")
    if "endingOffsets" in opts and "endingTimestamp" in opts:
        problems.append("endingOffsets and endingTimestamp conflict: give one of them")
    max_per_trigger = _int(opts, "maxOffsetsPerTrigger", problems, minimum=1)
    min_per_trigger = _int(opts, "minOffsetsPerTrigger", problems, minimum=1)
    delay = _duration_ms(opts, "maxTriggerDelay", 15 * 60_000, problems)
    if max_per_trigger and min_per_trigger and min_per_trigger > max_per_trigger:
        problems.append(
            f"minOffsetsPerTrigger ({min_per_trigger}) is above maxOffsetsPerTrigger "
            f"({max_per_trigger})"
        )
    min_partitions = _int(opts, "minPartitions", problems, minimum=1)
    max_records = _int(opts, "maxRecordsPerPartition", problems, minimum=1)
    poll = _int(opts, "pollTimeoutMs", problems, minimum=1)
    fail = _bool(opts, "failOnDataLoss", True, problems)
    props = _bool(opts, "includeProperties", False, problems)
    decode = _bool(opts, "decodeSchema", True, problems)
    auto_create = _bool(opts, "allowAutoTopicCreation", False, problems)

    if mode == "stream":
        wrong = [k for k in _BATCH_ONLY if k in opts]
        if wrong:
            problems.append(_only(wrong, "batch reads, not streaming"))
    elif mode == "batch":
        wrong = [k for k in _STREAM_ONLY if k in opts]
        if wrong:
            problems.append(_only(wrong, "streaming reads, not batch"))
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
        starting_by_timestamp=by_timestamp,
        ending_timestamp=ending_timestamp,
        max_offsets_per_trigger=max_per_trigger,
        min_offsets_per_trigger=min_per_trigger,
        max_trigger_delay_ms=delay,
        min_partitions=min_partitions,
        max_records_per_partition=max_records,
        allow_auto_topic_creation=auto_create,
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
