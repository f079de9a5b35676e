"""Credentials and TLS in ``pigeon produce|consume|admin`` and the admin client (issue 15).

* ``--auth-token`` / ``PIGEON_AUTH_TOKEN``, ``--auth-token-file`` /
  ``PIGEON_AUTH_TOKEN_FILE`` and ``--tls-trust-certs-file`` /
  ``PIGEON_TLS_TRUST_CERTS_FILE`` reach the client (the broker sees the role); a refused
  token is one ``error:`` line, exit status 2, without the token.
* ``AdminClient`` over https:// sends ``Authorization: Bearer <token>``; 401 and 403 are
  AuthenticationError and AuthorizationError with the server's message; a wrong CA is a
  TlsError; an https:// → http:// redirect is refused.
"""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from _fake_broker import Running
from click.testing import CliRunner

from pigeon.client import AuthenticationError, AuthenticationToken, AuthorizationError, TlsError
from pigeon.client._admin_client import AdminClient
from pigeon.core._cli import make_cli
from pigeon.core.testing import SecurityFiles


def pigeon(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(make_cli(), list(args), env=env or {})


# ---------------------------------------------------------------------------- CLI


def test_produce_takes_the_token_and_ca_from_the_environment(
    tls_broker: Running, certs: SecurityFiles
) -> None:
    env = {
        "PIGEON_AUTH_TOKEN": tls_broker.token("env-role"),
        "PIGEON_TLS_TRUST_CERTS_FILE": str(certs.ca_file),
        "PIGEON_SERVICE_URL": tls_broker.url,
    }
    result = pigeon("produce", "t", "hello", env=env)
    assert result.exit_code == 0, result.output
    assert tls_broker.broker.roles[-1] == "env-role"


def test_produce_and_consume_take_the_flags(
    tls_broker: Running, certs: SecurityFiles, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(tls_broker.token("file-role") + "\n")
    common = ["-u", tls_broker.url, "--tls-trust-certs-file", str(certs.ca_file)]
    result = pigeon("produce", "t", "a", *common, "--auth-token-file", str(token_file))
    assert result.exit_code == 0, result.output
    assert tls_broker.broker.roles[-1] == "file-role"
    result = pigeon("produce", "t", "a", *common, "--auth-token", tls_broker.token("flag-role"))
    assert result.exit_code == 0, result.output
    assert tls_broker.broker.roles[-1] == "flag-role"
    env = {"PIGEON_AUTH_TOKEN_FILE": str(token_file)}
    result = pigeon("consume", "t", "-s", "sub", "-n", "1", "--timeout", "0.2", *common, env=env)
    assert result.exit_code == 0, result.output
    assert tls_broker.broker.roles[-1] == "file-role"


def test_a_refused_token_is_one_error_line_without_the_token(
    tls_broker: Running, certs: SecurityFiles
) -> None:
    bad = tls_broker.token("x")[:-6] + "AAAAAA"
    result = pigeon(
        "produce", "t", "a", "-u", tls_broker.url, "--tls-trust-certs-file", str(certs.ca_file),
        env={"PIGEON_AUTH_TOKEN": bad},
    )  # fmt: skip
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "AuthenticationError" in lines[0]
    assert bad not in result.output and bad[-20:] not in result.output
    assert "Traceback" not in result.output


def test_a_wrong_ca_is_one_error_line(tls_broker: Running, certs: SecurityFiles) -> None:
    wrong_ca = str(certs.other_ca_file)
    result = pigeon("produce", "t", "a", "-u", tls_broker.url, "--tls-trust-certs-file", wrong_ca)
    assert result.exit_code == 2
    assert "error: TlsError" in result.stderr and "trusted CA" in result.stderr


def test_token_and_token_file_together_are_a_usage_error(tmp_path: Path) -> None:
    result = pigeon("produce", "t", "a", "--auth-token", "x", "--auth-token-file", "f")
    assert result.exit_code == 2 and "not both" in result.output


@pytest.mark.parametrize(
    "command", [("produce",), ("consume",), ("perf", "produce"), ("perf", "consume"), ("admin",)]
)
def test_every_command_takes_the_options_and_recommends_the_variable_or_the_file(
    command: tuple[str, ...],
) -> None:
    result = pigeon(*command, "--help")
    assert "PIGEON_AUTH_TOKEN" in result.output and "--auth-token-file" in result.output
    assert (
        "PIGEON_TLS_TRUST_CERTS_FILE" in result.output and "--tls-allow-insecure" in result.output
    )


# ---------------------------------------------------------------------------- admin


class _AdminApi(BaseHTTPRequestHandler):
    """``GET /admin/v2/tenants``: 401 without a good token, 403 for role ``mallory``;
    ``/redirect`` sends to plain http://."""

    seen: list[str | None] = []
    good = {"Bearer good-token": "alice", "Bearer mallory-token": "mallory"}

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        header = self.headers.get("Authorization")
        self.seen.append(header)
        if self.path.startswith("/redirect"):
            self._json(307, {}, {"Location": "http://127.0.0.1:1/admin/v2/tenants"})
            return
        role = self.good.get(header or "")
        if role is None:
            self._json(401, {"error": "Unauthorized", "message": "the token is not valid"})
        elif role == "mallory":
            self._json(403, {"error": "Forbidden", "message": "role 'mallory' may not list"})
        else:
            self._json(200, ["public", "acme"])


@pytest.fixture(scope="module")
def admin_url(certs: SecurityFiles) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _AdminApi)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certs.certificate_file, certs.key_file)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_admin_client_sends_the_bearer_token_over_https(
    admin_url: str, certs: SecurityFiles, tmp_path: Path
) -> None:
    client = AdminClient(
        admin_url,
        auth=AuthenticationToken("good-token"),
        tls_trust_certs_file_path=str(certs.ca_file),
    )
    assert client.tenants() == ["public", "acme"]
    assert _AdminApi.seen[-1] == "Bearer good-token"
    assert "good-token" not in repr(client)
    # a token file is read again when it changed
    path = tmp_path / "token"
    path.write_text("mallory-token")
    client = AdminClient(
        admin_url, auth=AuthenticationToken(path), tls_trust_certs_file_path=str(certs.ca_file)
    )
    with pytest.raises(AuthorizationError, match="may not list"):
        client.tenants()
    path.write_text("good-token")
    assert client.tenants() == ["public", "acme"]


def test_admin_client_401_and_403(admin_url: str, certs: SecurityFiles) -> None:
    with pytest.raises(AuthenticationError, match="the token is not valid"):
        AdminClient(admin_url, tls_trust_certs_file_path=str(certs.ca_file)).tenants()
    assert _AdminApi.seen[-1] is None
    bad = AdminClient(
        admin_url, auth=AuthenticationToken("nope"), tls_trust_certs_file_path=str(certs.ca_file)
    )
    with pytest.raises(AuthenticationError) as info:
        bad.tenants()
    assert "nope" not in str(info.value)


def test_admin_client_refuses_a_wrong_ca_and_a_downgrade(
    admin_url: str, certs: SecurityFiles
) -> None:
    with pytest.raises(TlsError, match="trusted CA"):
        AdminClient(admin_url, tls_trust_certs_file_path=str(certs.other_ca_file)).tenants()
    insecure = AdminClient(
        admin_url, auth=AuthenticationToken("good-token"), tls_allow_insecure_connection=True
    )
    assert insecure.tenants() == ["public", "acme"]
    with pytest.raises(TlsError, match="redirect"):
        insecure.request("GET", "/redirect")


def test_pigeon_admin_takes_the_token_and_says_401_in_one_line(
    admin_url: str, certs: SecurityFiles
) -> None:
    env = {
        "PIGEON_ADMIN_URL": admin_url,
        "PIGEON_TLS_TRUST_CERTS_FILE": str(certs.ca_file),
        "PIGEON_AUTH_TOKEN": "good-token",
    }
    result = pigeon("admin", "tenants", "list", env=env)
    assert result.exit_code == 0, result.output
    assert "acme" in result.output
    result = pigeon("admin", "tenants", "list", env={**env, "PIGEON_AUTH_TOKEN": "nope"})
    assert result.exit_code == 1  # the API refused (a usage error would be 2)
    assert result.stderr.strip().splitlines()[-1].startswith("error: AuthenticationError")
    assert "nope" not in result.output
