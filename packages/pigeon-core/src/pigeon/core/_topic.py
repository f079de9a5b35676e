"""Topic names: ``persistent://tenant/namespace/topic``, ``non-persistent://...``, or bare."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pigeon.core.errors import InvalidArgument, InvalidSubscriptionName, InvalidTopicName

__all__ = ["MAX_NAME_LENGTH", "TopicName", "check_name", "check_subscription_name"]

_PART = re.compile(r"[A-Za-z0-9_.\-=:]+")
#: a subscription name: the topic alphabet and ``%`` (Kafka group ids are percent-encoded)
_SUBSCRIPTION = re.compile(r"[A-Za-z0-9_.\-=:%]+")
#: the longest tenant, namespace, topic or subscription name (characters)
MAX_NAME_LENGTH = 255


def _shown(name: str) -> str:
    """``name`` as an error message quotes it: a long one is cut, its length said apart."""
    return repr(name) if len(name) <= 60 else repr(name[:40]) + "..."


def check_name(kind: str, name: str) -> str:
    """``name`` if it is a valid ``kind`` name (``tenant``, ``namespace`` or ``topic``: one
    part of a topic name), else an error saying the rule: InvalidTopicName for a topic,
    InvalidArgument for a tenant or namespace.

    The rule: 1 to 255 characters (:data:`MAX_NAME_LENGTH`), each an ASCII letter or
    digit or one of ``_ . - = :``, and neither ``.`` nor ``..`` (a topic's
    ``-partition-N`` suffix is not counted: see :meth:`TopicName.parse`).
    """
    error = InvalidTopicName if kind == "topic" else InvalidArgument
    if not isinstance(name, str) or not name:
        raise error(f"invalid {kind} name {name!r}: empty")
    if len(name) > MAX_NAME_LENGTH:
        raise error(
            f"invalid {kind} name {_shown(name)}: it is {len(name)} characters long,"
            f" at most {MAX_NAME_LENGTH} are allowed"
        )
    if not _PART.fullmatch(name):
        raise error(
            f"invalid {kind} name {_shown(name)}: it may only hold ASCII letters, digits"
            " and _ . - = :"
        )
    if name in (".", ".."):
        raise error(f"invalid {kind} name {name!r}: a {kind} name may not be . or ..")
    return name


def check_subscription_name(name: str) -> str:
    """``name`` if it is a valid subscription name, else InvalidSubscriptionName.

    The rule: 1 to 255 characters (:data:`MAX_NAME_LENGTH`), each a letter or digit
    (ASCII) or one of ``_ . - = : %``, and neither ``.`` nor ``..`` -- the topic name
    alphabet plus ``%``, through which a Kafka consumer group id of any characters
    maps to a subscription (``pigeon.broker``'s ``subscription_of``).
    """
    if not isinstance(name, str) or not name:
        raise InvalidSubscriptionName(f"invalid subscription name {name!r}: empty")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidSubscriptionName(
            f"invalid subscription name {_shown(name)}: it is {len(name)} characters long,"
            f" at most {MAX_NAME_LENGTH} are allowed"
        )
    if not _SUBSCRIPTION.fullmatch(name) or name in (".", ".."):
        raise InvalidSubscriptionName(
            f"invalid subscription name {_shown(name)}: it may only hold ASCII letters, digits"
            " and _ . - = : % (and is not . or ..)"
        )
    return name


_PARTITION = re.compile(r"^(?P<base>.+)-partition-(?P<n>\d+)$")
DEFAULT_TENANT = "public"
DEFAULT_NAMESPACE = "default"


@dataclass(frozen=True, slots=True)
class TopicName:
    """A parsed topic name.

    >>> TopicName.parse("events").full
    'persistent://public/default/events'
    >>> TopicName.parse("events").partition(2).full
    'persistent://public/default/events-partition-2'
    """

    persistent: bool
    tenant: str
    namespace: str
    local: str

    @classmethod
    def parse(cls, name: str) -> TopicName:
        if not isinstance(name, str) or not name:
            raise InvalidTopicName(f"invalid topic name {name!r}: empty")
        persistent = True
        rest = name
        if "://" in name:
            scheme, _, rest = name.partition("://")
            if scheme == "persistent":
                persistent = True
            elif scheme == "non-persistent":
                persistent = False
            else:
                raise InvalidTopicName(
                    f"invalid topic name {name!r}: domain must be persistent or non-persistent"
                )
            parts = rest.split("/")
            if len(parts) != 3:
                raise InvalidTopicName(
                    f"invalid topic name {name!r}: expected domain://tenant/namespace/topic"
                )
        else:
            parts = rest.split("/")
            if len(parts) == 1:
                parts = [DEFAULT_TENANT, DEFAULT_NAMESPACE, parts[0]]
            elif len(parts) != 3:
                raise InvalidTopicName(
                    f"invalid topic name {name!r}: use 'topic' or 'tenant/namespace/topic'"
                )
        for what, part in zip(("tenant", "namespace", "topic"), parts, strict=True):
            # a partition's "-partition-N" suffix is not counted: every partition of a
            # topic whose name is allowed is reachable
            counted = part
            m = _PARTITION.match(part) if what == "topic" else None
            if m and len(m.group("n")) <= 10:
                counted = m.group("base")
            if len(counted) > MAX_NAME_LENGTH:
                raise InvalidTopicName(
                    f"invalid topic name {_shown(name)}: the {what} name is {len(counted)}"
                    f" characters long, at most {MAX_NAME_LENGTH} are allowed"
                )
            if not _PART.fullmatch(part):
                raise InvalidTopicName(
                    f"invalid topic name {_shown(name)}: {_shown(part)} may only hold ASCII"
                    " letters, digits and _ . - = :"
                )
            if part in (".", ".."):
                raise InvalidTopicName(
                    f"invalid topic name {_shown(name)}: the {what} name may not be {part!r}"
                )
        return cls(persistent, parts[0], parts[1], parts[2])

    @property
    def domain(self) -> str:
        return "persistent" if self.persistent else "non-persistent"

    @property
    def namespace_name(self) -> str:
        return f"{self.tenant}/{self.namespace}"

    @property
    def full(self) -> str:
        return f"{self.domain}://{self.tenant}/{self.namespace}/{self.local}"

    @property
    def path(self) -> str:
        """Metadata-store path fragment: ``persistent/tenant/namespace/topic``."""
        return f"{self.domain}/{self.tenant}/{self.namespace}/{self.local}"

    def partition(self, index: int) -> TopicName:
        local = f"{self.local}-partition-{index}"
        return TopicName(self.persistent, self.tenant, self.namespace, local)

    @property
    def partition_index(self) -> int:
        """The partition number, or -1 when this is not a partition of a partitioned topic."""
        m = _PARTITION.match(self.local)
        return int(m.group("n")) if m else -1

    @property
    def base(self) -> TopicName:
        m = _PARTITION.match(self.local)
        if not m:
            return self
        return TopicName(self.persistent, self.tenant, self.namespace, m.group("base"))

    def __str__(self) -> str:
        return self.full
