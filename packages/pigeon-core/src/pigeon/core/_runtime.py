"""Helpers every node command uses: opening the metadata store, signal handling."""

from __future__ import annotations

import ctypes
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


#: glibc malloc: allocations up to this size come from the heap, not from a fresh mmap
#: of their own (the default adapts between 128 KiB and 32 MiB) ...
SERVER_MALLOC_MMAP_THRESHOLD = 32 << 20
#: ... and the heap keeps this much freed memory before giving any back to the kernel
#: (the default adapts up to twice the mmap threshold)
SERVER_MALLOC_TRIM_THRESHOLD = 256 << 20


def tune_server_interpreter() -> None:
    """Settings of a process that is a PigeonMQ server (never of a client's process): a
    shorter GIL switch interval and fewer garbage collections, which take the 5-60 ms
    stalls out of the latency tail, and a malloc that keeps freed memory
    (:func:`retain_freed_memory`) (docs/benchmarks.md)."""
    sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)
    gc.set_threshold(*SERVER_GC_THRESHOLD)
    retain_freed_memory()


def retain_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for the next allocations (up to
    :data:`SERVER_MALLOC_TRIM_THRESHOLD`, allocations up to
    :data:`SERVER_MALLOC_MMAP_THRESHOLD` from the heap); whether it could.

    A server allocates and frees buffers of megabytes all the time (a read of 2 MB
    entries, a received frame, the entry the ledger stores).  By default each one is a
    fresh mmap, or heap memory given back to the kernel when freed, so the next one
    page-faults and zero-fills again; where the host backs a VM's memory lazily each of
    those faults also costs the host's (docs/benchmarks.md, "Drop-behind").  Other C
    libraries (musl) and other systems: nothing is changed.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, SERVER_MALLOC_MMAP_THRESHOLD)) and bool(
        mallopt(m_trim_threshold, SERVER_MALLOC_TRIM_THRESHOLD)
    )


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
