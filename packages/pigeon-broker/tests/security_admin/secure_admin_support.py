"""A standalone with authentication (token, tls), authorization and TLS on, serving its
admin API over HTTP and HTTPS, on a background thread (see ``admin_support``).

Roles: ``admin`` (superuser), ``alice`` (admin of tenant ``ta``), ``bob`` (admin of
``tb``), ``carol`` (no rights).  Each tenant has a namespace ``ns``.
"""

from __future__ import annotations

import functools
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import trio

from pigeon.bookie import BookieConfig
from pigeon.broker import BrokerConfig, BrokerService, run_standalone
from pigeon.broker._admin import serve_admin
from pigeon.core.testing import SecurityFiles
from pigeon.core.testing.fuzz import ServerThread

SUPERUSER = "admin"
TENANT_ADMINS = {"ta": "alice", "tb": "bob"}


class SecureAdminStandalone(ServerThread):
    def __init__(self, data_dir: Path, certs: SecurityFiles) -> None:
        super().__init__("secure-admin-standalone")
        self.data_dir = data_dir
        self.certs = certs
        self.service: BrokerService | None = None
        self.http: tuple[str, int] | None = None
        self.https: tuple[str, int] | None = None

    def config(self) -> BrokerConfig:
        return BrokerConfig(
            port=0,
            http_port=-1,
            maintenance_interval_s=0.5,
            authentication_enabled=True,
            authentication_providers=["token", "tls"],
            token_secret_key=self.certs.secret_key_url,
            authorization_enabled=True,
            superuser_roles=[SUPERUSER],
            tls_certificate_file=str(self.certs.certificate_file),
            tls_key_file=str(self.certs.key_file),
            tls_trust_certs_file=str(self.certs.ca_file),
        )

    async def serve(self, nursery: trio.Nursery) -> None:
        bookie_config = BookieConfig(port=0, fsync="never")
        self.service = await nursery.start(
            functools.partial(run_standalone, self.data_dir, self.config(), bookie_config)
        )
        self.http = await nursery.start(
            functools.partial(serve_admin, self.service, host="127.0.0.1", port=0)
        )
        self.https = await nursery.start(
            functools.partial(serve_admin, self.service, host="127.0.0.1", port=-1, tls_port=0)
        )
        policies = self.service.policies
        from pigeon.broker._policies import NamespacePolicies, TenantInfo

        for tenant, role in TENANT_ADMINS.items():
            await policies.create_tenant(tenant, TenantInfo(admin_roles=[role]))
            await policies.create_namespace(f"{tenant}/ns", NamespacePolicies())

    # ------------------------------------------------------------------ access

    def token(self, role: str, *, expiry_s: int | None = None, key: bytes | None = None) -> str:
        return self.certs.token(role, expiry_s=expiry_s, key=key)

    @property
    def url(self) -> str:
        assert self.http is not None
        return f"http://{self.http[0]}:{self.http[1]}"

    @property
    def https_url(self) -> str:
        assert self.https is not None
        return f"https://localhost:{self.https[1]}"

    def http_call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        role: str | None = None,
        token: str | None = None,
        headers: dict[str, str] | None = None,
        https: bool = False,
        context: ssl.SSLContext | None = None,
    ) -> tuple[int, Any, dict[str, str]]:
        """(status, decoded JSON or text, headers) of one request, with ``role``'s token
        (or ``token``) as the bearer."""
        data = json.dumps(body).encode() if body is not None else None
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        if role is not None:
            token = self.token(role)
        if token is not None:
            hdrs["Authorization"] = f"Bearer {token}"
        hdrs.update(headers or {})
        base = self.https_url if https else self.url
        req = urllib.request.Request(base + path, data=data, method=method, headers=hdrs)
        if https and context is None:
            context = self.certs.client_tls_context()
        try:
            with urllib.request.urlopen(req, timeout=30, context=context) as resp:
                status, payload, rh = resp.status, resp.read(), dict(resp.headers)
        except urllib.error.HTTPError as exc:
            status, payload, rh = exc.code, exc.read(), dict(exc.headers)
        rh = {k.lower(): v for k, v in rh.items()}
        if rh.get("content-type", "").startswith("application/json") and payload:
            return status, json.loads(payload), rh
        return status, payload.decode("utf-8", errors="replace"), rh
