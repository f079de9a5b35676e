"""The admin app's routes are built while the node starts, not on the first request:
FastAPI builds an included router's routes (their pydantic models) on the first request
that reaches them, which held the event loop -- a standalone's message path too -- for
~0.1 s (the StallWatch named it: ``one step of task hypercorn...``)."""

from __future__ import annotations

from typing import Any

import fastapi.routing
import pytest

from pigeon.broker._admin import _build_routes, asgi_get, make_app
from pigeon.core.testing import InProcessStandalone


async def test_the_first_request_builds_no_route(
    pigeon_standalone: InProcessStandalone, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[Any] = []
    real = fastapi.routing.create_model_field

    def counting(*args: Any, **kwargs: Any) -> Any:
        built.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(fastapi.routing, "create_model_field", counting)
    # as the node starts: routes built once, ahead
    app = make_app(pigeon_standalone.service)
    await _build_routes(app)
    assert built, "the probe sees no route being built (another FastAPI?)"
    built.clear()
    assert await asgi_get(app, "/admin/v2/tenants") == 200
    assert await asgi_get(app, "/metrics") == 200
    assert built == [], "a request built routes on the event loop"
    # without it, the first request pays
    cold = make_app(pigeon_standalone.service)
    assert await asgi_get(cold, "/admin/v2/tenants") == 200
    assert built, "the first request of an app not built ahead built nothing"
