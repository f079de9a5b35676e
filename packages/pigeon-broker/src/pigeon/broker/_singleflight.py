"""Single-flight opening: one task opens a thing (a topic, a subscription) while the others
that want it wait, then find what it opened.

The opener holds a key in a dict of events (``key -> set when the opener is done``);
:func:`claimed` holds one for as long as its body runs (unload and delete hold the key of
the topic they close, so nothing re-opens it meanwhile).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from typing import TypeVar

import trio

__all__ = ["claimed", "open_once"]

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


@contextlib.asynccontextmanager
async def claimed(opening: dict[K, trio.Event], key: K) -> AsyncIterator[None]:
    """Hold ``key`` while the body runs, once no other task holds it."""
    while (holder := opening.get(key)) is not None:
        await holder.wait()
    done = opening[key] = trio.Event()
    try:
        yield
    finally:
        if opening.get(key) is done:
            del opening[key]
        done.set()


async def open_once(
    opening: dict[K, trio.Event],
    key: K,
    find: Callable[[], T | None],
    open_: Callable[[], Awaitable[T]],
) -> T:
    """What ``find()`` finds; else ``open_()``, holding ``key``.  A task arriving while
    another holds ``key`` waits for it and looks again."""
    while True:
        found = find()
        if found is not None:
            return found
        holder = opening.get(key)
        if holder is None:
            break
        await holder.wait()
    async with claimed(opening, key):
        return await open_()
