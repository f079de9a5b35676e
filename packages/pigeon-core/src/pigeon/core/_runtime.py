"""Helpers every node command uses: opening the metadata store, signal handling."""

from __future__ import annotations

import gc
import logging
import signal
import sys
from typing import Any

import trio

from pigeon.core._plugins import PluginManager
from pigeon.core._stalls import StallWatch, stall_threshold
from pigeon.core.errors import ConfigError, PigeonError

__all__ = ["open_metadata_store", "run_until_signal", "tune_server_interpreter"]

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


#: GIL hand-off interval of server processes (CPython's default is 5 ms): a worker thread
#: whose fsync or disk read finished waits at most this long for the event loop's thread
SERVER_SWITCH_INTERVAL_S = 0.0005
#: young-generation GC threshold of server processes (CPython's default is 700): fewer
#: collections while batches are in flight; startup objects are frozen out of the GC
SERVER_GC_THRESHOLD = (50_000, 20, 100)


def tune_server_interpreter() -> None:
    """Settings of a process that is a PigeonMQ server (never of a client's process): a
    shorter GIL switch interval and fewer garbage collections, which take the 5-60 ms
    stalls out of the latency tail (docs/benchmarks.md)."""
    sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)
    gc.set_threshold(*SERVER_GC_THRESHOLD)


async def run_until_signal(fn: Any, *args: Any, ready: Any = None) -> None:
    """Run ``fn(*args, task_status=...)`` until SIGINT/SIGTERM, then shut down cleanly.

    This is how ``pigeon bookie/broker/standalone`` run: the interpreter is tuned for a
    server (:func:`tune_server_interpreter`) and, once started, every object made so far
    is moved out of the garbage collector's reach (``gc.freeze``); a stall of the event
    loop is logged (:class:`~pigeon.core._stalls.StallWatch`)."""
    tune_server_interpreter()
    threshold = stall_threshold()
    watch = StallWatch(threshold) if threshold > 0 else None
    try:
        async with trio.open_nursery() as nursery:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                try:
                    value = await nursery.start(fn, *args)
                except PigeonError:
                    nursery.cancel_scope.cancel()
                    raise
                gc.collect()
                gc.freeze()
                if watch is not None:  # from now on (starting imports and opens a lot)
                    watch.install()
                if ready is not None:
                    ready(value)
                async for signum in signals:
                    log.info("shutting down signal=%s", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    break
    finally:
        if watch is not None:
            watch.uninstall()
