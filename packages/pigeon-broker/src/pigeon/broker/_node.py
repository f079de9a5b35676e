"""Running a broker node, and ``pigeon standalone`` (broker + bookie + embedded metadata).

The broker reaches its own bookie over an in-process link (``BookieClient.add_local``,
``BookieServer.open_local_link``, :mod:`pigeon.core._local_link`): the same protocol, no
loopback TCP, trusted (no TLS, no authentication; nothing leaves the process).  The
bookie's port stays open for other clients of it.

Security of ``pigeon standalone`` (docs/security.md): the in-process bookie takes the
broker's settings (the ``[broker]`` table's certificate, authentication settings and
``superuser_roles``), so its port is as closed as the broker's.  What the broker's
bookie client presents when it dials that port over TCP (any address but the in-process
one):

* **TLS** when the broker has a certificate.  The broker trusts exactly its own
  certificate there (pinned: the first certificate of ``tls_certificate_file``, with no
  host name check), since the bookie it dials is this process on loopback: a certificate
  for ``broker.example.com`` need not also name ``127.0.0.1``.
* **Authentication** when it is enabled: with ``broker_client_authentication_*`` set,
  those credentials (their role must be one of ``superuser_roles``); otherwise, with
  token authentication and a ``token_secret_key``, the broker mints itself short-lived
  tokens for the role ``pigeon-standalone`` (a superuser of the in-process bookie only,
  never of the broker; the tokens live in memory and are never printed or logged).  With
  only a ``token_public_key`` the broker cannot mint: the credentials must be configured.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import ssl
from pathlib import Path
from typing import Any

import trio

from pigeon.broker._auditor import read_bookies
from pigeon.broker._config import BrokerConfig
from pigeon.broker._service import BrokerService
from pigeon.broker._watch import watch_forever
from pigeon.core import PluginManager
from pigeon.core.auth import AuthenticationTLS, AuthenticationToken, ClientAuthentication
from pigeon.core.codecs import CodecSet
from pigeon.core.config import SecurityConfig
from pigeon.core.errors import ConfigError
from pigeon.core.paths import BOOKIES_PATH
from pigeon.core.replication import BookieClient

__all__ = [
    "STANDALONE_ROLE",
    "BookieDirectory",
    "run_broker",
    "run_layered",
    "run_standalone",
    "standalone_bookie_security",
]

log = logging.getLogger(__name__)

#: the role a standalone broker presents to its in-process bookie when it mints its own
#: tokens (a superuser of that bookie only)
STANDALONE_ROLE = "pigeon-standalone"
#: lifetime of each token a standalone broker mints (one per new bookie connection)
STANDALONE_TOKEN_EXPIRY_S = 3600
#: the server-side security keys the in-process bookie takes from ``[broker]``
_BOOKIE_SECURITY_KEYS = (
    "authentication_enabled",
    "authentication_providers",
    "token_secret_key",
    "token_public_key",
    "superuser_roles",
    "tls_certificate_file",
    "tls_key_file",
    "tls_trust_certs_file",
    "tls_require_trusted_client_cert",
)


class BookieDirectory:
    """The writable bookies registered in the metadata store, kept current by a watch."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._bookies: dict[str, dict[str, Any]] = {}
        self.changed = trio.Event()

    def writable(self) -> list[str]:
        return sorted(a for a, info in self._bookies.items() if not info.get("read_only"))

    __call__ = writable

    def load(self, address: str) -> float:
        """Bytes/s a bookie reported writing and reading (0 when unknown)."""
        info = self._bookies.get(address, {})
        try:
            return float(info.get("write_bytes_per_s", 0)) + float(info.get("read_bytes_per_s", 0))
        except (TypeError, ValueError):
            return 0.0

    async def refresh(self) -> None:
        self._bookies = await read_bookies(self.store)
        self.changed.set()
        self.changed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the directory current; a metadata server that is away (connection lost,
        restarting) is waited for with backoff — the broker keeps the last list it saw."""

        async def watching(_first: bool) -> None:
            await self.refresh()

        async def event(_event: Any) -> None:
            await self.refresh()

        await watch_forever(
            self.store,
            BOOKIES_PATH,
            what="bookie directory refresh",
            on_watching=watching,
            on_event=event,
            task_status=task_status,
        )

    async def wait_for(self, count: int, timeout: float = 30.0) -> None:  # noqa: ASYNC109
        with trio.fail_after(timeout):
            while len(self.writable()) < count:
                await self.changed.wait()


async def run_broker(
    config: BrokerConfig,
    *,
    store: Any,
    plugins: PluginManager,
    bookie_client: BookieClient | None = None,
    task_status: trio.TaskStatus[BrokerService] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a broker on an already running metadata store until cancelled.

    The broker dials bookies with ``bookie_client`` (started here), by default one that
    uses the ``broker_client_*`` settings: TLS and the broker's own role."""
    async with trio.open_nursery() as nursery:
        if bookie_client is None:
            bookie_client = BookieClient(
                max_frame_size=config.max_frame_size,
                tls=config.client_tls_context(),
                authentication=config.client_authentication(),
            )
        await nursery.start(bookie_client.run)
        directory = BookieDirectory(store)
        await nursery.start(directory.run)
        factory = plugins.replication_policies.get(config.replication)
        policy = factory(  # type: ignore[operator]
            bookie_client, bookie_load=directory.load, **config.quorum()
        )
        service = BrokerService(
            config,
            store=store,
            policy=policy,
            bookies=directory,
            codecs=CodecSet.from_registry(plugins.codecs),
            authenticator=config.authenticator(plugins.authentication_providers),
            offloader=config.offloader(plugins.offloaders),
        )
        await nursery.start(service.run)
        if config.http_port >= 0 or config.web_service_port_tls >= 0:
            from pigeon.broker._admin import serve_admin

            await nursery.start(
                functools.partial(
                    serve_admin,
                    service,
                    host=config.host,
                    port=config.http_port,
                    tls_port=config.web_service_port_tls,
                )
            )
        task_status.started(service)


async def run_standalone(
    data_dir: str | os.PathLike[str],
    broker_config: BrokerConfig,
    bookie_config: Any = None,
    *,
    plugins: PluginManager | None = None,
    task_status: trio.TaskStatus[BrokerService] = trio.TASK_STATUS_IGNORED,
) -> None:
    """One broker, one bookie and the embedded metadata store in this trio run."""
    try:
        from pigeon.bookie import BookieConfig, BookieServer
    except ImportError:  # pragma: no cover - depends on the install
        raise ConfigError(
            "pigeon standalone needs pigeon-bookie: pip install 'pigeon-broker[standalone]'"
        ) from None
    from pigeon.core.metadata import EmbeddedMetadataStore

    plugins = plugins or PluginManager()
    if bookie_config is None:
        bookie_config = BookieConfig()
    # the certificates, keys and providers load before anything starts: errors are one line
    broker_config.authenticator(plugins.authentication_providers)
    bookie_config, tls, authentication = standalone_bookie_security(broker_config, bookie_config)
    bookie_client = BookieClient(
        max_frame_size=broker_config.max_frame_size, tls=tls, authentication=authentication
    )
    root = Path(data_dir)
    (root / "metadata").mkdir(parents=True, exist_ok=True)
    store = EmbeddedMetadataStore(root / "metadata")
    bookie_config.data_dir = str(root / "bookie")
    bookie = BookieServer(bookie_config, metadata=store, plugins=plugins)

    async def infrastructure(nursery: trio.Nursery) -> None:
        await nursery.start(store.run)
        await nursery.start(bookie.run)
        # the broker reaches its own bookie in-process (no loopback TCP); the bookie's
        # port still serves others with the security above
        bookie_client.add_local(bookie.advertised, bookie.open_local_link)

    async def broker(task_status: trio.TaskStatus[Any]) -> None:
        await run_broker(
            broker_config,
            store=store,
            plugins=plugins,
            bookie_client=bookie_client,
            task_status=task_status,
        )

    def ready(service: Any) -> None:
        service.extra_metrics.append(bookie.render_metrics)
        log.info(
            "standalone ready broker=%s bookie=%s data_dir=%s",
            service.service_url,
            bookie.advertised,
            root,
        )
        task_status.started(service)

    await run_layered(infrastructure, broker, ready)


def standalone_bookie_security(
    broker_config: SecurityConfig, bookie_config: Any
) -> tuple[Any, ssl.SSLContext | None, ClientAuthentication | None]:
    """The in-process bookie's configuration with the broker's security settings, and
    the TLS context and credentials the broker dials it with (see the module doc).

    :raises ConfigError: security keys set in ``[bookie]`` (they belong in ``[broker]``),
        or authentication the broker cannot present credentials for."""
    defaults = SecurityConfig()
    for key in _BOOKIE_SECURITY_KEYS:
        if getattr(bookie_config, key) != getattr(defaults, key):
            raise ConfigError(
                f"pigeon standalone takes its security settings from [broker]: move {key!r}"
                " out of [bookie] (the in-process bookie uses the broker's)"
            )
    settings = {key: getattr(broker_config, key) for key in _BOOKIE_SECURITY_KEYS}
    authentication: ClientAuthentication | None = None
    if broker_config.authentication_enabled:
        authentication = broker_config.client_authentication()
        if authentication is None:
            authentication = _minted_token(broker_config)
            settings["superuser_roles"] = [*broker_config.superuser_roles, STANDALONE_ROLE]
            # the minted token authenticates the link: no client certificate is shown
            settings["tls_require_trusted_client_cert"] = False
    bookie_config = dataclasses.replace(bookie_config, **settings)
    tls = None
    if broker_config.tls_certificate_file:
        client_cert = client_key = ""
        if isinstance(authentication, AuthenticationTLS):
            client_cert = authentication.certificate_path
            client_key = authentication.private_key_path
        tls = _pinned_context(broker_config.tls_certificate_file, client_cert, client_key)
    return bookie_config, tls, authentication


def _minted_token(config: SecurityConfig) -> ClientAuthentication:
    """Credentials minted by the broker itself: a fresh short-lived token for
    :data:`STANDALONE_ROLE` on every new bookie connection."""
    if "token" not in config.authentication_providers or not config.token_secret_key:
        if "token" in config.authentication_providers and config.token_public_key:
            why = "with only a 'token_public_key' the broker cannot sign a token of its own"
        else:
            why = "without token authentication and a 'token_secret_key' it cannot mint one"
        raise ConfigError(
            "pigeon standalone with authentication needs credentials for the broker's link"
            f" to its bookie: {why}; set 'broker_client_authentication_plugin' and"
            " 'broker_client_authentication_parameters' (a role in 'superuser_roles')"
        )
    from pigeon.core.tokens import create_token, load_key

    key = load_key(config.token_secret_key)

    def mint() -> str:
        return create_token(STANDALONE_ROLE, key, expiry_s=STANDALONE_TOKEN_EXPIRY_S)

    mint()  # a key tokens cannot be signed with fails now, as one line
    return AuthenticationToken(mint)


def _pinned_context(certificate_file: str, client_cert: str, client_key: str) -> ssl.SSLContext:
    """A client context that trusts exactly the first certificate of
    ``certificate_file`` (the broker's own; no system CA) and checks no host name;
    ``client_cert``/``client_key``: a client certificate to present (mTLS)."""
    what = "broker to bookie TLS"
    try:
        text = Path(certificate_file).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or "not a PEM file"
        raise ConfigError(f"{what}: cannot read {certificate_file!r}: {reason.lower()}") from None
    begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
    start = text.find(begin)
    stop = text.find(end, start)
    if start < 0 or stop < 0:
        raise ConfigError(f"{what}: {certificate_file!r} holds no PEM certificate")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the peer; trusts nothing yet
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a leaf as the trust anchor
    try:
        ctx.load_verify_locations(cadata=text[start : stop + len(end)])
        if client_cert:
            ctx.load_cert_chain(client_cert, client_key or None)
    except (ssl.SSLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(f"{what}: cannot load the certificates ({reason})") from None
    return ctx


async def run_layered(infrastructure: Any, main: Any, ready: Any) -> None:
    """Run ``main`` on top of ``infrastructure`` and stop them in that order.

    On cancellation the broker finishes its shielded cleanup (persisting cursors and
    de-duplication state) while the metadata store and bookie are still running; only
    then are those stopped.
    """
    infra_scope = trio.CancelScope(shield=True)

    async def run_infra(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with infra_scope:
            async with trio.open_nursery() as nursery:
                await infrastructure(nursery)
                task_status.started()
                await trio.sleep_forever()

    async with trio.open_nursery() as top:
        await top.start(run_infra)
        try:
            async with trio.open_nursery() as upper:
                value = await upper.start(main)
                ready(value)
        finally:
            infra_scope.cancel()
