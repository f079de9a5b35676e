"""TopicName.parse and partition naming."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pigeon.core import MAX_NAME_LENGTH, TopicName, check_name, check_subscription_name
from pigeon.core.errors import InvalidArgument, InvalidSubscriptionName, InvalidTopicName


def test_bare_name_goes_to_public_default() -> None:
    t = TopicName.parse("events")
    assert t.full == "persistent://public/default/events"
    assert str(t) == t.full
    assert (t.persistent, t.tenant, t.namespace, t.local) == (True, "public", "default", "events")
    assert t.domain == "persistent"
    assert t.namespace_name == "public/default"
    assert t.path == "persistent/public/default/events"


def test_tenant_namespace_topic() -> None:
    t = TopicName.parse("acme/billing/invoices")
    assert t.full == "persistent://acme/billing/invoices"
    assert t.namespace_name == "acme/billing"


def test_full_persistent_name() -> None:
    t = TopicName.parse("persistent://acme/billing/invoices")
    assert t == TopicName.parse("acme/billing/invoices")


def test_non_persistent() -> None:
    t = TopicName.parse("non-persistent://acme/live/ticks")
    assert not t.persistent
    assert t.domain == "non-persistent"
    assert t.full == "non-persistent://acme/live/ticks"
    assert t.path == "non-persistent/acme/live/ticks"
    assert t != TopicName.parse("persistent://acme/live/ticks")


def test_allowed_characters() -> None:
    t = TopicName.parse("a-b_c.d=e:f/ns.1/Topic-2_x")
    assert (t.tenant, t.namespace, t.local) == ("a-b_c.d=e:f", "ns.1", "Topic-2_x")


def test_names_are_hashable_values() -> None:
    assert len({TopicName.parse("x"), TopicName.parse("persistent://public/default/x")}) == 1


def test_partition_naming() -> None:
    t = TopicName.parse("orders")
    p = t.partition(3)
    assert p.full == "persistent://public/default/orders-partition-3"
    assert p.partition_index == 3
    assert p.base == t
    assert t.partition_index == -1
    assert t.base is t


def test_parsed_partition_name() -> None:
    p = TopicName.parse("non-persistent://a/b/my-topic-partition-12")
    assert p.partition_index == 12
    assert p.base.full == "non-persistent://a/b/my-topic"
    assert not p.base.persistent


@pytest.mark.parametrize(
    "local", ["orders-partition-", "orders-partition-x", "partition-1", "orders-partition-1a"]
)
def test_not_a_partition(local: str) -> None:
    t = TopicName.parse(local)
    assert t.partition_index == -1
    assert t.base == t


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "empty"),
        ("kafka://a/b/c", "domain must be persistent or non-persistent"),
        ("://a/b/c", "domain"),
        ("persistent://a/b", "tenant/namespace/topic"),
        ("persistent://a/b/c/d", "tenant/namespace/topic"),
        ("persistent://events", "tenant/namespace/topic"),
        ("a/b", "'topic' or 'tenant/namespace/topic'"),
        ("a/b/c/d", "'topic' or 'tenant/namespace/topic'"),
        ("my topic", "may only hold"),
        ("a/b/c?x=1", "may only hold"),
        ("persistent://a//c", "may only hold"),
        ("a/b/", "may only hold"),
        ("tëst", "may only hold ASCII letters, digits and _ . - = :"),
        ("events\n", "may only hold"),  # a trailing newline is not part of a name
        ("a\n/b/c", "may only hold"),
        ("x" * 256, "the topic name is 256 characters long, at most 255 are allowed"),
        ("t" * 300 + "/ns/x", "the tenant name is 300 characters long, at most 255"),
        (".", "the topic name may not be '.'"),
        ("..", "the topic name may not be '..'"),
        ("persistent://public/default/..", "the topic name may not be '..'"),
        ("../default/x", "the tenant name may not be '..'"),
        ("public/./x", "the namespace name may not be '.'"),
        ("x" * 256 + "-partition-0", "the topic name is 256 characters long"),
    ],
)
def test_invalid_names(name: str, reason: str) -> None:
    with pytest.raises(InvalidTopicName) as info:
        TopicName.parse(name)
    message = str(info.value)
    assert reason in message
    # the bad input is quoted back (its start, when it is long)
    assert repr(name) in message or repr(name[:40]) in message


def test_non_string_is_invalid() -> None:
    with pytest.raises(InvalidTopicName):
        TopicName.parse(None)  # type: ignore[arg-type]


def test_invalid_topic_name_is_an_invalid_argument() -> None:
    """Callers that catch bad input in general also catch bad topic names."""
    with pytest.raises(InvalidArgument):
        TopicName.parse("a/b")
    assert not InvalidTopicName.retriable


_part = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-=:",
    min_size=1,
    max_size=30,
).filter(lambda part: part not in (".", ".."))


@given(persistent=st.booleans(), tenant=_part, namespace=_part, local=_part)
def test_full_name_round_trips(persistent: bool, tenant: str, namespace: str, local: str) -> None:
    t = TopicName(persistent, tenant, namespace, local)
    assert TopicName.parse(t.full) == t
    assert TopicName.parse(str(t.partition(7))).partition_index == 7
    assert t.partition(7).base == t


def test_every_partition_of_a_longest_name_is_a_valid_name() -> None:
    """A partitioned topic of a 255-letter name: its partitions (longer by their
    ``-partition-N`` suffix) can be produced to, so the limit counts the base name."""
    base = TopicName.parse("x" * MAX_NAME_LENGTH)
    for index in (0, 4095):
        partition = TopicName.parse(base.partition(index).full)
        assert partition.partition_index == index
        assert partition.base == base


def test_a_long_name_is_cut_in_the_error() -> None:
    with pytest.raises(InvalidTopicName) as info:
        TopicName.parse("x" * 256)
    assert len(str(info.value)) < 160  # one line a person reads, not the 256 letters


@pytest.mark.parametrize("name", ["sub", "my-sub_1.v2:x=y", "my%20group", "x" * 255])
def test_valid_subscription_names(name: str) -> None:
    assert check_subscription_name(name) == name


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "empty"),
        ("my sub", "may only hold ASCII letters, digits and _ . - = : %"),
        ("a/b", "may only hold"),
        ("tëst", "may only hold ASCII letters, digits and _ . - = :"),
        ("sub\n", "may only hold"),
        ("..", "is not . or .."),
        ("s" * 256, "it is 256 characters long, at most 255 are allowed"),
    ],
)
def test_invalid_subscription_names(name: str, reason: str) -> None:
    with pytest.raises(InvalidSubscriptionName) as info:
        check_subscription_name(name)
    assert reason in str(info.value)
    assert isinstance(info.value, InvalidArgument)


@pytest.mark.parametrize(
    ("kind", "name", "reason"),
    [
        ("tenant", "", "empty"),
        ("tenant", "café", "invalid tenant name 'café': it may only hold ASCII letters"),
        ("namespace", "a b", "invalid namespace name 'a b': it may only hold ASCII letters"),
        ("namespace", "..", "invalid namespace name '..': a namespace name may not be . or .."),
        ("tenant", ".", "a tenant name may not be . or .."),
        ("tenant", "t" * 256, "it is 256 characters long, at most 255 are allowed"),
    ],
)
def test_tenant_and_namespace_names_follow_the_topic_rule(
    kind: str, name: str, reason: str
) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(reason)):
        check_name(kind, name)
    with pytest.raises(InvalidTopicName):
        check_name("topic", name)
    assert check_name(kind, "ok-1.x=y:z") == "ok-1.x=y:z"
