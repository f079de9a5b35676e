"""The admin REST API's request and answer models and path parameter types (pydantic),
which make its OpenAPI document (see :mod:`pigeon.broker._admin`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Body, Path, Query
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from pigeon.broker._schema_compat import CompatibilityStrategy, SchemaType

__all__ = [
    "CompactionStatus",
    "OffloadDamage",
    "OffloadStatus",
    "Bookie",
    "BrokerInfo",
    "BrokerLoad",
    "Bundle",
    "CursorPosition",
    "Domain",
    "ERRORS",
    "Force",
    "Health",
    "InternalStats",
    "LoadedTopic",
    "NamePart",
    "TopicPart",
    "POSITION",
    "PeekedMessage",
    "Policies",
    "PoliciesChange",
    "ResetCursor",
    "Skip",
    "Skipped",
    "NewSubName",
    "SubName",
    "SubscriptionStatsOut",
    "Tenant",
    "TenantOut",
    "ThroughputSample",
    "TopicMetadata",
    "TopicStats",
    "Unloaded",
]


_NAME = r"^[A-Za-z0-9_.\-=:]+$"
#: a tenant or namespace (pigeon.core.check_name): the topic-name alphabet, not "." or ".."
_N, _M = r"[A-Za-z0-9_.\-=:]", r"[A-Za-z0-9_\-=:]"
NAME_PART = rf"^({_M}{_N}*|\.{_M}{_N}*|\.\.{_N}+)$"
NamePart = Annotated[str, Path(pattern=NAME_PART, max_length=255)]
#: a topic's local name: a partition's "-partition-N" suffix (up to 21 characters) is not
#: counted against the 255 (TopicName.parse holds the exact rule)
TopicPart = Annotated[str, Path(pattern=_NAME, max_length=255 + 21)]
Domain = Annotated[Literal["persistent", "non-persistent"], Path(description="Topic domain.")]
#: segment:entry[:index] as peek shows it
MESSAGE_ID = r"^[0-9]{1,18}:[0-9]{1,18}(:[0-9]{1,9})?$"
#: no "/", no control character, not "." or ".." (they are metadata path components)
_C, _D = r"[^\x00-\x1f\x7f/]", r"[^\x00-\x1f\x7f/.]"
SUB_NAME = rf"^({_D}{_C}*|\.{_D}{_C}*|\.\.{_C}+)$"
SubName = Annotated[
    str, Path(min_length=1, max_length=255, pattern=SUB_NAME, description="Subscription name.")
]
#: a new subscription's name (pigeon.core.check_subscription_name): the topic-name
#: alphabet and "%", not "." or ".."; SubName is looser so older names stay reachable
_S, _T = r"[A-Za-z0-9_.\-=:%]", r"[A-Za-z0-9_\-=:%]"
NEW_SUB_NAME = rf"^({_T}{_S}*|\.{_T}{_S}*|\.\.{_S}+)$"
NewSubName = Annotated[
    str,
    Path(min_length=1, max_length=255, pattern=NEW_SUB_NAME, description="Subscription name."),
]
POSITION = r"^(earliest|latest|[0-9]{1,18}|[0-9]{1,18}:[0-9]{1,18}(:[0-9]{1,9})?)$"
Force = Annotated[
    bool, Query(description="Detach connected producers/consumers (or delete contents) first.")
]
MAX_SECONDS = 10 * 365 * 86400.0
#: largest integer every JSON client represents exactly
MAX_INT = 2**53
#: every request body: unknown fields are refused, and so are NaN and ±Infinity (Python's
#: JSON parser accepts ``NaN``, ``Infinity`` and ``1e999``; none is a valid value here)
_INPUT = ConfigDict(extra="forbid", allow_inf_nan=False)


class ErrorBody(BaseModel):
    error: str = Field(description="Error class, e.g. TopicNotFound.")
    message: str
    code: int | None = Field(None, description="PigeonMQ wire code of the error class.")
    retriable: bool = False
    detail: list[dict[str, Any]] | None = Field(None, description="Validation errors (422).")


#: a role: no white space (the same in Python's and JSON Schema's regular expressions)
ROLE_PATTERN = r"^[^\s\x1c-\x1f\x85]+$"
Role = Annotated[str, Field(min_length=1, max_length=256, pattern=ROLE_PATTERN)]


#: role -> actions (``produce``, ``consume``, ...), as Pulsar's permissions answers
Permissions = dict[str, list[str]]


#: a role in a URL path
RolePath = Annotated[
    str, Path(min_length=1, max_length=256, pattern=ROLE_PATTERN, description="A role.")
]
#: what a permission may allow (``pigeon.broker._authz.ACTIONS``)
Action = Literal["produce", "consume", "functions", "sources", "sinks", "packages"]
#: a grant's body: the actions, as Pulsar's grant-permission sends them
Actions = Annotated[
    list[Action],
    Body(description='Actions, e.g. ["produce", "consume"].', min_length=1, max_length=16),
]
#: Pulsar's body of subscriptionAuthMode: a JSON string
AuthMode = Annotated[
    Literal["None", "Prefix", "none", "prefix"], Body(description='"None" or "Prefix".')
]


class Tenant(BaseModel):
    model_config = _INPUT
    admin_roles: list[Role] = Field(
        default_factory=list, max_length=1000, description="Roles that administer the tenant."
    )
    allowed_clusters: list[str] = Field(default_factory=list)


class TenantOut(Tenant):
    tenant: str


class SchemaIn(BaseModel):
    """A schema as Pulsar's admin API takes it (``PostSchemaPayload``)."""

    model_config = _INPUT
    type: SchemaType
    schema_: str = Field(
        "",
        alias="schema",
        max_length=1 << 20,
        description="The Avro record schema (JSON text) of JSON and AVRO.",
    )
    properties: dict[str, str] = Field(default_factory=dict)


class SchemaOut(BaseModel):
    """One version of a topic's schema (Pulsar's ``GetSchemaResponse``)."""

    version: int
    type: str
    schema_: str = Field(alias="schema")
    timestamp: int = 0
    properties: dict[str, str] = Field(default_factory=dict)


class SchemaVersions(BaseModel):
    getSchemaResponses: list[SchemaOut]


class SchemaVersion(BaseModel):
    version: int


class DeletedSchema(BaseModel):
    version: int = Field(description="The last version deleted.")


class SchemaCompatibility(BaseModel):
    """Pulsar's ``IsCompatibilityResponse``."""

    compatibility: bool
    schemaCompatibilityStrategy: str
    reason: str = ""


class Policies(BaseModel):
    """Namespace policies (see ``pigeon.broker._policies.NamespacePolicies``)."""

    retention_time_s: float = Field(description="-1 forever, 0 delete once consumed.")
    retention_size_mb: float = Field(description="-1 no size limit.")
    message_ttl_s: float = Field(description="0 off.")
    backlog_quota_bytes: int = Field(description="-1 no quota.")
    backlog_quota_policy: Literal[
        "producer_request_hold", "producer_exception", "consumer_backlog_eviction"
    ]
    deduplication: bool
    ensemble_size: int | None
    write_quorum: int | None
    ack_quorum: int | None
    max_message_size: int | None
    corrupt_entry_policy: Literal["skip", "fail"] | None = Field(
        None, description="At an entry no replica holds intact; null: the broker's setting."
    )
    subscription_auth_mode: Literal["none", "prefix"] = Field(
        "none", description="prefix: a role may only use subscriptions named role*."
    )
    offload_threshold_bytes: int = Field(
        -1, description="Offload closed segments past this many bytes on bookies; -1 off."
    )
    offload_deletion_lag_s: float = Field(
        4 * 3600.0, description="Bookie copies of offloaded segments go this long after."
    )
    schema_compatibility_strategy: CompatibilityStrategy = Field(
        "full", description="How a new schema version must relate to the stored ones."
    )
    is_allow_auto_update_schema: bool = Field(
        True, description="A producer's new compatible schema becomes a new version."
    )
    schema_validation_enforced: bool = Field(
        False, description="A producer without a schema is refused on a topic with one."
    )
    compaction_threshold: int = Field(
        0, description="Compact topics with more bytes than this since the last compaction; 0 off."
    )


class PoliciesChange(BaseModel):
    """Any subset of the policies; fields left out keep their value (or the default).

    ``null`` means "the broker's default" for the replication settings and the size
    limit; for the other fields it is the same as leaving the field out.
    """

    model_config = _INPUT
    # "X | SkipJsonSchema[None]": the document says X (null is not part of the API), and
    # the constraints sit on X so that they appear in the document.
    retention_time_s: Annotated[float, Field(ge=-1, le=MAX_SECONDS)] | SkipJsonSchema[None] = None
    retention_size_mb: Annotated[float, Field(ge=-1, le=1e12)] | SkipJsonSchema[None] = None
    message_ttl_s: Annotated[float, Field(ge=0, le=MAX_SECONDS)] | SkipJsonSchema[None] = None
    backlog_quota_bytes: Annotated[int, Field(ge=-1, le=MAX_INT)] | SkipJsonSchema[None] = None
    backlog_quota_policy: (
        Literal["producer_request_hold", "producer_exception", "consumer_backlog_eviction"]
        | SkipJsonSchema[None]
    ) = None
    deduplication: bool | SkipJsonSchema[None] = None
    ensemble_size: Annotated[int, Field(ge=1, le=64)] | None = Field(
        None, description="null: the broker's default"
    )
    write_quorum: Annotated[int, Field(ge=1, le=64)] | None = None
    ack_quorum: Annotated[int, Field(ge=1, le=64)] | None = None
    max_message_size: Annotated[int, Field(ge=1, le=2**31)] | None = None
    corrupt_entry_policy: Literal["skip", "fail"] | None = Field(
        None, description="skip (go on past a damaged entry) or fail; null: the broker's"
    )
    subscription_auth_mode: Literal["none", "prefix"] | SkipJsonSchema[None] = None
    offload_threshold_bytes: Annotated[int, Field(ge=-1, le=MAX_INT)] | SkipJsonSchema[None] = None
    offload_deletion_lag_s: Annotated[float, Field(ge=0, le=MAX_SECONDS)] | SkipJsonSchema[None] = (
        None
    )
    schema_compatibility_strategy: CompatibilityStrategy | SkipJsonSchema[None] = None
    is_allow_auto_update_schema: bool | SkipJsonSchema[None] = None
    schema_validation_enforced: bool | SkipJsonSchema[None] = None
    compaction_threshold: Annotated[int, Field(ge=0, le=MAX_INT)] | SkipJsonSchema[None] = None

    def changes(self) -> dict[str, Any]:
        nullable = {
            "ensemble_size",
            "write_quorum",
            "ack_quorum",
            "max_message_size",
            "corrupt_entry_policy",
        }
        return {
            k: v
            for k, v in self.model_dump(exclude_unset=True).items()
            if v is not None or k in nullable
        }


class TopicMetadata(BaseModel):
    topic: str
    persistent: bool
    partitions: int = Field(description="0 for a non-partitioned topic.")
    loaded: int = Field(description="Partitions (or 1 for the topic) loaded on this broker.")


class SubscriptionStats(BaseModel):
    name: str
    type: str
    durable: bool
    consumers: int
    backlog: int = Field(description="Unacknowledged messages.")
    backlog_bytes: int
    mark_delete_offset: int | None
    msgs_out: int
    bytes_out: int
    msg_rate_out: float
    msg_throughput_out: float
    delayed: int
    dropped: int
    consumer_names: list[str]
    lost_messages: int = Field(
        0, description="Messages skipped because no replica holds their entry intact."
    )
    read_error: str | None = Field(
        None, description="Why delivery is stopped (corrupt_entry_policy 'fail'); null: it is not."
    )


class SubscriptionStatsOut(SubscriptionStats):
    topic: str


class TopicSummary(BaseModel):
    topic: str
    persistent: bool
    partitions: int
    msgs_in: int
    bytes_in: int
    msgs_out: int
    bytes_out: int
    msg_rate_in: float
    msg_throughput_in: float = Field(description="Bytes per second.")
    msg_rate_out: float
    msg_throughput_out: float
    producers: int
    producer_names: list[str]
    next_offset: int | None
    first_offset: int | None
    storage_size: int = Field(description="Bytes in the topic's segments.")
    segments: int
    backlog: int = Field(description="Largest subscription backlog (messages).")
    backlog_bytes: int
    corrupt_entries: int = Field(
        0, description="Entries found on no replica intact (damaged or lost) since loaded."
    )


class LoadedTopic(TopicSummary):
    subscription_count: int


class TopicStats(TopicSummary):
    subscriptions: dict[str, SubscriptionStats]
    partition_stats: dict[str, TopicStats] | None = None


class Segment(BaseModel):
    id: int
    first_offset: int
    entries: int
    last_entry_id: int
    size: int
    state: str
    ensemble: list[str]
    ctime: float
    last_publish_time: int
    offload: dict[str, Any] | None = Field(
        None, description="Where the offloader stored the segment; null: only on bookies."
    )
    bookies_deleted: bool = Field(False, description="Offloaded, and gone from the bookies.")
    offload_pending: dict[str, Any] | None = Field(
        None,
        description="An upload started and not recorded yet (driver, key); null: none.",
    )


class CursorInternal(BaseModel):
    mark_delete_offset: int
    acked_ranges: list[list[int]]
    read_position: list[int] | None
    pending_entries: int
    durable: bool


class CacheStats(BaseModel):
    hits: int
    misses: int
    bytes: int


class InternalStats(BaseModel):
    topic: str
    persistent: bool
    next_offset: int
    first_offset: int | None = None
    last_position: list[int] | None = None
    segments: list[Segment]
    cursors: dict[str, CursorInternal]
    cache: CacheStats | None
    compacted_ledger: dict[str, Any] | None = Field(
        None, description="The compacted ledger (id, horizon, entries, ...); null: none."
    )
    compaction_horizon: int | None = Field(
        None, description="Offsets below it are in the compacted view."
    )
    offload_deleting: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Offloaded objects of removed segments not deleted yet (retried by"
        " each maintenance pass).",
    )


class ResetCursor(BaseModel):
    """Exactly one of ``offset``, ``message_id`` (``segment:entry[:index]``), ``timestamp``."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        json_schema_extra={"minProperties": 1, "maxProperties": 1},
    )
    offset: Annotated[int, Field(ge=0, le=MAX_INT)] | SkipJsonSchema[None] = None
    message_id: Annotated[str, Field(pattern=MESSAGE_ID)] | SkipJsonSchema[None] = None
    timestamp: Annotated[int, Field(ge=0, le=MAX_INT)] | SkipJsonSchema[None] = Field(
        None, description="Publish time, ms since the epoch."
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> ResetCursor:
        if sum(v is not None for v in (self.offset, self.message_id, self.timestamp)) != 1:
            raise ValueError("give exactly one of offset, message_id, timestamp")
        return self


class CursorPosition(BaseModel):
    topic: str
    subscription: str
    mark_delete_offset: int
    backlog: int


class Skip(BaseModel):
    model_config = _INPUT
    count: int = Field(ge=0, le=MAX_INT, description="Messages to acknowledge.")


class Skipped(BaseModel):
    topic: str
    subscription: str
    skipped: int


class PeekedMessage(BaseModel):
    topic: str
    message_id: str = Field(description="segment:entry:index")
    offset: int
    publish_time: int
    event_time: int | None
    producer_name: str
    sequence_id: int
    key: str | None
    key_encoding: Literal["utf-8", "base64"]
    properties: dict[str, str]
    value: str | None
    value_encoding: Literal["utf-8", "base64"]
    size: int
    redelivery_count: int


class BrokerInfo(BaseModel):
    broker: str = Field(description="host:port of its client listener")
    service_url: str | None
    http_url: str | None
    cluster: str
    pid: int | None


class BrokerLoad(BaseModel):
    """This broker's live load; for another broker, its last load report (fewer fields)."""

    broker: str
    topics: int | None
    connections: int | None
    msgs_in: int | None
    producers: int | None = None
    subscriptions: int | None = None
    consumers: int | None = None
    msg_rate_in: float | None = None
    msg_throughput_in: float | None = None
    msg_rate_out: float | None = None
    msg_throughput_out: float | None = None
    cpu_seconds: float | None = None
    max_rss_bytes: int | None = None
    bundles: int | None = None


class Bundle(BaseModel):
    namespace: str
    bundle: str = Field(description="0xSTART_0xEND of the topic-name hash range")
    owner: str | None = Field(description="The owning broker; null: assigned at next lookup")
    loaded_topics: int


class OffloadDamage(BaseModel):
    """A segment the offloader skips: an entry of it is on no replica intact."""

    segment: int
    entry: int = Field(description="The first entry found damaged.")
    error: str = Field(description="Why the segment could not be read whole.")
    attempts: int = Field(description="Offloads tried since it was found damaged.")
    retry_in_s: float = Field(description="Seconds until it is tried again (backoff).")


class CompactionStatus(BaseModel):
    """How the last compaction of a topic went (Pulsar's LongRunningProcessStatus)."""

    status: Literal["NOT_RUN", "RUNNING", "SUCCESS", "ERROR"]
    last_error: str = Field("", description="Why the last run failed (ERROR).")
    compacted_ledger: int | None = Field(None, description="Id of the compacted ledger.")
    horizon: int | None = Field(None, description="Offsets below it are compacted.")


class OffloadStatus(BaseModel):
    """A topic's tiered storage (Pulsar's OffloadProcessStatus and more)."""

    status: Literal["NOT_RUN", "RUNNING", "SUCCESS", "ERROR"]
    last_error: str = Field("", description="Why the last run failed (ERROR).")
    offloaded_segments: int = Field(description="Segments stored by the offloader.")
    offloaded_bytes: int
    bookie_only_bytes: int = Field(description="Bytes of segments not offloaded (yet).")
    first_unoffloaded_message_id: str | None = Field(
        None,
        description="segment:entry of the first entry not offloaded (segments after it"
        " may be offloaded: see damaged_segments).",
    )
    damaged_segments: list[OffloadDamage] = Field(
        default_factory=list,
        description="Segments not offloaded because an entry is on no replica intact:"
        " they stay on their bookies and are retried with backoff; later ones are"
        " offloaded.",
    )


class Unloaded(BaseModel):
    unloaded: list[str]


class Bookie(BaseModel):
    address: str
    read_only: bool
    read_only_reason: str | None
    free_disk_bytes: int | None
    total_disk_bytes: int | None
    disk_used_bytes: int | None
    write_bytes_per_s: float | None
    read_bytes_per_s: float | None
    segments: int | None
    reported_at: float | None


class Health(BaseModel):
    status: Literal["ok", "degraded", "unhealthy"]
    cluster: str
    brokers: list[BrokerInfo]
    checks: dict[str, dict[str, Any]]
    #: None (and no brokers) for a caller without credentials when authentication is on
    topics: int | None
    connections: int | None
    time: int


class ThroughputSample(BaseModel):
    time: int
    msg_rate_in: float
    msg_throughput_in: float
    msg_rate_out: float
    msg_throughput_out: float


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "A value is out of its domain."},
    401: {"model": ErrorBody, "description": "No valid credentials (authentication on)."},
    403: {"model": ErrorBody, "description": "The role may not do this (authorization on)."},
    404: {"model": ErrorBody, "description": "No such object."},
    409: {"model": ErrorBody, "description": "Conflict: exists, not empty, or busy."},
    422: {"model": ErrorBody, "description": "The request does not match the schema."},
    503: {"model": ErrorBody, "description": "Metadata store or bookies unavailable."},
}
