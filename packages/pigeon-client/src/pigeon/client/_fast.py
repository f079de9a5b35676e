"""The optional C hot path of the sync producer's ``send_async``.

``pigeon.client._speedups`` is built from ``_speedups.c`` when pigeon-client is installed
where a C compiler is (an optional extension: without one, the install goes on without
it). :func:`speed_up` gives a sync producer of one partition without a schema its own
``send_async``: a ``PlainSender``, which queues a bytes value alone, with no keyword, in C
when a batch is open with room for it and the producer's lock is free, and hands every
other call to the Python method (``Producer.send_async``) unchanged. Without the module,
or with ``PIGEON_NO_SPEEDUPS`` set to a non-empty value, producers keep the Python method.

The Python method is the reference: the tests send through both and compare.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any

from pigeon.client._core import PLAIN_SLACK
from pigeon.client._future import MessageFuture

__all__ = ["SPEEDUPS", "speed_up"]

log = logging.getLogger(__name__)


def _load() -> Any:
    if os.environ.get("PIGEON_NO_SPEEDUPS"):
        return None
    try:
        from pigeon.client import _speedups  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _speedups


_speedups = _load()
#: whether sync producers get the C hot path of ``send_async`` in this process
SPEEDUPS: bool = _speedups is not None


def speed_up(producer: Any) -> None:
    """Give an open sync ``producer`` the C ``send_async``, if it can take it: the module
    is here, and the producer has one partition and no schema."""
    logic = producer._handle.logic
    if _speedups is None or logic.multi or logic.encode is not None:
        return
    method = type(producer).send_async
    try:
        sender = _speedups.PlainSender(producer, method, MessageFuture, PLAIN_SLACK)
    except (TypeError, AttributeError, OverflowError) as exc:
        # objects not of the shape it reads, or a max_pending_messages that is not a C
        # ssize_t (a float, inf, 2**64): Python's send_async compares those as they are
        log.debug("send_async stays in Python for this producer: %s", exc)
        return
    functools.update_wrapper(sender, method)
    # the bound method's signature (update_wrapper's __wrapped__ has ``self`` first)
    sender.__signature__ = _bound_signature(method)
    producer.send_async = sender


@functools.cache
def _bound_signature(method: Any) -> inspect.Signature:
    sig = inspect.signature(method)
    return sig.replace(parameters=list(sig.parameters.values())[1:])
