"""One PigeonMQ client per service URL per Python process.

Spark reuses its Python workers across tasks (``spark.python.worker.reuse``), so a task
finds the connection its predecessor opened instead of paying for a new client thread
and TCP handshake. Readers and writers are pickled to executors and hold no client
themselves: they call :func:`client_for` where they run.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading

from pigeon.client import Client
from pigeon.spark._options import ClientSecurity

__all__ = ["client_for", "close_clients"]

_lock = threading.Lock()
_clients: dict[tuple[int, str, ClientSecurity], Client] = {}


def client_for(service_url: str, security: ClientSecurity | None = None) -> Client:
    """The process's client for ``service_url`` with these credentials (created on first
    use, or again if the previous one was closed or this process was forked from its
    owner)."""
    security = security or ClientSecurity()
    key = (os.getpid(), service_url, security)
    with _lock:
        client = _clients.get(key)
        if client is None or not client.engine_thread.alive():
            client = _clients[key] = Client(service_url, **security.client_keywords())
        return client


def close_clients() -> None:
    with _lock:
        mine = [c for (pid, _, _), c in _clients.items() if pid == os.getpid()]
        _clients.clear()
    for client in mine:
        with contextlib.suppress(Exception):
            client.close()


atexit.register(close_clients)
