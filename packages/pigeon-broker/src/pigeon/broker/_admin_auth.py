"""Who may call which admin route: authentication (``Authorization: Bearer <token>``) and
authorization (superuser or tenant admin) of the admin HTTP API.

Every route of the API has one rule in :data:`RULES`, keyed by method and path template:

* ``open`` — anyone (the cluster health probe orchestrators poll, the OpenAPI document,
  the dashboard's static files); without valid credentials the health probe says only
  whether each check passed, not the brokers, their addresses or the load
  (:func:`identified`);
* ``authenticated`` — any role the broker's authenticator accepts (``/metrics``, unless
  ``authenticate_metrics_endpoint = false``: Pulsar's ``authenticateMetricsEndpoint``);
* ``superuser`` — tenants (list, create, update, delete), brokers, bookies, broker statistics;
* ``tenant`` — an admin role of the ``{tenant}`` in the path (or a superuser):
  namespaces, their policies and permissions, topics and subscriptions.

A route without a rule is refused (fail closed).  When ``service.authenticator`` is None
(authentication off) nobody is asked for credentials and the role is None; authorization
is a no-op while ``service.authorization.enabled`` is off.  A missing, malformed, expired
or wrongly signed token is :class:`AuthenticationError` (401, with
``WWW-Authenticate: Bearer``); a known role without the right is
:class:`AuthorizationError` (403) naming the role and the action.  The token never appears
in an answer or a log line.
"""

from __future__ import annotations

from typing import Final, Literal

from fastapi import Request

from pigeon.broker._service import BrokerService
from pigeon.core.auth import AuthData
from pigeon.core.errors import AuthenticationError, AuthorizationError

__all__ = ["RULES", "authorize_request", "identified", "request_role"]

Kind = Literal["open", "authenticated", "superuser", "tenant"]

_A = "/admin/v2"
_NS = _A + "/namespaces/{tenant}/{namespace}"
_T = _A + "/topics/{domain}/{tenant}/{namespace}/{topic}"
_S = _T + "/subscriptions/{subscription}"
_P = _A + "/persistent/{tenant}/{namespace}/{topic}"  # Pulsar's topic paths


def _rules() -> dict[tuple[str, str], tuple[Kind, str]]:
    rules: dict[tuple[str, str], tuple[Kind, str]] = {
        ("GET", _A + "/cluster/health"): ("open", "read the cluster health"),
        ("GET", "/metrics"): ("authenticated", "read the metrics"),
        ("GET", _A + "/tenants"): ("superuser", "list tenants"),
        ("PUT", _A + "/tenants/{tenant}"): ("superuser", "create tenants"),
        ("POST", _A + "/tenants/{tenant}"): ("superuser", "update tenants"),
        ("DELETE", _A + "/tenants/{tenant}"): ("superuser", "delete tenants"),
        ("GET", _A + "/tenants/{tenant}"): ("tenant", "read the tenant"),
        ("GET", _A + "/namespaces/{tenant}"): ("tenant", "list namespaces"),
        ("PUT", _NS): ("tenant", "create namespaces"),
        ("DELETE", _NS): ("tenant", "delete namespaces"),
        ("GET", _NS + "/policies"): ("tenant", "read namespace policies"),
        ("PATCH", _NS + "/policies"): ("tenant", "change namespace policies"),
        ("GET", _NS + "/topics"): ("tenant", "list topics"),
        ("GET", _NS + "/bundles"): ("tenant", "list bundles"),
        ("POST", _NS + "/bundles/{bundle}/unload"): ("tenant", "unload bundles"),
        ("GET", _NS + "/permissions"): ("tenant", "read permissions"),
        ("POST", _NS + "/permissions/{role}"): ("tenant", "grant permissions"),
        ("DELETE", _NS + "/permissions/{role}"): ("tenant", "revoke permissions"),
        ("POST", _NS + "/subscriptionAuthMode"): ("tenant", "set the subscription auth mode"),
        ("PUT", _T): ("tenant", "create topics"),
        ("GET", _T): ("tenant", "read topics"),
        ("DELETE", _T): ("tenant", "delete topics"),
        ("GET", _T + "/stats"): ("tenant", "read topic stats"),
        ("GET", _T + "/internal-stats"): ("tenant", "read topic stats"),
        ("POST", _T + "/unload"): ("tenant", "unload topics"),
        ("PUT", _T + "/offload"): ("tenant", "offload topics"),
        ("GET", _T + "/offload"): ("tenant", "read topic stats"),
        ("PUT", _T + "/compaction"): ("tenant", "compact topics"),
        ("GET", _T + "/compaction"): ("tenant", "read topic stats"),
        ("GET", _T + "/subscriptions"): ("tenant", "list subscriptions"),
        ("PUT", _S): ("tenant", "create subscriptions"),
        ("GET", _S): ("tenant", "read subscriptions"),
        ("DELETE", _S): ("tenant", "delete subscriptions"),
        ("POST", _S + "/reset-cursor"): ("tenant", "reset cursors"),
        ("POST", _S + "/skip"): ("tenant", "skip messages"),
        ("POST", _S + "/clear-backlog"): ("tenant", "clear backlogs"),
        ("GET", _S + "/peek"): ("tenant", "peek messages"),
        ("GET", _A + "/brokers"): ("superuser", "list brokers"),
        ("GET", _A + "/brokers/{broker}/load"): ("superuser", "read broker load"),
        ("GET", _A + "/brokers/{broker}/bundles"): ("superuser", "list a broker's bundles"),
        ("GET", _A + "/broker-stats/topics"): ("superuser", "read broker stats"),
        ("GET", _A + "/broker-stats/throughput"): ("superuser", "read broker stats"),
        ("GET", _A + "/bookies"): ("superuser", "list bookies"),
        ("GET", _A + "/bookies/{bookie}"): ("superuser", "read bookies"),
    }
    _SC = _A + "/schemas/{tenant}/{namespace}/{topic}"  # Pulsar's schema paths
    rules[("GET", _SC + "/schema")] = ("tenant", "read schemas")
    rules[("GET", _SC + "/schema/{version}")] = ("tenant", "read schemas")
    rules[("GET", _SC + "/versions/{version}")] = ("tenant", "read schemas")
    rules[("GET", _SC + "/schemas")] = ("tenant", "read schemas")
    rules[("POST", _SC + "/schema")] = ("tenant", "upload schemas")
    rules[("DELETE", _SC + "/schema")] = ("tenant", "delete schemas")
    rules[("POST", _SC + "/compatibility")] = ("tenant", "read schemas")
    for base in (_T, _P):
        rules[("GET", base + "/permissions")] = ("tenant", "read permissions")
        rules[("POST", base + "/permissions/{role}")] = ("tenant", "grant permissions")
        rules[("DELETE", base + "/permissions/{role}")] = ("tenant", "revoke permissions")
    return rules


#: (method, path template) -> (who may call it, what it does in words for a denial)
RULES: Final = _rules()


def request_role(service: BrokerService, request: Request) -> str | None:
    """The role of the request's credentials; None when authentication is off."""
    authenticator = service.authenticator
    if authenticator is None:
        return None
    client = request.scope.get("client") or ("", 0)
    address = f"{client[0]}:{client[1]}"
    # the HTTPS listener puts the verified client certificate in the connection's state
    peer = request.scope.get("state", {}).get("peer_certificate")
    header = request.headers.get("authorization")
    if header is None:
        if peer and "tls" in authenticator.providers:
            return authenticator.authenticate(AuthData("tls", b"", peer, address))
        raise AuthenticationError(
            "authentication is required: send the header 'Authorization: Bearer <token>'"
        )
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthenticationError("the Authorization header must be 'Bearer <token>'")
    return authenticator.authenticate(
        AuthData("token", token.encode("latin-1", errors="replace"), peer, address)
    )


def identified(service: BrokerService, request: Request) -> bool:
    """Does ``request`` carry valid credentials (always, with authentication off)?  An
    ``open`` route answers an anonymous caller less (the health probe: its status only)."""
    try:
        request_role(service, request)
    except AuthenticationError:
        return False
    return True


async def authorize_request(service: BrokerService, request: Request) -> str | None:
    """Authenticate and authorize ``request`` by its route's rule; its role (None when
    authentication is off).  Raises AuthenticationError / AuthorizationError."""
    route = request.scope.get("route")
    template = getattr(route, "path", request.url.path)
    rule = RULES.get((request.method, template))
    if rule is None:  # fail closed: a route added without a rule
        raise AuthorizationError(f"no access rule for {request.method} {template}")
    kind, action = rule
    if kind == "authenticated" and not service.config.authenticate_metrics_endpoint:
        kind = "open"  # only /metrics is "authenticated": the operator opened it
    if kind == "open":
        return None
    role = request_role(service, request)
    authorization = service.authorization
    if kind == "superuser":
        authorization.check_superuser(role, action)
    elif kind == "tenant":
        await authorization.check_tenant_admin(role, request.path_params["tenant"], action)
    request.state.role = role
    return role
