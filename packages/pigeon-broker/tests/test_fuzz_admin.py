"""Hostile input for every admin API operation: never a 5xx, never a body that is not JSON.

schemathesis (``test_admin_openapi.py``) generates what the OpenAPI document describes,
as strict JSON.  This suite sends what the document does not: ``NaN``, ``Infinity`` and
``1e999`` (Python's JSON parser accepts all three), integers of hundreds of digits, wrong
types, huge strings, unknown fields, deep nesting, bytes that are not UTF-8, and hostile
path and query values.  Every answer must be below 500 and, when JSON, strict JSON (no
``NaN``); the broker logs no ERROR.

Destructive operations (DELETE) aim at a throwaway tenant, namespace and topic so that
the other operations keep finding the seeded topic ``fz`` and its subscription ``s``.
``PIGEON_FUZZ_EXAMPLES=200`` for a longer, randomized run (default: 8 per operation,
derandomized).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from types import SimpleNamespace
from typing import Any

import hypothesis
import pytest
from admin_support import AdminStandalone
from hypothesis import strategies as st

from pigeon.broker._admin import make_app
from pigeon.broker._admin_ops import FULL_BUNDLE
from pigeon.core.testing.fuzz import ErrorLines, fuzz_settings

FUZZ = fuzz_settings("PIGEON_FUZZ_EXAMPLES", 8)

DOCUMENT = make_app(SimpleNamespace()).openapi()  # type: ignore[arg-type]
OPERATIONS = sorted(
    (method.upper(), path, op)
    for path, item in DOCUMENT["paths"].items()
    for method, op in item.items()
)


def _body_fields(operation: dict[str, Any]) -> list[str]:
    """Field names of an operation's JSON body (to build bodies that almost fit)."""
    content = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
    refs = json.dumps(content.get("schema", {}))
    names: list[str] = []
    for model, schema in DOCUMENT["components"]["schemas"].items():
        if f"#/components/schemas/{model}" in refs:
            names.extend(schema.get("properties", {}))
    return names


# ------------------------------------------------------------------ hostile values

HUGE_TEXT = "x" * 200_000
#: JSON texts, as sent (not all of them are JSON: Python's parser takes NaN and 1e999)
ATOMS = [
    "NaN",
    "-NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-1e999",
    "1e308",
    "4.9e-324",
    "-0",
    "0.5",
    "9" * 400,
    "-" + "9" * 400,
    str(2**63),
    str(-(2**63) - 1),
    str(2**53 + 1),
    "true",
    "false",
    "null",
    '""',
    '"earliest"',
    '"0:0"',
    '"1:2:3"',
    '"\\ud800"',
    '"\\u0000"',
    '"NaN"',
    json.dumps(HUGE_TEXT),
    "[]",
    "{}",
]


def _object(items: list[tuple[str, str]]) -> str:
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in items) + "}"


def json_texts(fields: list[str]) -> st.SearchStrategy[str]:
    keys = st.sampled_from(fields) if fields else st.nothing()
    keys = keys | st.text(max_size=12) | st.just("x" * 5000)
    atoms = st.sampled_from(ATOMS) | st.integers().map(str) | st.floats().map(repr)
    values = st.recursive(
        atoms,
        lambda inner: (
            st.lists(inner, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]")
            | st.lists(st.tuples(keys, inner), max_size=4).map(_object)
        ),
        max_leaves=8,
    )
    # mostly objects with the operation's own field names, holding hostile values
    return st.lists(st.tuples(keys, values), min_size=1, max_size=4).map(_object) | values


def raw_bodies(fields: list[str]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        json_texts(fields).map(str.encode),
        st.just(b"[" * 50_000 + b"]" * 50_000),
        st.just(b'{"a":' * 5000 + b"1" + b"}" * 5000),
        st.binary(max_size=64),
        json_texts(fields).map(lambda t: t.encode()[: max(1, len(t) // 2)]),  # truncated
    )


HOSTILE_SEGMENTS = [
    "NaN",
    "1e999",
    "..",
    ".",
    "%00",
    "a%2Fb",
    "\u00e9\u4e2d\U0001f600",
    "x" * 400,
    "x" * 20_000,
    " ",
    "-1",
    "0x00000000_0xFFFFFFFFF",
    "%ff%fe",
]
HOSTILE_QUERY = ["NaN", "1e999", "-1", "9" * 400, "", "true", "yes", "\u00e9", "x" * 20_000]

#: path parameters the seeded standalone has (DELETE gets the throwaway ones)
KEEP = {
    "domain": "persistent",
    "tenant": "public",
    "namespace": "default",
    "topic": "fz",
    "subscription": "s",
    "bundle": FULL_BUNDLE,
}
THROWAWAY = {**KEEP, "tenant": "fzt", "namespace": "fzns", "topic": "gone", "subscription": "gone"}


@st.composite
def requests(draw: st.DrawFn, method: str, path: str, op: dict[str, Any], known: dict[str, str]):
    base = THROWAWAY if method == "DELETE" else known
    url = path
    query: dict[str, str] = {}
    for param in op.get("parameters", []):
        name = param["name"]
        if param["in"] == "path":
            value = draw(st.sampled_from([base.get(name, "x")] * 3 + HOSTILE_SEGMENTS))
            url = url.replace("{" + name + "}", urllib.parse.quote(value, safe="%"))
        elif param["in"] == "query" and draw(st.booleans()):
            query[name] = draw(st.sampled_from(HOSTILE_QUERY) | st.text(max_size=8))
    if query:
        url += "?" + urllib.parse.urlencode(query)
    body = None
    if "requestBody" in op or draw(st.integers(0, 9)) == 0:
        body = draw(raw_bodies(_body_fields(op)))
    return url, body


def _strict_json(text: bytes) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def call(base_url: str, method: str, url: str, body: bytes | None) -> tuple[int, bytes, str]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    req = urllib.request.Request(base_url + url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read(), resp.headers.get("content-type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("content-type", "")


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def known(admin_standalone: AdminStandalone) -> dict[str, str]:
    """Seed a topic with messages and a subscription; path values that exist."""
    server = admin_standalone
    server.seed_topic("fz", "s")
    assert server.http_call("PUT", "/admin/v2/tenants/fzt")[0] == 201
    assert server.http_call("PUT", "/admin/v2/namespaces/fzt/fzns")[0] == 201
    _, brokers, _ = server.http_call("GET", "/admin/v2/brokers")
    _, bookies, _ = server.http_call("GET", "/admin/v2/bookies")
    return {**KEEP, "broker": brokers[0]["broker"], "bookie": bookies[0]["address"]}


# ------------------------------------------------------------------ tests


def test_every_operation_is_fuzzed() -> None:
    assert len(OPERATIONS) == 53  # test_admin_openapi.py counts the same
    assert {p for _m, p, _o in OPERATIONS} >= {"/admin/v2/tenants/{tenant}", "/metrics"}


@pytest.mark.parametrize(
    ("method", "path", "op"), OPERATIONS, ids=[f"{m} {p}" for m, p, _ in OPERATIONS]
)
def test_hostile_input_never_gets_a_5xx(
    admin_standalone: AdminStandalone,
    known: dict[str, str],
    error_lines: ErrorLines,
    method: str,
    path: str,
    op: dict[str, Any],
) -> None:
    @hypothesis.given(request=requests(method, path, op, known))
    @FUZZ
    def run(request: tuple[str, bytes | None]) -> None:
        url, body = request
        status, payload, ctype = call(admin_standalone.url, method, url, body)
        assert status < 500, (url, body[:200] if body else None, payload[:500])
        if ctype.startswith("application/json") and payload:
            answer = _strict_json(payload)
            if status >= 400:
                assert isinstance(answer, dict) and answer.get("message"), answer

    run()
    error_lines.assert_none()


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        (
            "PATCH",
            "/admin/v2/namespaces/public/default/policies",
            '{"retention_time_s": NaN}',
            "retention_time_s",
        ),
        (
            "PATCH",
            "/admin/v2/namespaces/public/default/policies",
            '{"message_ttl_s": 1e999}',
            "message_ttl_s",
        ),
        (
            "PATCH",
            "/admin/v2/namespaces/public/default/policies",
            '{"backlog_quota_bytes": -Infinity}',
            "backlog_quota_bytes",
        ),
        (
            "PATCH",
            "/admin/v2/namespaces/public/default/policies",
            '{"ensemble_size": NaN}',
            "ensemble_size",
        ),
        (
            "PUT",
            "/admin/v2/namespaces/fzt/other",
            '{"retention_size_mb": Infinity}',
            "retention_size_mb",
        ),
        (
            "POST",
            "/admin/v2/topics/persistent/public/default/fz/subscriptions/s/reset-cursor",
            '{"timestamp": NaN}',
            "timestamp",
        ),
        (
            "POST",
            "/admin/v2/topics/persistent/public/default/fz/subscriptions/s/reset-cursor",
            '{"timestamp": 1e999}',
            "timestamp",
        ),
        (
            "POST",
            "/admin/v2/topics/persistent/public/default/fz/subscriptions/s/reset-cursor",
            '{"offset": 1e999}',
            "offset",
        ),
        (
            "POST",
            "/admin/v2/topics/persistent/public/default/fz/subscriptions/s/skip",
            '{"count": NaN}',
            "count",
        ),
        ("PUT", "/admin/v2/tenants/fzt2", '{"admin_roles": [NaN]}', "admin_roles"),
    ],
)
def test_non_finite_numbers_are_a_422_naming_the_field(
    admin_standalone: AdminStandalone,
    known: dict[str, str],
    method: str,
    path: str,
    body: str,
    field: str,
) -> None:
    status, payload, _ = call(admin_standalone.url, method, path, body.encode())
    assert status == 422
    answer = _strict_json(payload)  # JSON-compliant: the NaN is echoed as a string
    assert answer["error"] == "ValidationError"
    assert answer["message"].startswith(f"body.{field}")
    assert "constrained" not in answer["message"]


def test_policies_are_unchanged_by_rejected_values(
    admin_standalone: AdminStandalone, known: dict[str, str]
) -> None:
    ns = "/admin/v2/namespaces/public/default/policies"
    before = admin_standalone.http_call("GET", ns)[1]
    call(admin_standalone.url, "PATCH", ns, b'{"retention_time_s": NaN, "message_ttl_s": 5}')
    assert admin_standalone.http_call("GET", ns)[1] == before


def test_echoed_input_is_cut_short(
    admin_standalone: AdminStandalone, known: dict[str, str]
) -> None:
    ns = "/admin/v2/namespaces/public/default/policies"
    body = json.dumps({"deduplication": HUGE_TEXT, "x" * 5000: 1}).encode()
    status, payload, _ = call(admin_standalone.url, "PATCH", ns, body)
    assert status == 422
    assert len(payload) < 10_000  # not the 200 kB that were sent
    _strict_json(payload)
