"""``pigeon admin namespaces|topics grant-permission / revoke-permission / permissions``
and ``set-subscription-auth-mode`` against a running standalone."""

from __future__ import annotations

import json
from typing import Any

from admin_support import AdminStandalone
from click.testing import CliRunner, Result

from pigeon.client._admin_cli import admin_cmd


def admin(server: AdminStandalone, *args: str, code: int = 0) -> Result:
    result = CliRunner().invoke(admin_cmd, ["--url", server.url, *args])
    assert result.exit_code == code, (result.stdout, result.stderr, result.exception)
    return result


def admin_json(server: AdminStandalone, *args: str) -> Any:
    return json.loads(admin(server, "--json", *args).stdout)


def test_namespace_permissions_round_trip(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    out = admin(
        s,
        "namespaces",
        "grant-permission",
        "public/default",
        "--role",
        "app",
        "--actions",
        "produce,consume",
    ).stdout
    assert out.strip() == "granted consume,produce on public/default to app"
    assert admin_json(s, "namespaces", "permissions", "public/default") == {
        "app": ["consume", "produce"]
    }
    table = admin(s, "namespaces", "permissions", "public/default").stdout
    assert table.split() == ["ROLE", "ACTIONS", "app", "consume,produce"]
    out = admin(s, "namespaces", "revoke-permission", "public/default", "--role", "app").stdout
    assert "revoked" in out
    assert admin_json(s, "namespaces", "permissions", "public/default") == {}
    assert admin(s, "namespaces", "permissions", "public/default").stdout.strip() == (
        "no permissions"
    )
    # revoking again: the API's 404, exit code 1
    result = admin(s, "namespaces", "revoke-permission", "public/default", "--role", "app", code=1)
    assert result.stderr.startswith("error: ") and "(HTTP 404)" in result.stderr


def test_topic_permissions_round_trip(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    admin(s, "topics", "grant-permission", "cli-perm", "--role", "reader", "--actions", "consume")
    assert admin_json(s, "topics", "permissions", "cli-perm")["reader"] == ["consume"]
    admin(
        s, "topics", "revoke-permission", "persistent://public/default/cli-perm", "--role", "reader"
    )
    assert "reader" not in admin_json(s, "topics", "permissions", "cli-perm")


def test_unknown_action_is_a_one_line_usage_error(admin_standalone: AdminStandalone) -> None:
    result = admin(
        admin_standalone,
        "namespaces",
        "grant-permission",
        "public/default",
        "--role",
        "x",
        "--actions",
        "produce,fly",
        code=2,
    )
    assert "unknown action 'fly' (actions: produce, consume" in result.stderr
    assert "Traceback" not in result.stderr


def test_set_subscription_auth_mode(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    admin(s, "namespaces", "set-subscription-auth-mode", "public/default", "Prefix")
    assert (
        admin_json(s, "namespaces", "policies", "public/default")["subscription_auth_mode"]
        == "prefix"
    )
    admin(s, "namespaces", "set-subscription-auth-mode", "public/default", "none")
    assert (
        admin_json(s, "namespaces", "policies", "public/default")["subscription_auth_mode"]
        == "none"
    )
    admin(s, "namespaces", "set-subscription-auth-mode", "public/default", "sometimes", code=2)


def test_tenants_update(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    admin(s, "tenants", "create", "cli-upd", "--admin-role", "one")
    out = admin(s, "tenants", "update", "cli-upd", "--admin-role", "two", "--admin-role", "three")
    assert out.stdout.strip() == "tenant cli-upd updated"
    assert admin_json(s, "tenants", "get", "cli-upd")["admin_roles"] == ["two", "three"]
    result = admin(s, "tenants", "update", "no-such-tenant", code=1)
    assert result.stderr.startswith("error: ") and "(HTTP 404)" in result.stderr
