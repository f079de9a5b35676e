"""Watches a broker keeps for as long as it runs, across metadata server outages.

A metadata server that is away (connection lost, session expired, restarting) must not
end the broker: :func:`watch_forever` waits it out with backoff and watches again,
catching up on what it may have missed each time the watch is established.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from pigeon.core.errors import MetadataError, PigeonError

__all__ = ["transient_metadata_error", "watch_forever"]

log = logging.getLogger(__name__)

#: first and longest wait before watching again
RETRY_S = (0.1, 2.0)


def transient_metadata_error(exc: BaseException) -> bool:
    """A metadata error worth waiting out (also inside an exception group)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(transient_metadata_error(e) for e in exc.exceptions)
    return isinstance(exc, MetadataError) or (isinstance(exc, PigeonError) and exc.retriable)


async def watch_forever(
    store: Any,
    path: str,
    *,
    what: str,
    on_watching: Callable[[bool], Awaitable[None]],
    on_event: Callable[[Any], Awaitable[None]],
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Watch ``path`` and everything below it until cancelled.

    ``on_watching(first)`` runs each time the watch is established (``first`` only the
    first time): read what the events will not tell, e.g. what changed while the
    server was away. ``on_event(event)`` runs for each event. A transient metadata
    error in any of them is logged (``what`` names the watch) and the watch starts
    again after a backoff; other errors propagate. ``task_status`` is started once the
    first watch is established and ``on_watching(True)`` returned.
    """
    started = False
    delay = RETRY_S[0]
    while True:
        try:
            async with store.watch(path, prefix=True) as events:
                await on_watching(not started)
                delay = RETRY_S[0]
                if not started:
                    started = True
                    task_status.started()
                async for event in events:
                    await on_event(event)
        except (PigeonError, BaseExceptionGroup) as exc:
            if not transient_metadata_error(exc):
                raise
            log.warning("%s failed error=%s; retrying", what, exc)
        await trio.sleep(delay)
        delay = min(delay * 2, RETRY_S[1])
