"""Who may call the admin API: 401 without valid credentials, 403 without the right."""

from __future__ import annotations

import logging

import pytest
from secure_admin_support import SecureAdminStandalone

from pigeon.broker._admin import make_app
from pigeon.broker._admin_auth import RULES
from pigeon.core import tokens
from pigeon.core.errors import AuthenticationError

API = "/admin/v2"


def test_every_route_has_an_access_rule() -> None:
    from types import SimpleNamespace

    from fastapi.routing import APIRoute

    app = make_app(SimpleNamespace())  # type: ignore[arg-type]
    every = []
    for route in app.routes:  # FastAPI >= 0.120 keeps an included router as one route
        every += getattr(getattr(route, "original_router", None), "routes", [route])
    routes = {
        (method, route.path)
        for route in every
        if isinstance(route, APIRoute) and route.path.startswith((API, "/metrics"))
        for method in route.methods
    }
    assert routes == set(RULES)


@pytest.mark.parametrize(
    "credentials",
    ["none", "garbage", "expired", "wrong-signature", "basic-scheme", "empty-bearer"],
)
def test_bad_credentials_are_401_with_bearer_challenge(
    secure_admin: SecureAdminStandalone, credentials: str, caplog: pytest.LogCaptureFixture
) -> None:
    s = secure_admin
    headers: dict[str, str] = {}
    secret = "not-a-token-" + "x" * 20
    if credentials == "garbage":
        headers["Authorization"] = f"Bearer {secret}"
    elif credentials == "expired":
        secret = s.token("admin", expiry_s=-60)
        headers["Authorization"] = f"Bearer {secret}"
    elif credentials == "wrong-signature":
        secret = s.token("admin", key=tokens.create_secret_key())
        headers["Authorization"] = f"Bearer {secret}"
    elif credentials == "basic-scheme":
        headers["Authorization"] = f"Basic {secret}"
    elif credentials == "empty-bearer":
        headers["Authorization"] = "Bearer "
    caplog.set_level(logging.DEBUG)
    status, body, rh = s.http_call("GET", f"{API}/tenants", headers=headers)
    assert status == 401
    assert rh["www-authenticate"] == "Bearer"
    assert body["error"] == "AuthenticationError"
    assert body["code"] == AuthenticationError.code
    assert body["message"] and "\n" not in body["message"]
    assert secret not in str(body)
    assert secret not in caplog.text
    if credentials == "expired":
        assert "expired" in body["message"]


def test_superuser_may_do_everything(secure_admin: SecureAdminStandalone) -> None:
    s = secure_admin
    status, body, _ = s.http_call("GET", f"{API}/tenants", role="admin")
    assert status == 200 and {"ta", "tb", "public"} <= set(body)
    for path in ("/brokers", "/bookies", "/broker-stats/topics", "/namespaces/tb/ns/policies"):
        assert s.http_call("GET", API + path, role="admin")[0] == 200, path


@pytest.mark.parametrize(
    ("method", "path", "words"),
    [
        ("GET", "/tenants", "list tenants"),
        ("PUT", "/tenants/new-one", "create tenants"),
        ("DELETE", "/tenants/tb", "delete tenants"),
        ("GET", "/brokers", "list brokers"),
        ("GET", "/bookies", "list bookies"),
        ("GET", "/broker-stats/throughput", "read broker stats"),
    ],
)
def test_tenant_admin_is_403_on_cluster_operations(
    secure_admin: SecureAdminStandalone, method: str, path: str, words: str
) -> None:
    status, body, _ = secure_admin.http_call(method, API + path, role="alice")
    assert status == 403
    assert body["error"] == "AuthorizationError"
    assert body["message"] == f"role 'alice' may not {words} (it needs a superuser role)"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/tenants/{t}"),
        ("GET", "/namespaces/{t}"),
        ("GET", "/namespaces/{t}/ns/policies"),
        ("PATCH", "/namespaces/{t}/ns/policies"),
        ("GET", "/namespaces/{t}/ns/topics"),
        ("GET", "/namespaces/{t}/ns/permissions"),
        ("PUT", "/topics/persistent/{t}/ns/events"),
        ("GET", "/topics/persistent/{t}/ns/events/stats"),
    ],
)
def test_tenant_admin_only_on_own_tenant(
    secure_admin: SecureAdminStandalone, method: str, path: str
) -> None:
    s = secure_admin
    body = {} if method == "PATCH" else None
    own, _, _ = s.http_call(method, API + path.format(t="ta"), body, role="alice")
    assert own in (200, 201, 404), own  # allowed (the topic may not exist yet)
    status, err, _ = s.http_call(method, API + path.format(t="tb"), body, role="alice")
    assert status == 403
    assert "role 'alice' may not" in err["message"]
    assert "admin role of tenant 'tb'" in err["message"]
    status, _, _ = s.http_call(method, API + path.format(t="ta"), body, role="carol")
    assert status == 403


def test_health_openapi_and_dashboard_stay_open(secure_admin: SecureAdminStandalone) -> None:
    s = secure_admin
    status, _, _ = s.http_call("GET", f"{API}/cluster/health")
    assert status in (200, 503)  # not 401: orchestrators probe it without credentials
    assert s.http_call("GET", "/openapi.json")[0] == 200
    status, html, _ = s.http_call("GET", "/dashboard")
    assert status == 200 and "login" in html.lower()


def test_the_open_health_probe_tells_an_anonymous_caller_only_the_status(
    secure_admin: SecureAdminStandalone,
) -> None:
    """Without credentials the probe answers status and pass/fail per check, not what
    the superuser-only routes guard (broker addresses, process ids, load)."""
    s = secure_admin
    for headers in ({}, {"Authorization": "Bearer garbage"}):
        status, body, _ = s.http_call("GET", f"{API}/cluster/health", headers=headers)
        assert status in (200, 503)
        assert body["status"] in ("ok", "degraded", "unhealthy")
        assert body["brokers"] == [] and body["topics"] is None and body["connections"] is None
        assert all(set(check) == {"ok"} for check in body["checks"].values())
    status, full, _ = s.http_call("GET", f"{API}/cluster/health", role="carol")
    assert status in (200, 503)
    assert full["brokers"][0]["service_url"] and isinstance(full["connections"], int)


def test_metrics_need_authentication(secure_admin: SecureAdminStandalone) -> None:
    s = secure_admin
    status, _, rh = s.http_call("GET", "/metrics")
    assert status == 401 and rh["www-authenticate"] == "Bearer"
    status, text, _ = s.http_call("GET", "/metrics", role="carol")
    assert status == 200 and "pigeon_" in text


def test_a_tenant_created_here_applies_at_once(secure_admin: SecureAdminStandalone) -> None:
    s = secure_admin
    assert s.http_call("GET", f"{API}/tenants/tc", role="dave")[0] == 403  # cached: none
    status, _, _ = s.http_call("PUT", f"{API}/tenants/tc", {"admin_roles": ["dave"]}, role="admin")
    assert status == 201
    status, body, _ = s.http_call("GET", f"{API}/tenants/tc", role="dave")
    assert status == 200 and body["admin_roles"] == ["dave"]


@pytest.mark.parametrize("roles", [["has space"], [""], ["x" * 300], ["ok", "new\nline"]])
def test_tenant_admin_roles_are_validated(
    secure_admin: SecureAdminStandalone, roles: list[str]
) -> None:
    status, body, _ = secure_admin.http_call(
        "PUT", f"{API}/tenants/bad-roles", {"admin_roles": roles}, role="admin"
    )
    assert status == 422
    assert body["message"].startswith("body.admin_roles.")


def test_updating_admin_roles_applies_at_once(secure_admin: SecureAdminStandalone) -> None:
    s = secure_admin
    s.http_call("PUT", f"{API}/tenants/td", {"admin_roles": ["gina"]}, role="admin")
    assert s.http_call("GET", f"{API}/namespaces/td", role="gina")[0] == 200
    assert s.http_call("GET", f"{API}/namespaces/td", role="hank")[0] == 403
    status, body, _ = s.http_call(
        "POST", f"{API}/tenants/td", {"admin_roles": ["hank"]}, role="gina"
    )
    assert status == 403 and "update tenants" in body["message"]
    status, body, _ = s.http_call(
        "POST", f"{API}/tenants/td", {"admin_roles": ["hank"]}, role="admin"
    )
    assert status == 200 and body == {
        "tenant": "td",
        "admin_roles": ["hank"],
        "allowed_clusters": [],
    }
    assert s.http_call("GET", f"{API}/namespaces/td", role="hank")[0] == 200
    assert s.http_call("GET", f"{API}/namespaces/td", role="gina")[0] == 403
    status, _, _ = s.http_call(
        "POST", f"{API}/tenants/td", {"admin_roles": ["two words"]}, role="admin"
    )
    assert status == 422
    assert s.http_call("POST", f"{API}/tenants/nope", {}, role="admin")[0] == 404


async def test_metrics_may_be_opened_by_the_operator() -> None:
    from types import SimpleNamespace

    from starlette.requests import Request

    from pigeon.broker._admin_auth import authorize_request
    from pigeon.broker._config import BrokerConfig
    from pigeon.core.auth import Authenticator, TokenAuthenticationProvider

    def request() -> Request:
        return Request({"type": "http", "method": "GET", "path": "/metrics", "headers": []})

    service = SimpleNamespace(
        authenticator=Authenticator([TokenAuthenticationProvider(b"k" * 32)]),
        config=BrokerConfig(),
    )
    with pytest.raises(AuthenticationError):
        await authorize_request(service, request())  # type: ignore[arg-type]
    service.config = BrokerConfig(authenticate_metrics_endpoint=False)
    assert await authorize_request(service, request()) is None  # type: ignore[arg-type]
