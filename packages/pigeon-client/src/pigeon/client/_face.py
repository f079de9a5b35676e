"""What the three faces' Clients share: one engine, the plugins and their codecs.

A face's Client adds its calling convention (a blocking call into the engine's thread, an
awaited asyncio bridge, or a plain ``await`` in the caller's trio run); its
``create_producer`` / ``subscribe`` / ``create_reader`` take their options' signatures
(:func:`pigeon.client._options.takes_options`) and open through one engine-side function,
:func:`pigeon.client.trio.open_handle`.
"""

from __future__ import annotations

from pigeon.client._engine import ClientEngine
from pigeon.client._handles import codecs_of
from pigeon.core import PluginManager

__all__ = ["ClientBase"]


class ClientBase:
    """The engine (not connected yet), the plugins and the codecs they registered."""

    def __init__(
        self,
        service_url: str,
        *,
        operation_timeout: float = 30.0,
        plugins: PluginManager | None = None,
    ) -> None:
        self.engine = ClientEngine(service_url, operation_timeout=operation_timeout)
        self.plugins = plugins or PluginManager()
        self.codecs = codecs_of(self.plugins)
        self._start()

    def _start(self) -> None:
        """The face's own start, once the engine exists (the sync and asyncio faces start
        the engine's thread here)."""
