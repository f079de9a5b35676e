"""Helpers every node command uses: opening the metadata store, signal handling."""

from __future__ import annotations

import logging
import signal
from typing import Any

import trio

from pigeon.core._plugins import PluginManager
from pigeon.core.errors import ConfigError, PigeonError

__all__ = ["open_metadata_store", "run_until_signal"]

log = logging.getLogger(__name__)


def open_metadata_store(url: str, plugins: PluginManager) -> Any:
    """The metadata store for ``url``, by its scheme (``embedded``, ``zk``, ``etcd``...)."""
    if "://" not in url:
        raise ConfigError(
            f"bad value for 'metadata': {url!r} is not a URL like embedded:///path, "
            "zk://host:2181/chroot or etcd://host:2379/prefix"
        )
    scheme = url.split("://", 1)[0]
    if scheme not in plugins.metadata_stores:
        known = ", ".join(plugins.metadata_stores) or "none"
        raise ConfigError(
            f"bad value for 'metadata': no metadata store plugin for scheme {scheme!r} "
            f"(installed: {known})"
        )
    return plugins.metadata_stores.get(scheme)(url)  # type: ignore[operator]


async def run_until_signal(fn: Any, *args: Any, ready: Any = None) -> None:
    """Run ``fn(*args, task_status=...)`` until SIGINT/SIGTERM, then shut down cleanly."""
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            try:
                value = await nursery.start(fn, *args)
            except PigeonError:
                nursery.cancel_scope.cancel()
                raise
            if ready is not None:
                ready(value)
            async for signum in signals:
                log.info("shutting down signal=%s", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break
