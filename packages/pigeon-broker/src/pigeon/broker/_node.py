"""Running a broker node, and ``pigeon standalone`` (broker + bookie + embedded metadata)."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import trio

from pigeon.broker._auditor import read_bookies
from pigeon.broker._config import BrokerConfig
from pigeon.broker._service import BrokerService
from pigeon.broker._watch import watch_forever
from pigeon.core import PluginManager
from pigeon.core.codecs import CodecSet
from pigeon.core.errors import ConfigError
from pigeon.core.paths import BOOKIES_PATH
from pigeon.core.replication import BookieClient

__all__ = ["BookieDirectory", "run_broker", "run_layered", "run_standalone"]

log = logging.getLogger(__name__)


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
    task_status: trio.TaskStatus[BrokerService] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a broker on an already running metadata store until cancelled."""
    async with trio.open_nursery() as nursery:
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
        from pigeon.bookie import BookieConfig, BookieServer, render_metrics
    except ImportError:  # pragma: no cover - depends on the install
        raise ConfigError(
            "pigeon standalone needs pigeon-bookie: pip install 'pigeon-broker[standalone]'"
        ) from None
    from pigeon.core.metadata import EmbeddedMetadataStore

    plugins = plugins or PluginManager()
    root = Path(data_dir)
    (root / "metadata").mkdir(parents=True, exist_ok=True)
    store = EmbeddedMetadataStore(root / "metadata")
    if bookie_config is None:
        bookie_config = BookieConfig()
    bookie_config.data_dir = str(root / "bookie")
    bookie = BookieServer(bookie_config, metadata=store)

    async def infrastructure(nursery: trio.Nursery) -> None:
        await nursery.start(store.run)
        await nursery.start(bookie.run)

    async def broker(task_status: trio.TaskStatus[Any]) -> None:
        await run_broker(broker_config, store=store, plugins=plugins, task_status=task_status)

    def ready(service: Any) -> None:
        service.extra_metrics.append(lambda: render_metrics(bookie.store, bookie.advertised))
        log.info(
            "standalone ready broker=%s bookie=%s data_dir=%s",
            service.service_url,
            bookie.advertised,
            root,
        )
        task_status.started(service)

    await run_layered(infrastructure, broker, ready)


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
