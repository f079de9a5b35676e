"""The admin app's routes are built while the node starts, not on the first request:
FastAPI builds an included router's routes (their pydantic models) on the first request
that reaches them, which held the event loop -- a standalone's message path too -- for
~0.1 s (the StallWatch named it: ``one step of task hypercorn...``)."""

from __future__ import annotations

from typing import Any

import fastapi.routing
import pytest

from pigeon.broker._admin import _build_routes, make_app
from pigeon.core.testing import InProcessStandalone


async def get(app: Any, path: str) -> int:
    """The status of one GET through the ASGI interface."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "state": {},
    }
    status: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    return status[0]


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
    assert await get(app, "/admin/v2/tenants") == 200
    assert await get(app, "/metrics") == 200
    assert built == [], "a request built routes on the event loop"
    # without it, the first request pays
    cold = make_app(pigeon_standalone.service)
    assert await get(cold, "/admin/v2/tenants") == 200
    assert built, "the first request of an app not built ahead built nothing"
