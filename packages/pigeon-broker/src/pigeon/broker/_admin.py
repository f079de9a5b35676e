"""The broker's HTTP side: admin REST API, Prometheus ``/metrics`` and the dashboard.

A FastAPI application (:func:`make_app`) served by hypercorn's trio worker
(:func:`serve_admin`) in the broker's own trio run, so request handlers call the broker's
async methods directly.  The OpenAPI document is at ``/openapi.json``.

Errors are JSON ``{"error": <class>, "message": ..., "code": <wire code>, "retriable": ...}``
with the status chosen by :func:`http_status`: 400 for bad values (``InvalidArgument``
and its subclasses), 404 for missing objects, 409 for conflicts (exists, not empty, busy),
422 for requests that do not match the schema (FastAPI's validation, with ``detail``),
503/504 when something the broker needs is unavailable or slow, 401 (with
``WWW-Authenticate: Bearer``) without valid credentials and 403 when the role may not do
it.  Expected errors are logged on one line without a stack trace; only a bug (500) logs
one.

Security (:mod:`pigeon.broker._admin_auth` has the rule of every route): with
authentication on, every API route and ``/metrics`` need ``Authorization: Bearer <token>``
(or, over HTTPS with the ``tls`` provider, a verified client certificate whose common name
is the role); the cluster health probe, the OpenAPI document and the dashboard's files stay
open (the dashboard asks for a token).  With authorization on, tenants, brokers, bookies
and broker statistics need a superuser, a tenant's namespaces, topics, subscriptions and
permissions an admin role of that tenant.  HTTPS is served on ``web_service_port_tls``
with the broker's certificate (``tls_certificate_file``; reloaded on SIGHUP); client
certificates are asked for when ``tls_trust_certs_file`` is set.

Routes (all JSON unless noted; ``T`` = ``/admin/v2/topics/{domain}/{tenant}/{namespace}/{topic}``)::

    GET    /admin/v2/cluster/health
    GET    /admin/v2/tenants                          PUT|POST|GET|DELETE /admin/v2/tenants/{tenant}
    GET    /admin/v2/namespaces/{tenant}              PUT|DELETE /admin/v2/namespaces/{tenant}/{ns}
    GET|PATCH /admin/v2/namespaces/{tenant}/{ns}/policies
    GET    /admin/v2/namespaces/{tenant}/{ns}/topics  GET .../bundles  POST .../bundles/{b}/unload
    GET    /admin/v2/namespaces/{tenant}/{ns}/permissions   POST|DELETE .../permissions/{role}
    POST   /admin/v2/namespaces/{tenant}/{ns}/subscriptionAuthMode   ("None" or "Prefix")
    GET    T/permissions   POST|DELETE T/permissions/{role}   (also Pulsar's
           /admin/v2/persistent/{tenant}/{ns}/{topic}/permissions[/{role}])
    PUT|GET|DELETE T     GET T/stats  GET T/internal-stats  POST T/unload
    GET    T/subscriptions          PUT|GET|DELETE T/subscriptions/{sub}
    POST   T/subscriptions/{sub}/reset-cursor | skip | clear-backlog    GET .../peek
    GET    /admin/v2/brokers   GET /admin/v2/brokers/{broker}/load | /bundles
    GET    /admin/v2/broker-stats/topics | /throughput
    GET    /admin/v2/bookies   GET /admin/v2/bookies/{bookie}
    GET    /metrics (Prometheus text)   GET /dashboard (HTML)   GET /openapi.json
"""

from __future__ import annotations

import functools
import logging
from http import HTTPStatus
from pathlib import Path as FsPath
from typing import Annotated, Any, cast

import trio
from fastapi import APIRouter, Body, Depends, FastAPI, Path, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pigeon.broker import _admin_ops as ops
from pigeon.broker._admin_auth import authorize_request, identified
from pigeon.broker._admin_errors import (
    error_body,
    error_location,
    http_status,
    json_safe,
    name_rule,
)
from pigeon.broker._admin_models import (
    ERRORS,
    POSITION,
    Actions,
    AuthMode,
    Bookie,
    BrokerInfo,
    BrokerLoad,
    Bundle,
    CompactionStatus,
    CursorPosition,
    Domain,
    Force,
    Health,
    InternalStats,
    LoadedTopic,
    NamePart,
    NewSubName,
    OffloadStatus,
    PeekedMessage,
    Permissions,
    Policies,
    PoliciesChange,
    ResetCursor,
    RolePath,
    Skip,
    Skipped,
    SubName,
    SubscriptionStatsOut,
    Tenant,
    TenantOut,
    ThroughputSample,
    TopicMetadata,
    TopicPart,
    TopicStats,
    Unloaded,
)
from pigeon.broker._admin_schemas import schema_routes
from pigeon.broker._authz import topic_key
from pigeon.broker._metrics import CONTENT_TYPE, BrokerMonitor
from pigeon.broker._service import BrokerService
from pigeon.core import TopicName
from pigeon.core.errors import (
    ConfigError,
    InvalidArgument,
    PigeonError,
)
from pigeon.core.rpc import listen_error
from pigeon.core.tls import ServerTls

__all__ = ["http_status", "make_app", "serve_admin"]

log = logging.getLogger(__name__)

API = "/admin/v2"
DASHBOARD_DIR = FsPath(__file__).parent / "dashboard"
DASHBOARD_ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "units.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}


# ---------------------------------------------------------------------- app


def make_app(service: BrokerService, *, monitor: BrokerMonitor | None = None) -> FastAPI:
    """The admin ASGI application of ``service`` (no server: see :func:`serve_admin`)."""
    app = FastAPI(
        title="PigeonMQ admin API",
        version="2",
        description="Tenants, namespaces, topics, subscriptions, brokers and bookies.",
        openapi_url="/openapi.json",
        docs_url=None,  # Swagger UI needs a CDN; the machine may have no internet
        redoc_url=None,
    )
    app.state.service = service
    app.state.monitor = monitor or BrokerMonitor(service)
    app.state.http_url = None
    app.state.https_url = None
    _install_error_handlers(app)

    async def guard(request: Request) -> None:
        await authorize_request(service, request)

    api = APIRouter(prefix=API, responses=ERRORS, dependencies=[Depends(guard)])
    _cluster_routes(api, app)
    _tenant_routes(api, service)
    _namespace_routes(api, service)
    _permission_routes(api, service)
    _topic_routes(api, app)
    schema_routes(api, service)
    _broker_routes(api, app)
    app.include_router(api)
    _plain_routes(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    async def pigeon_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, PigeonError)
        status = http_status(exc)
        line = "admin request failed method=%s path=%s status=%s error=%s: %s"
        args = (request.method, request.url.path, status, type(exc).__name__, exc.message)
        if status >= 500:
            log.warning(line, *args)
        else:
            log.info(line, *args)
        # RFC 6750: a 401 names the scheme it wants
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse(error_body(exc), status_code=status, headers=headers)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        # The errors echo the rejected input, which may be NaN (not JSON), or huge.
        errors = json_safe(jsonable_encoder(exc.errors()))
        first = errors[0] if errors else {}
        where = error_location(first.get("loc", ()))
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else "invalid request"
        # a bad name in the path: the documented rule, not the pattern that enforces it
        # (checked on the raw input: the echo above cuts long strings)
        raw = exc.errors()
        message = (name_rule(raw[0]) if raw else None) or message
        log.info(
            "admin request invalid method=%s path=%s error=%s",
            request.method,
            request.url.path,
            message,
        )
        body = {
            "error": "ValidationError",
            "message": message,
            "code": InvalidArgument.code,
            "retriable": False,
            "detail": errors,
        }
        return JSONResponse(body, status_code=422)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        phrase = HTTPStatus(exc.status_code).phrase
        body = {
            "error": phrase.replace(" ", ""),
            "message": str(exc.detail or phrase),
            "code": None,
            "retriable": False,
        }
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.error(
            "admin request crashed method=%s path=%s",
            request.method,
            request.url.path,
            exc_info=exc,
        )
        body = {
            "error": "InternalError",
            "message": f"{type(exc).__name__}: {exc}",
            "code": None,
            "retriable": False,
        }
        return JSONResponse(body, status_code=500)

    app.add_exception_handler(PigeonError, pigeon_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)


def _monitor(app: FastAPI) -> BrokerMonitor:
    monitor: BrokerMonitor = app.state.monitor
    return monitor


def _cluster_routes(api: APIRouter, app: FastAPI) -> None:
    service: BrokerService = app.state.service

    @api.get(
        "/cluster/health",
        response_model=Health,
        tags=["cluster"],
        responses={503: {"model": Health, "description": "The cluster is unhealthy."}},
    )
    async def cluster_health(request: Request) -> Any:
        """Metadata store reachable, enough writable bookies, broker serving (only
        whether each check passed, to a caller without credentials when authentication
        is on)."""
        health = await ops.cluster_health(service, app.state.http_url)
        if not identified(service, request):
            health = ops.anonymous_health(health)
        if health["status"] == "unhealthy":
            return JSONResponse(jsonable_encoder(health), status_code=503)
        return health


def _tenant_routes(api: APIRouter, service: BrokerService) -> None:
    tags: list[str | Any] = ["tenants"]

    @api.get("/tenants", response_model=list[str], tags=tags)
    async def list_tenants() -> Any:
        return sorted(await service.policies.tenants())

    @api.put("/tenants/{tenant}", response_model=TenantOut, status_code=201, tags=tags)
    async def create_tenant(tenant: NamePart, body: Annotated[Tenant | None, Body()] = None) -> Any:
        """Create a tenant (409 if it exists)."""
        info = (body or Tenant()).model_dump()
        created = await ops.create_tenant(service, tenant, info)
        service.authorization.forget_tenant(tenant)
        return created

    @api.post("/tenants/{tenant}", response_model=TenantOut, tags=tags)
    async def update_tenant(tenant: NamePart, body: Tenant) -> Any:
        """Replace the tenant's admin roles and allowed clusters (Pulsar's update)."""
        updated = await ops.update_tenant(service, tenant, body.model_dump())
        service.authorization.forget_tenant(tenant)
        return updated

    @api.get("/tenants/{tenant}", response_model=TenantOut, tags=tags)
    async def get_tenant(tenant: NamePart) -> Any:
        return await ops.tenant_info(service, tenant)

    @api.delete("/tenants/{tenant}", status_code=204, tags=tags)
    async def delete_tenant(tenant: NamePart) -> Response:
        """Delete a tenant without namespaces (409 while it has some)."""
        await ops.delete_tenant(service, tenant)
        service.authorization.forget_tenant(tenant)
        return Response(status_code=204)


def _namespace_routes(api: APIRouter, service: BrokerService) -> None:
    tags: list[str | Any] = ["namespaces"]
    ns_path = "/namespaces/{tenant}/{namespace}"

    @api.get("/namespaces/{tenant}", response_model=list[str], tags=tags)
    async def list_namespaces(tenant: NamePart) -> Any:
        return await ops.list_namespaces(service, tenant)

    @api.put(ns_path, response_model=Policies, status_code=201, tags=tags)
    async def create_namespace(
        tenant: NamePart,
        namespace: NamePart,
        body: Annotated[PoliciesChange | None, Body()] = None,
    ) -> Any:
        """Create a namespace, optionally with some policies (the rest default)."""
        changes = body.changes() if body else {}
        created = await ops.create_namespace(service, f"{tenant}/{namespace}", changes)
        return created.__dict__

    @api.delete(ns_path, status_code=204, tags=tags)
    async def delete_namespace(
        tenant: NamePart, namespace: NamePart, force: Force = False
    ) -> Response:
        """Delete a namespace (409 while it has topics, unless ``force`` deletes them)."""
        await ops.delete_namespace(service, f"{tenant}/{namespace}", force=force)
        return Response(status_code=204)

    @api.get(ns_path + "/policies", response_model=Policies, tags=tags)
    async def get_policies(tenant: NamePart, namespace: NamePart) -> Any:
        return (await service.policies.load(f"{tenant}/{namespace}")).__dict__

    @api.patch(ns_path + "/policies", response_model=Policies, tags=tags)
    async def set_policies(tenant: NamePart, namespace: NamePart, body: PoliciesChange) -> Any:
        """Change some policies; they apply on every broker within moments."""
        changes = body.changes()
        policies = await service.policies.set(f"{tenant}/{namespace}", changes)
        log.info(
            "namespace policies changed namespace=%s/%s changes=%s", tenant, namespace, changes
        )
        return policies.__dict__

    @api.get(ns_path + "/topics", response_model=list[str], tags=tags)
    async def list_topics(tenant: NamePart, namespace: NamePart) -> Any:
        """Topics of the namespace (partitioned topics by their base name)."""
        return await ops.list_topics(service, f"{tenant}/{namespace}")

    @api.get(ns_path + "/bundles", response_model=list[Bundle], tags=tags)
    async def list_bundles(tenant: NamePart, namespace: NamePart) -> Any:
        return await ops.bundles(service, f"{tenant}/{namespace}")

    @api.post(ns_path + "/bundles/{bundle}/unload", response_model=Unloaded, tags=tags)
    async def unload_bundle(
        tenant: NamePart, namespace: NamePart, bundle: Annotated[str, Path(max_length=64)]
    ) -> Any:
        """Close the bundle's loaded topics on this broker; clients re-attach."""
        return {"unloaded": await ops.unload_bundle(service, f"{tenant}/{namespace}", bundle)}


def _permission_routes(api: APIRouter, service: BrokerService) -> None:
    """Pulsar's permission paths: grants per namespace and per topic, and the
    namespace's subscription auth mode."""
    tags: list[str | Any] = ["permissions"]
    ns_path = "/namespaces/{tenant}/{namespace}"

    @api.get(ns_path + "/permissions", response_model=Permissions, tags=tags)
    async def namespace_permissions(tenant: NamePart, namespace: NamePart) -> Any:
        """Roles and the actions granted to them on every topic of the namespace."""
        return (await service.policies.load(f"{tenant}/{namespace}")).permissions

    @api.post(ns_path + "/permissions/{role}", status_code=204, tags=tags)
    async def grant_namespace(
        tenant: NamePart,
        namespace: NamePart,
        role: RolePath,
        actions: Actions,
    ) -> Response:
        """Give ROLE these actions on the namespace (replacing what it had there)."""
        granted = await service.authorization.grant(f"{tenant}/{namespace}", role, actions)
        log.info(
            "permissions granted namespace=%s/%s role=%s actions=%s",
            tenant,
            namespace,
            role,
            ",".join(granted[role.strip()]),
        )
        return Response(status_code=204)

    @api.delete(ns_path + "/permissions/{role}", status_code=204, tags=tags)
    async def revoke_namespace(tenant: NamePart, namespace: NamePart, role: RolePath) -> Response:
        await service.authorization.revoke(f"{tenant}/{namespace}", role)
        log.info("permissions revoked namespace=%s/%s role=%s", tenant, namespace, role)
        return Response(status_code=204)

    @api.post(ns_path + "/subscriptionAuthMode", status_code=204, tags=tags)
    async def set_subscription_auth_mode(
        tenant: NamePart,
        namespace: NamePart,
        mode: AuthMode,
    ) -> Response:
        """With Prefix a role may only use subscriptions whose names start with it."""
        value = mode.strip().lower()
        if value not in ("none", "prefix"):
            raise InvalidArgument(f"subscription auth mode must be None or Prefix, not {mode!r}")
        await service.policies.set(f"{tenant}/{namespace}", {"subscription_auth_mode": value})
        log.info("subscription auth mode set namespace=%s/%s mode=%s", tenant, namespace, value)
        return Response(status_code=204)

    for base in (
        "/topics/{domain}/{tenant}/{namespace}/{topic}",
        "/persistent/{tenant}/{namespace}/{topic}",
    ):
        _topic_permission_routes(api, service, base, pulsar=base.startswith("/persistent"))


def _topic_of(domain: Domain, tenant: NamePart, namespace: NamePart, topic: TopicPart) -> TopicName:
    return ops.topic_name(domain, tenant, namespace, topic)


def _persistent_topic_of(tenant: NamePart, namespace: NamePart, topic: TopicPart) -> TopicName:
    return ops.topic_name("persistent", tenant, namespace, topic)


def _topic_permission_routes(
    api: APIRouter, service: BrokerService, base: str, *, pulsar: bool
) -> None:
    tags: list[str | Any] = ["permissions"]
    # the /persistent/... spelling is Pulsar's; the document lists the /topics/... one
    show = not pulsar
    topic_of = Depends(_persistent_topic_of if pulsar else _topic_of)

    @api.get(base + "/permissions", response_model=Permissions, tags=tags, include_in_schema=show)
    async def topic_permissions(name: TopicName = topic_of) -> Any:
        """Roles and their actions on the topic: its own grants and the namespace's."""
        policies = await service.policies.load(name.namespace_name)
        out = {r: set(a) for r, a in policies.permissions.items()}
        for r, a in policies.topic_permissions.get(topic_key(name), {}).items():
            out.setdefault(r, set()).update(a)
        return {r: sorted(a) for r, a in sorted(out.items())}

    @api.post(base + "/permissions/{role}", status_code=204, tags=tags, include_in_schema=show)
    async def grant_topic(role: RolePath, actions: Actions, name: TopicName = topic_of) -> Response:
        """Give ROLE these actions on the topic (and its partitions)."""
        granted = await service.authorization.grant_topic(name, role, actions)
        log.info(
            "permissions granted topic=%s role=%s actions=%s",
            name.base.full,
            role,
            ",".join(granted[role.strip()]),
        )
        return Response(status_code=204)

    @api.delete(base + "/permissions/{role}", status_code=204, tags=tags, include_in_schema=show)
    async def revoke_topic(role: RolePath, name: TopicName = topic_of) -> Response:
        await service.authorization.revoke_topic(name, role)
        log.info("permissions revoked topic=%s role=%s", name.base.full, role)
        return Response(status_code=204)


def _topic_routes(api: APIRouter, app: FastAPI) -> None:
    service: BrokerService = app.state.service
    tags: list[str | Any] = ["topics"]
    sub_tags: list[str | Any] = ["subscriptions"]
    t_path = "/topics/{domain}/{tenant}/{namespace}/{topic}"
    s_path = t_path + "/subscriptions/{subscription}"

    def name_of(domain: str, tenant: str, namespace: str, topic: str) -> TopicName:
        return ops.topic_name(domain, tenant, namespace, topic)

    @api.put(t_path, response_model=TopicMetadata, status_code=201, tags=tags)
    async def create_topic(
        domain: Domain,
        tenant: NamePart,
        namespace: NamePart,
        topic: TopicPart,
        partitions: Annotated[int, Query(ge=0, le=4096, description="0: not partitioned.")] = 0,
    ) -> Any:
        return await ops.create_topic(
            service, name_of(domain, tenant, namespace, topic), partitions
        )

    @api.get(t_path, response_model=TopicMetadata, tags=tags)
    async def get_topic(
        domain: Domain, tenant: NamePart, namespace: NamePart, topic: TopicPart
    ) -> Any:
        return await ops.topic_metadata(service, name_of(domain, tenant, namespace, topic))

    @api.delete(t_path, status_code=204, tags=tags)
    async def delete_topic(
        domain: Domain,
        tenant: NamePart,
        namespace: NamePart,
        topic: TopicPart,
        force: Force = False,
    ) -> Response:
        """Delete the topic and its stored data (409 while clients are attached, unless force)."""
        await ops.delete_topic(service, name_of(domain, tenant, namespace, topic), force=force)
        return Response(status_code=204)

    @api.get(t_path + "/stats", response_model=TopicStats, tags=tags)
    async def topic_stats(
        domain: Domain, tenant: NamePart, namespace: NamePart, topic: TopicPart
    ) -> Any:
        """Rates in/out, counters, storage size, segments and backlog per subscription."""
        name = name_of(domain, tenant, namespace, topic)
        return await ops.topic_stats(service, _monitor(app), name)

    @api.get(t_path + "/internal-stats", response_model=InternalStats, tags=tags)
    async def internal_stats(
        domain: Domain, tenant: NamePart, namespace: NamePart, topic: TopicPart
    ) -> Any:
        """Segments of the managed ledger and cursor details (one topic or partition)."""
        return await ops.internal_stats(service, name_of(domain, tenant, namespace, topic))

    @api.put(t_path + "/offload", response_model=OffloadStatus, status_code=202, tags=tags)
    async def offload_topic(
        domain: Domain,
        tenant: NamePart,
        namespace: NamePart,
        topic: TopicPart,
        size_threshold: Annotated[
            int, Query(ge=0, le=2**62, description="Bytes to keep only on bookies.")
        ] = 0,
    ) -> Any:
        """Offload the oldest closed segments to the broker's offloader (in the
        background; poll with GET) until at most ``size_threshold`` bytes are only on
        bookies."""
        name = name_of(domain, tenant, namespace, topic)
        return await ops.offload_topic(service, name, size_threshold)

    @api.get(t_path + "/offload", response_model=OffloadStatus, tags=tags)
    async def offload_status(
        domain: Domain, tenant: NamePart, namespace: NamePart, topic: TopicPart
    ) -> Any:
        """How the last offload went and where the topic's segments live."""
        return await ops.offload_status(service, name_of(domain, tenant, namespace, topic))

    @api.put(t_path + "/compaction", response_model=CompactionStatus, status_code=202, tags=tags)
    async def compact_topic(
        domain: Domain, tenant: NamePart, namespace: NamePart, topic: TopicPart
    ) -> Any:
        """Compact the topic in the background (poll with GET): the latest message of
        every key, read with ``read_compacted``."""
        return await ops.compact_topic(service, name_of(domain, tenant, namespace, topic))

    @api.get(t_path + "/compaction", response_model=CompactionStatus, tags=tags)
    async def compaction_status(
        domain: Domain, tenant: NamePart, namespace: NamePart, topic: TopicPart
    ) -> Any:
        """How the last compaction went, the compacted ledger and its horizon."""
        return await ops.compaction_status(service, name_of(domain, tenant, namespace, topic))

    @api.post(t_path + "/unload", response_model=Unloaded, tags=tags)
    async def unload_topic(
        domain: Domain, tenant: NamePart, namespace: NamePart, topic: TopicPart
    ) -> Any:
        name = name_of(domain, tenant, namespace, topic)
        return {"unloaded": await ops.unload_topic(service, name)}

    @api.get(t_path + "/subscriptions", response_model=list[str], tags=sub_tags)
    async def list_subscriptions(
        domain: Domain, tenant: NamePart, namespace: NamePart, topic: TopicPart
    ) -> Any:
        return await ops.list_subscriptions(service, name_of(domain, tenant, namespace, topic))

    @api.put(s_path, response_model=SubscriptionStatsOut, status_code=201, tags=sub_tags)
    async def create_subscription(
        domain: Domain,
        tenant: NamePart,
        namespace: NamePart,
        topic: TopicPart,
        subscription: NewSubName,
        position: Annotated[
            str,
            Query(
                pattern=POSITION,
                description="earliest, latest, an offset, or a message id segment:entry[:index]",
            ),
        ] = "latest",
    ) -> Any:
        """Create a durable subscription at a position (409 if it exists)."""
        name = name_of(domain, tenant, namespace, topic)
        return await ops.create_subscription(service, name, subscription, position)

    @api.get(s_path, response_model=SubscriptionStatsOut, tags=sub_tags)
    async def get_subscription(
        domain: Domain,
        tenant: NamePart,
        namespace: NamePart,
        topic: TopicPart,
        subscription: SubName,
    ) -> Any:
        name = name_of(domain, tenant, namespace, topic)
        return await ops.subscription_stats(service, _monitor(app), name, subscription)

    @api.delete(s_path, status_code=204, tags=sub_tags)
    async def delete_subscription(
        domain: Domain,
        tenant: NamePart,
        namespace: NamePart,
        topic: TopicPart,
        subscription: SubName,
        force: Force = False,
    ) -> Response:
        """Delete the subscription and its cursor (409 with consumers attached, unless force)."""
        name = name_of(domain, tenant, namespace, topic)
        await ops.delete_subscription(service, name, subscription, force=force)
        return Response(status_code=204)

    @api.post(s_path + "/reset-cursor", response_model=list[CursorPosition], tags=sub_tags)
    async def reset_cursor(
        domain: Domain,
        tenant: NamePart,
        namespace: NamePart,
        topic: TopicPart,
        subscription: SubName,
        body: ResetCursor,
    ) -> Any:
        """Move the cursor to an offset, a message id or a publish time; consumers re-attach."""
        name = name_of(domain, tenant, namespace, topic)
        return await ops.reset_cursor(
            service,
            name,
            subscription,
            offset=body.offset,
            message_id=body.message_id,
            timestamp=body.timestamp,
        )

    @api.post(s_path + "/skip", response_model=Skipped, tags=sub_tags)
    async def skip(
        domain: Domain,
        tenant: NamePart,
        namespace: NamePart,
        topic: TopicPart,
        subscription: SubName,
        body: Skip,
    ) -> Any:
        """Acknowledge the next N unacknowledged messages (per partition)."""
        name = name_of(domain, tenant, namespace, topic)
        return await ops.skip(service, name, subscription, body.count)

    @api.post(s_path + "/clear-backlog", response_model=Skipped, tags=sub_tags)
    async def clear_backlog(
        domain: Domain,
        tenant: NamePart,
        namespace: NamePart,
        topic: TopicPart,
        subscription: SubName,
    ) -> Any:
        """Acknowledge everything published so far."""
        name = name_of(domain, tenant, namespace, topic)
        return await ops.clear_backlog(service, name, subscription)

    @api.get(s_path + "/peek", response_model=list[PeekedMessage], tags=sub_tags)
    async def peek(
        domain: Domain,
        tenant: NamePart,
        namespace: NamePart,
        topic: TopicPart,
        subscription: SubName,
        count: Annotated[int, Query(ge=1, le=ops.MAX_PEEK)] = 1,
    ) -> Any:
        """The next unacknowledged messages, without consuming them."""
        name = name_of(domain, tenant, namespace, topic)
        return await ops.peek(service, name, subscription, count)


def _broker_routes(api: APIRouter, app: FastAPI) -> None:
    service: BrokerService = app.state.service
    tags: list[str | Any] = ["brokers"]

    @api.get("/brokers", response_model=list[BrokerInfo], tags=tags)
    async def list_brokers() -> Any:
        return await ops.brokers(service, app.state.http_url)

    @api.get("/brokers/{broker}/load", response_model=BrokerLoad, tags=tags)
    async def broker_load(broker: Annotated[str, Path(max_length=300)]) -> Any:
        """Topics, connections and message rates of a broker."""
        return await ops.broker_load(service, _monitor(app), broker)

    @api.get("/brokers/{broker}/bundles", response_model=list[Bundle], tags=tags)
    async def owned_bundles(broker: Annotated[str, Path(max_length=300)]) -> Any:
        return await ops.owned_bundles(service, broker)

    @api.get("/broker-stats/topics", response_model=list[LoadedTopic], tags=tags)
    async def loaded_topics() -> Any:
        """Every topic loaded on this broker with its rates and backlog (the dashboard's view)."""
        return ops.loaded_topics_stats(service, _monitor(app))

    @api.get("/broker-stats/throughput", response_model=list[ThroughputSample], tags=tags)
    async def throughput() -> Any:
        """Broker-wide rates, one sample per second, oldest first (up to 5 minutes)."""
        return list(_monitor(app).history)

    bookie_tags: list[str | Any] = ["bookies"]

    @api.get("/bookies", response_model=list[Bookie], tags=bookie_tags)
    async def list_bookies() -> Any:
        """Bookies registered in the metadata store: read-only state, disk, rates."""
        return ops.bookies(service)

    @api.get("/bookies/{bookie}", response_model=Bookie, tags=bookie_tags)
    async def get_bookie(bookie: Annotated[str, Path(max_length=300)]) -> Any:
        return ops.bookie(service, bookie)


def _plain_routes(app: FastAPI) -> None:
    service: BrokerService = app.state.service

    async def guard(request: Request) -> None:
        await authorize_request(service, request)

    @app.get(
        "/metrics",
        tags=["metrics"],
        dependencies=[Depends(guard)],
        response_class=Response,
        responses={
            200: {
                "content": {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}},
                "description": "Prometheus text exposition.",
            }
        },
    )
    async def metrics() -> Response:
        """Prometheus metrics of this broker."""
        return Response(_monitor(app).render(), media_type=CONTENT_TYPE)

    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        return RedirectResponse("/dashboard")

    @app.get("/dashboard", include_in_schema=False)
    @app.get("/dashboard/", include_in_schema=False)
    async def dashboard() -> Response:
        return HTMLResponse((DASHBOARD_DIR / "index.html").read_text(encoding="utf-8"))

    @app.get("/dashboard/{asset}", include_in_schema=False)
    async def dashboard_asset(asset: str) -> Response:
        media_type = DASHBOARD_ASSETS.get(asset)
        if media_type is None:
            raise StarletteHTTPException(404, f"no dashboard file {asset!r}")
        return Response((DASHBOARD_DIR / asset).read_bytes(), media_type=media_type)


# ---------------------------------------------------------------------- server


def _hypercorn_config(host: str, port: int) -> Any:
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger(f"{__name__}.http")
    config.graceful_timeout = 2.0
    config.keep_alive_timeout = 30.0
    return config


async def _serve_https(
    app: FastAPI,
    tls: ServerTls,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """HTTPS with the broker's shared context (reloaded in place on SIGHUP, so a renewed
    certificate applies to new admin connections too), each connection served by
    hypercorn's HTTP/1.1 protocol (no ALPN: h11).

    hypercorn's own TLS listener builds a context from files and hides the peer's
    certificate from the application; here the handshake is done first and the verified
    client certificate (``getpeercert()``) is put in the connection's ASGI state as
    ``peer_certificate``, where :mod:`pigeon.broker._admin_auth` finds it.
    """
    from hypercorn.trio.tcp_server import TCPServer
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.typing import ConnectionState
    from hypercorn.utils import wrap_app

    config = _hypercorn_config(host, port)
    asgi = wrap_app(app, config.wsgi_max_body_size, "asgi")  # type: ignore[arg-type]
    context = WorkerContext(None)
    listeners = await trio.open_tcp_listeners(port, host=host)
    secure = [trio.SSLListener(lst, tls.context, https_compatible=True) for lst in listeners]

    async def handle(stream: trio.SSLStream[trio.SocketStream]) -> None:
        try:
            with trio.fail_after(config.ssl_handshake_timeout):
                await stream.do_handshake()
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError):
            await trio.aclose_forcefully(stream)  # not TLS, not trusted, or too slow
            return
        state = ConnectionState({"peer_certificate": stream.getpeercert() or None})
        await TCPServer(asgi, config, context, state, stream)

    async with trio.open_nursery() as nursery:
        bound = await nursery.start(trio.serve_listeners, handle, secure)
        sockname = bound[0].transport_listener.socket.getsockname()
        task_status.started([f"https://{_url_host(sockname[0])}:{sockname[1]}"])


async def _listen(
    nursery: trio.Nursery, app: FastAPI, host: str, port: int, tls: ServerTls | None
) -> tuple[str, int]:
    from hypercorn.trio import serve

    what = "admin API (HTTPS)" if tls is not None else "admin API"
    try:
        if tls is not None:
            binds: list[str] = await nursery.start(_serve_https, app, tls, host, port)
        else:
            binds = await nursery.start(
                functools.partial(serve, app, _hypercorn_config(host, port))  # type: ignore[arg-type]
            )
    except* OSError as group:  # hypercorn binds the socket itself
        leaf: BaseException = group
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        raise listen_error(cast(OSError, leaf), what, host, port) from None
    _, _, hostport = binds[0].partition("://")
    bound_host, _, bound_port = hostport.rpartition(":")
    log.info("admin serving url=%s", binds[0])
    return bound_host.strip("[]"), int(bound_port)


async def serve_admin(
    service: BrokerService,
    *,
    host: str,
    port: int,
    tls_port: int = -1,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin API, ``/metrics`` and the dashboard until cancelled: plain HTTP on
    ``port`` and HTTPS on ``tls_port`` (with ``service.server_tls``), -1 turning either off.

    Reports the bound ``(host, port)`` through ``task_status`` (``0`` picks a free port):
    the HTTP one, or the HTTPS one when HTTP is off.
    """
    if tls_port >= 0 and service.server_tls is None:
        raise ConfigError(
            "web_service_port_tls needs a certificate: set tls_certificate_file and tls_key_file"
        )
    if port < 0 and tls_port < 0:
        raise ConfigError("the admin API needs http_port or web_service_port_tls")
    app = make_app(service)
    await _build_routes(app)
    monitor = _monitor(app)
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.run)
        addresses: list[tuple[str, int]] = []
        if port >= 0:
            address = await _listen(nursery, app, host, port, None)
            app.state.http_url = _url("http", address)
            addresses.append(address)
        if tls_port >= 0:
            address = await _listen(nursery, app, host, tls_port, service.server_tls)
            app.state.https_url = _url("https", address)
            if app.state.http_url is None:
                app.state.http_url = app.state.https_url
            addresses.append(address)
        task_status.started(addresses[0])


async def asgi_get(app: Any, path: str) -> int:
    """The status of one ``GET path`` through ``app``'s ASGI interface (no socket)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
    }
    status: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    return status[0] if status else 0


async def _build_routes(app: Any) -> None:
    """Have FastAPI build every route now, while the node starts: it builds an included
    router's routes (their pydantic models) on the first request that reaches them,
    which held the event loop -- the standalone's message path too -- for ~0.1 s on the
    first admin or ``/metrics`` request. One request that matches no route tries them
    all."""
    try:
        await asgi_get(app, "/__pigeon_build_routes__")
    except Exception:  # an optimisation only: the first real request builds them then
        log.debug("building the admin routes ahead failed", exc_info=True)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _url(scheme: str, address: tuple[str, int]) -> str:
    return f"{scheme}://{_url_host(address[0])}:{address[1]}"
