"""Pulsar's permission endpoints: grant, list and revoke per namespace and per topic, and
the subscription auth mode; the grants decide what a role may do at once."""

from __future__ import annotations

from typing import Any

import pytest
from secure_admin_support import SecureAdminStandalone

from pigeon.core import TopicName
from pigeon.core.errors import AuthorizationError

API = "/admin/v2"
NS = f"{API}/namespaces/ta/ns"


def _may(s: SecureAdminStandalone, check: str, role: str, topic: str, *args: Any) -> bool:
    assert s.service is not None
    fn = getattr(s.service.authorization, check)
    try:
        s.call(fn, role, TopicName.parse(topic), *args)
    except AuthorizationError:
        return False
    return True


def test_namespace_grant_list_revoke_round_trip(secure_admin: SecureAdminStandalone) -> None:
    s = secure_admin
    topic = "persistent://ta/ns/orders"
    assert not _may(s, "check_produce", "carol", topic)
    status, _, _ = s.http_call("POST", f"{NS}/permissions/carol", ["produce"], role="alice")
    assert status == 204
    status, body, _ = s.http_call("GET", f"{NS}/permissions", role="alice")
    assert status == 200 and body == {"carol": ["produce"]}
    assert _may(s, "check_produce", "carol", topic)
    assert not _may(s, "check_consume", "carol", topic, "sub")
    # a grant replaces what the role had
    s.http_call("POST", f"{NS}/permissions/carol", ["consume", "produce"], role="admin")
    assert s.http_call("GET", f"{NS}/permissions", role="admin")[1] == {
        "carol": ["consume", "produce"]
    }
    assert s.http_call("DELETE", f"{NS}/permissions/carol", role="alice")[0] == 204
    assert s.http_call("GET", f"{NS}/permissions", role="alice")[1] == {}
    assert not _may(s, "check_produce", "carol", topic)
    status, body, _ = s.http_call("DELETE", f"{NS}/permissions/carol", role="alice")
    assert status == 404 and "carol" in body["message"]


def test_other_tenants_admin_may_not_grant(secure_admin: SecureAdminStandalone) -> None:
    s = secure_admin
    status, body, _ = s.http_call("POST", f"{NS}/permissions/bob", ["produce"], role="bob")
    assert status == 403
    assert body["message"] == (
        "role 'bob' may not grant permissions (it needs an admin role of tenant 'ta')"
    )


@pytest.mark.parametrize("actions", [["fly"], [], "produce", ["produce", 3]])
def test_bad_actions_are_refused_in_one_line(
    secure_admin: SecureAdminStandalone, actions: Any
) -> None:
    status, body, _ = secure_admin.http_call(
        "POST", f"{NS}/permissions/carol", actions, role="alice"
    )
    assert status == 422
    assert "\n" not in body["message"] and body["message"].startswith("body")


def test_grant_on_a_missing_namespace_is_404(secure_admin: SecureAdminStandalone) -> None:
    path = f"{API}/namespaces/ta/nope/permissions/carol"
    assert secure_admin.http_call("POST", path, ["produce"], role="alice")[0] == 404


@pytest.mark.parametrize(
    "base",
    [f"{API}/topics/persistent/ta/ns/payments", f"{API}/persistent/ta/ns/payments"],
)
def test_topic_grant_list_revoke(secure_admin: SecureAdminStandalone, base: str) -> None:
    s = secure_admin
    topic = "persistent://ta/ns/payments"
    assert s.http_call("POST", f"{base}/permissions/erin", ["consume"], role="alice")[0] == 204
    status, body, _ = s.http_call("GET", f"{base}/permissions", role="alice")
    assert status == 200 and body["erin"] == ["consume"]
    assert _may(s, "check_consume", "erin", topic, "s")
    assert _may(s, "check_consume", "erin", topic + "-partition-1", "s")
    assert not _may(s, "check_consume", "erin", "persistent://ta/ns/other", "s")
    assert s.http_call("DELETE", f"{base}/permissions/erin", role="alice")[0] == 204
    assert "erin" not in s.http_call("GET", f"{base}/permissions", role="alice")[1]
    assert not _may(s, "check_consume", "erin", topic, "s")
    status, _, _ = s.http_call("POST", f"{base}/permissions/erin", ["consume"], role="bob")
    assert status == 403


def test_subscription_auth_mode(secure_admin: SecureAdminStandalone) -> None:
    s = secure_admin
    topic = "persistent://ta/ns/modes"
    s.http_call("POST", f"{NS}/permissions/frank", ["consume"], role="alice")
    assert _may(s, "check_consume", "frank", topic, "any-sub")
    status, _, _ = s.http_call("POST", f"{NS}/subscriptionAuthMode", "Prefix", role="alice")
    assert status == 204
    assert s.http_call("GET", f"{NS}/policies", role="alice")[1]["subscription_auth_mode"] == (
        "prefix"
    )
    assert not _may(s, "check_consume", "frank", topic, "any-sub")
    assert _may(s, "check_consume", "frank", topic, "frank-sub")
    status, _, _ = s.http_call(
        "PATCH", f"{NS}/policies", {"subscription_auth_mode": "none"}, role="alice"
    )
    assert status == 200
    assert _may(s, "check_consume", "frank", topic, "any-sub")
    status, body, _ = s.http_call("POST", f"{NS}/subscriptionAuthMode", "Sometimes", role="alice")
    assert status == 422 and "Prefix" in body["message"]
    assert s.http_call("POST", f"{NS}/subscriptionAuthMode", "None", role="bob")[0] == 403
