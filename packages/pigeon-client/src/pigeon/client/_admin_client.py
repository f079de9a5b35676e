"""The admin REST API's small HTTP client (standard library only), under ``pigeon admin``.

:class:`AdminClient` raises :class:`AdminError` carrying the HTTP status and the API's JSON
error; a 401 answer raises :class:`~pigeon.core.errors.AuthenticationError` and a 403
:class:`~pigeon.core.errors.AuthorizationError` (with the server's message), a refused
certificate :class:`~pigeon.core.errors.TlsError`.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pigeon.client._engine import tls_context
from pigeon.core import TopicName
from pigeon.core.auth import AuthenticationTLS, ClientAuthentication
from pigeon.core.errors import AuthenticationError, AuthorizationError, InvalidArgument, TlsError
from pigeon.core.tls import describe_tls_error

__all__ = ["API", "DEFAULT_URL", "AdminClient", "AdminError", "InvalidNamespace"]

DEFAULT_URL = "http://127.0.0.1:8080"
API = "/admin/v2"
F = TypeVar("F", bound=Callable[..., Any])


class AdminError(Exception):
    """The admin API answered with an error status (or could not be reached: status 0)."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status = status
        self.body = body
        super().__init__(f"{status} {body.get('error', 'Error')}: {body.get('message', '')}")


def _q(part: str) -> str:
    return urllib.parse.quote(part, safe="")


def topic_path(topic: str) -> str:
    """``/admin/v2/topics/<domain>/<tenant>/<namespace>/<topic>`` for any topic spelling."""
    t = TopicName.parse(topic)
    return f"{API}/topics/{t.domain}/{_q(t.tenant)}/{_q(t.namespace)}/{_q(t.local)}"


def schema_path(topic: str) -> str:
    """``/admin/v2/schemas/<tenant>/<namespace>/<topic>`` (Pulsar's: no domain, a
    partition's schema is its partitioned topic's)."""
    t = TopicName.parse(topic).base
    return f"{API}/schemas/{_q(t.tenant)}/{_q(t.namespace)}/{_q(t.local)}"


class InvalidNamespace(ValueError):
    """A namespace argument that is not ``tenant/namespace``."""


def namespace_path(namespace: str) -> str:
    tenant, sep, ns = namespace.partition("/")
    if not sep or not tenant or not ns or "/" in ns:
        raise InvalidNamespace(f"namespace must look like tenant/namespace, got {namespace!r}")
    return f"{API}/namespaces/{_q(tenant)}/{_q(ns)}"


def check_admin_url(url: str) -> str:
    """``url`` if it is an ``http://`` or ``https://`` URL with a host, else InvalidArgument
    saying the form it must have (and, for a ``pigeon://`` URL, where the admin API is)."""
    parts: urllib.parse.SplitResult | None = None
    host: str | None = None
    try:
        parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
        host = parts.hostname if parts is not None else None
    except ValueError:  # an unbalanced [ in the host
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not host:
        hint = (
            ": a pigeon:// URL is a broker's client port; the admin API is on its HTTP"
            " port (http://host:8080 by default)"
            if parts is not None and parts.scheme.startswith("pigeon")
            else ""
        )
        raise InvalidArgument(
            f"admin URL {url!r} is not http://host:port or https://host:port{hint}"
        )
    return url


class _NoDowngrade(urllib.request.HTTPRedirectHandler):
    """Follows redirects, but never from https:// to http:// (the ``Authorization``
    header would cross the network in clear)."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: Any,
        code: int,
        msg: str,
        headers: Any,
        newurl: str,
    ) -> urllib.request.Request | None:
        if req.full_url.startswith("https://") and not newurl.startswith("https://"):
            raise TlsError(f"refusing a redirect from https:// to {newurl.split('?')[0]}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class AdminClient:
    """Blocking client of one broker's admin API.

    ``url``: ``http://host:port`` or ``https://host:port``.  ``auth``: credentials sent
    with every request (``AuthenticationToken``: an ``Authorization: Bearer`` header, its
    file read again when it changed; ``AuthenticationTLS``: the client certificate of the
    TLS handshake).  ``tls_trust_certs_file_path``: the CAs that sign the broker's
    certificate (the system's without it); ``tls_validate_hostname`` on by default;
    ``tls_allow_insecure_connection`` accepts any certificate (tests only).
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        timeout: float = 30.0,
        auth: ClientAuthentication | None = None,
        tls_trust_certs_file_path: str | None = None,
        tls_validate_hostname: bool = True,
        tls_allow_insecure_connection: bool = False,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        check_admin_url(url)
        if auth is not None and not isinstance(auth, ClientAuthentication):
            raise InvalidArgument(
                "auth must be AuthenticationToken(...) or AuthenticationTLS(...),"
                f" got {type(auth).__name__}"
            )
        self.auth = auth
        self._tls: ssl.SSLContext | None = None
        if self.url.startswith("https://"):
            self._tls = tls_context(
                auth,
                trust_certs_file=tls_trust_certs_file_path,
                validate_hostname=tls_validate_hostname,
                allow_insecure=tls_allow_insecure_connection,
                what="admin client TLS",
            )
        elif isinstance(auth, AuthenticationTLS):
            raise InvalidArgument(
                "AuthenticationTLS presents its certificate in the TLS handshake: use an"
                " https:// admin URL"
            )
        self._opener = urllib.request.build_opener(
            urllib.request.HTTPSHandler(context=self._tls), _NoDowngrade()
        )

    def _auth_headers(self) -> dict[str, str]:
        auth = self.auth
        if auth is None or auth.auth_method != "token":
            return {}
        return {"Authorization": "Bearer " + auth.auth_data().decode()}

    def __repr__(self) -> str:  # the credentials' own repr never shows a secret
        return f"AdminClient({self.url!r}, auth={self.auth!r})"

    def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: Any = None,
    ) -> Any:
        """Call the API; the decoded JSON (text for non-JSON answers, None for 204)."""
        url = self.url + path
        query = {k: _param(v) for k, v in (params or {}).items() if v is not None}
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Accept": "application/json", **self._auth_headers()}
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                return _decode(resp.status, resp.headers.get("Content-Type", ""), resp.read())
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                err = json.loads(raw)
            except ValueError:
                err = {"error": exc.reason or "HTTPError", "message": raw.decode(errors="replace")}
            if not isinstance(err, dict):
                err = {"error": "HTTPError", "message": str(err)}
            if exc.code in (401, 403):
                message = str(err.get("message") or err.get("detail") or err.get("error") or "")
                error = AuthenticationError if exc.code == 401 else AuthorizationError
                raise error(f"{self.url}: {message or exc.reason}") from None
            raise AdminError(exc.code, err) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, ssl.SSLError):
                raise TlsError(f"{self.url}: {describe_tls_error(reason)}") from None
            raise AdminError(
                0, {"error": "ConnectionError", "message": f"cannot reach {self.url}: {reason}"}
            ) from None

    # -- cluster, tenants, namespaces ------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self.request("GET", f"{API}/cluster/health")  # type: ignore[no-any-return]

    def tenants(self) -> list[str]:
        return self.request("GET", f"{API}/tenants")  # type: ignore[no-any-return]

    def tenant(self, tenant: str) -> dict[str, Any]:
        return self.request("GET", f"{API}/tenants/{_q(tenant)}")  # type: ignore[no-any-return]

    def create_tenant(
        self, tenant: str, *, admin_roles: Sequence[str] = (), allowed_clusters: Sequence[str] = ()
    ) -> dict[str, Any]:
        body = {"admin_roles": list(admin_roles), "allowed_clusters": list(allowed_clusters)}
        return self.request("PUT", f"{API}/tenants/{_q(tenant)}", body=body)  # type: ignore[no-any-return]

    def update_tenant(
        self, tenant: str, *, admin_roles: Sequence[str] = (), allowed_clusters: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Replace the tenant's admin roles and allowed clusters."""
        body = {"admin_roles": list(admin_roles), "allowed_clusters": list(allowed_clusters)}
        return self.request("POST", f"{API}/tenants/{_q(tenant)}", body=body)  # type: ignore[no-any-return]

    def delete_tenant(self, tenant: str) -> None:
        self.request("DELETE", f"{API}/tenants/{_q(tenant)}")

    def namespaces(self, tenant: str) -> list[str]:
        return self.request("GET", f"{API}/namespaces/{_q(tenant)}")  # type: ignore[no-any-return]

    def create_namespace(
        self, namespace: str, policies: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return self.request("PUT", namespace_path(namespace), body=policies or {})  # type: ignore[no-any-return]

    def delete_namespace(self, namespace: str, *, force: bool = False) -> None:
        self.request("DELETE", namespace_path(namespace), params={"force": force})

    def policies(self, namespace: str) -> dict[str, Any]:
        return self.request("GET", namespace_path(namespace) + "/policies")  # type: ignore[no-any-return]

    def set_policies(self, namespace: str, changes: dict[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", namespace_path(namespace) + "/policies", body=changes)  # type: ignore[no-any-return]

    def topics(self, namespace: str) -> list[str]:
        return self.request("GET", namespace_path(namespace) + "/topics")  # type: ignore[no-any-return]

    def bundles(self, namespace: str) -> list[dict[str, Any]]:
        return self.request("GET", namespace_path(namespace) + "/bundles")  # type: ignore[no-any-return]

    def unload_bundle(self, namespace: str, bundle: str) -> list[str]:
        path = namespace_path(namespace) + f"/bundles/{_q(bundle)}/unload"
        return self.request("POST", path)["unloaded"]  # type: ignore[no-any-return]

    # -- topics ----------------------------------------------------------------------

    def create_topic(self, topic: str, partitions: int = 0) -> dict[str, Any]:
        return self.request("PUT", topic_path(topic), params={"partitions": partitions})  # type: ignore[no-any-return]

    def topic(self, topic: str) -> dict[str, Any]:
        return self.request("GET", topic_path(topic))  # type: ignore[no-any-return]

    def delete_topic(self, topic: str, *, force: bool = False) -> None:
        self.request("DELETE", topic_path(topic), params={"force": force})

    def topic_stats(self, topic: str) -> dict[str, Any]:
        return self.request("GET", topic_path(topic) + "/stats")  # type: ignore[no-any-return]

    def internal_stats(self, topic: str) -> dict[str, Any]:
        return self.request("GET", topic_path(topic) + "/internal-stats")  # type: ignore[no-any-return]

    def offload(self, topic: str, size_threshold: int = 0) -> dict[str, Any]:
        """Start offloading TOPIC's oldest closed segments (tiered storage)."""
        return self.request(  # type: ignore[no-any-return]
            "PUT", topic_path(topic) + "/offload", params={"size_threshold": size_threshold}
        )

    def offload_status(self, topic: str) -> dict[str, Any]:
        return self.request("GET", topic_path(topic) + "/offload")  # type: ignore[no-any-return]

    def compact(self, topic: str) -> dict[str, Any]:
        """Start compacting TOPIC (the latest message of every key)."""
        return self.request("PUT", topic_path(topic) + "/compaction")  # type: ignore[no-any-return]

    def compaction_status(self, topic: str) -> dict[str, Any]:
        return self.request("GET", topic_path(topic) + "/compaction")  # type: ignore[no-any-return]

    def unload_topic(self, topic: str) -> list[str]:
        return self.request("POST", topic_path(topic) + "/unload")["unloaded"]  # type: ignore[no-any-return]

    def loaded_topics(self) -> list[dict[str, Any]]:
        return self.request("GET", f"{API}/broker-stats/topics")  # type: ignore[no-any-return]

    # -- subscriptions ---------------------------------------------------------------

    def _sub(self, topic: str, subscription: str) -> str:
        return topic_path(topic) + f"/subscriptions/{_q(subscription)}"

    def subscriptions(self, topic: str) -> list[str]:
        return self.request("GET", topic_path(topic) + "/subscriptions")  # type: ignore[no-any-return]

    def create_subscription(
        self, topic: str, subscription: str, position: str = "latest"
    ) -> dict[str, Any]:
        path = self._sub(topic, subscription)
        return self.request("PUT", path, params={"position": position})  # type: ignore[no-any-return]

    def subscription(self, topic: str, subscription: str) -> dict[str, Any]:
        return self.request("GET", self._sub(topic, subscription))  # type: ignore[no-any-return]

    def delete_subscription(self, topic: str, subscription: str, *, force: bool = False) -> None:
        self.request("DELETE", self._sub(topic, subscription), params={"force": force})

    def reset_cursor(
        self,
        topic: str,
        subscription: str,
        *,
        offset: int | None = None,
        message_id: str | None = None,
        timestamp: int | None = None,
    ) -> list[dict[str, Any]]:
        body = {
            k: v
            for k, v in (("offset", offset), ("message_id", message_id), ("timestamp", timestamp))
            if v is not None
        }
        return self.request("POST", self._sub(topic, subscription) + "/reset-cursor", body=body)  # type: ignore[no-any-return]

    def skip(self, topic: str, subscription: str, count: int) -> dict[str, Any]:
        path = self._sub(topic, subscription) + "/skip"
        return self.request("POST", path, body={"count": count})  # type: ignore[no-any-return]

    def clear_backlog(self, topic: str, subscription: str) -> dict[str, Any]:
        return self.request("POST", self._sub(topic, subscription) + "/clear-backlog")  # type: ignore[no-any-return]

    def peek(self, topic: str, subscription: str, count: int = 1) -> list[dict[str, Any]]:
        path = self._sub(topic, subscription) + "/peek"
        return self.request("GET", path, params={"count": count})  # type: ignore[no-any-return]

    # -- permissions (Pulsar's paths) -------------------------------------------------

    def permissions(self, namespace: str) -> dict[str, list[str]]:
        """Roles and the actions granted to them on every topic of ``namespace``."""
        return self.request("GET", namespace_path(namespace) + "/permissions")  # type: ignore[no-any-return]

    def grant_permission(self, namespace: str, role: str, actions: Sequence[str]) -> None:
        """Give ``role`` these actions on ``namespace`` (replacing what it had there)."""
        path = namespace_path(namespace) + f"/permissions/{_q(role)}"
        self.request("POST", path, body=check_actions(actions))

    def revoke_permission(self, namespace: str, role: str) -> None:
        self.request("DELETE", namespace_path(namespace) + f"/permissions/{_q(role)}")

    def set_subscription_auth_mode(self, namespace: str, mode: str) -> None:
        """``prefix``: a role may only use subscriptions whose names start with it;
        ``none``: any subscription name."""
        value = {"none": "None", "prefix": "Prefix"}.get(mode.strip().lower())
        if value is None:
            raise ValueError(f"subscription auth mode must be none or prefix, not {mode!r}")
        self.request("POST", namespace_path(namespace) + "/subscriptionAuthMode", body=value)

    def topic_permissions(self, topic: str) -> dict[str, list[str]]:
        """Roles and their actions on ``topic``: its own grants and its namespace's."""
        return self.request("GET", topic_path(topic) + "/permissions")  # type: ignore[no-any-return]

    def grant_topic_permission(self, topic: str, role: str, actions: Sequence[str]) -> None:
        path = topic_path(topic) + f"/permissions/{_q(role)}"
        self.request("POST", path, body=check_actions(actions))

    def revoke_topic_permission(self, topic: str, role: str) -> None:
        self.request("DELETE", topic_path(topic) + f"/permissions/{_q(role)}")

    # -- brokers, bookies, metrics ---------------------------------------------------

    # -- schemas ------------------------------------------------------------------------

    def schema(self, topic: str, version: int | None = None) -> dict[str, Any]:
        """The topic's latest schema, or version ``version``."""
        path = schema_path(topic) + "/schema" + (f"/{int(version)}" if version is not None else "")
        return self.request("GET", path)  # type: ignore[no-any-return]

    def schema_versions(self, topic: str) -> list[dict[str, Any]]:
        found = self.request("GET", schema_path(topic) + "/schemas")
        return found["getSchemaResponses"]  # type: ignore[no-any-return]

    def upload_schema(self, topic: str, schema: dict[str, Any]) -> dict[str, Any]:
        """Upload ``{"type": ..., "schema": ...}`` (Pulsar's schema file); its version."""
        return self.request("POST", schema_path(topic) + "/schema", body=schema)  # type: ignore[no-any-return]

    def delete_schema(self, topic: str) -> dict[str, Any]:
        return self.request("DELETE", schema_path(topic) + "/schema")  # type: ignore[no-any-return]

    def schema_compatibility(self, topic: str, schema: dict[str, Any]) -> dict[str, Any]:
        return self.request(  # type: ignore[no-any-return]
            "POST", schema_path(topic) + "/compatibility", body=schema
        )

    def brokers(self) -> list[dict[str, Any]]:
        return self.request("GET", f"{API}/brokers")  # type: ignore[no-any-return]

    def broker_load(self, broker: str) -> dict[str, Any]:
        return self.request("GET", f"{API}/brokers/{_q(broker)}/load")  # type: ignore[no-any-return]

    def broker_bundles(self, broker: str) -> list[dict[str, Any]]:
        return self.request("GET", f"{API}/brokers/{_q(broker)}/bundles")  # type: ignore[no-any-return]

    def throughput(self) -> list[dict[str, Any]]:
        return self.request("GET", f"{API}/broker-stats/throughput")  # type: ignore[no-any-return]

    def bookies(self) -> list[dict[str, Any]]:
        return self.request("GET", f"{API}/bookies")  # type: ignore[no-any-return]

    def bookie(self, address: str) -> dict[str, Any]:
        return self.request("GET", f"{API}/bookies/{_q(address)}")  # type: ignore[no-any-return]

    def metrics(self) -> str:
        return str(self.request("GET", "/metrics"))

    def this_broker(self) -> str:
        """The id (host:port) of the broker serving this URL."""
        return str(self.brokers()[0]["broker"])


#: what a permission may allow (Pulsar's AuthAction names)
ACTIONS = ("produce", "consume", "functions", "sources", "sinks", "packages")


def check_actions(actions: Sequence[str]) -> list[str]:
    """``actions`` checked and sorted; ValueError (one line) for an unknown one."""
    out = sorted({a.strip().lower() for a in actions if a.strip()})
    unknown = [a for a in out if a not in ACTIONS]
    if unknown:
        raise ValueError(
            f"unknown action {', '.join(map(repr, unknown))} (actions: {', '.join(ACTIONS)})"
        )
    if not out:
        raise ValueError(f"name at least one action ({', '.join(ACTIONS)})")
    return out


def _param(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _decode(status: int, content_type: str, raw: bytes) -> Any:
    if status == 204 or not raw:
        return None
    if content_type.startswith("application/json"):
        return json.loads(raw)
    return raw.decode("utf-8", errors="replace")
