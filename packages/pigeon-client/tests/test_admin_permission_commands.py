"""``pigeon admin`` permission commands: bad input is refused before any request."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pigeon.client._admin_cli import AdminClient, admin_cmd
from pigeon.client._admin_client import check_actions

#: nothing listens here: a command that reached the network would exit 1, not 2
NOWHERE = "http://127.0.0.1:9"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            [
                "namespaces",
                "grant-permission",
                "public/default",
                "--role",
                "r",
                "--actions",
                "produce,fly",
            ],
            "unknown action 'fly' (actions: produce, consume",
        ),
        (
            ["namespaces", "grant-permission", "public/default", "--role", "r", "--actions", ","],
            "name at least one action",
        ),
        (
            ["topics", "grant-permission", "t", "--role", "r", "--actions", "write"],
            "unknown action 'write'",
        ),
        (
            ["namespaces", "grant-permission", "public/default", "--actions", "produce"],
            "Missing option '--role'",
        ),
        (
            ["namespaces", "set-subscription-auth-mode", "public/default", "sometimes"],
            "'sometimes' is not one of 'none', 'prefix'",
        ),
    ],
)
def test_bad_permission_arguments_are_usage_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(admin_cmd, ["--url", NOWHERE, *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_actions_are_normalised() -> None:
    assert check_actions([" Consume", "produce", "consume"]) == ["consume", "produce"]
    with pytest.raises(ValueError, match="unknown action 'x'"):
        AdminClient(NOWHERE).grant_permission("public/default", "r", ["x"])
    with pytest.raises(ValueError, match="none or prefix"):
        AdminClient(NOWHERE).set_subscription_auth_mode("public/default", "maybe")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("nonsense", "admin URL 'nonsense' is not http://host:port or https://host:port"),
        ("127.0.0.1:8080", "is not http://host:port"),
        ("pigeon://127.0.0.1:6650", "a pigeon:// URL is a broker's client port"),
        ("http://", "is not http://host:port"),
    ],
)
def test_a_url_that_is_not_http_is_one_line(url: str, message: str) -> None:
    """``--url nonsense`` was an 'unexpected ValueError (a bug)' from urllib; it is a typed
    error naming the form the URL must have, before any request."""
    result = CliRunner().invoke(admin_cmd, ["--url", url, "topics", "list"])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "unexpected" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"), [(["-n", "-5"], "--num-messages"), (["--timeout", "-1"], "--timeout")]
)
def test_a_negative_count_or_timeout_of_consume_is_a_usage_error(
    args: list[str], message: str
) -> None:
    """``pigeon consume -n -5`` ran forever (as ``-n 0``); it is refused before connecting."""
    from pigeon.client._cli import consume_cmd

    result = CliRunner().invoke(consume_cmd, ["-u", "pigeon://127.0.0.1:9", "-s", "s", *args, "t"])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
