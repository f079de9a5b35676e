"""The admin API over HTTPS (web_service_port_tls) with the broker's shared certificate."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request

import pytest
import trustme
from secure_admin_support import SecureAdminStandalone

API = "/admin/v2"


def test_https_serves_the_api_with_a_token(secure_admin: SecureAdminStandalone) -> None:
    status, body, _ = secure_admin.http_call("GET", f"{API}/tenants", role="admin", https=True)
    assert status == 200 and "ta" in body
    status, body, rh = secure_admin.http_call("GET", f"{API}/tenants", https=True)
    assert status == 401 and rh["www-authenticate"] == "Bearer"


def test_https_is_refused_by_a_client_that_does_not_trust_the_ca(
    secure_admin: SecureAdminStandalone,
) -> None:
    other = ssl.create_default_context()
    trustme.CA().configure_trust(other)
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(secure_admin.https_url + "/openapi.json", context=other, timeout=10)


def test_client_certificate_common_name_is_the_role(secure_admin: SecureAdminStandalone) -> None:
    s = secure_admin
    context = s.certs.client_tls_context("admin")
    status, body, _ = s.http_call("GET", f"{API}/tenants", https=True, context=context)
    assert status == 200 and "ta" in body
    context = s.certs.client_tls_context("alice")
    status, body, _ = s.http_call("GET", f"{API}/tenants", https=True, context=context)
    assert status == 403 and "role 'alice'" in body["message"]
    status, _, _ = s.http_call("GET", f"{API}/namespaces/ta", https=True, context=context)
    assert status == 200
    # the certificate counts only over TLS: plain HTTP without a token is refused
    assert s.http_call("GET", f"{API}/namespaces/ta")[0] == 401


def test_https_uses_the_reloadable_shared_certificate(
    secure_admin: SecureAdminStandalone,
) -> None:
    s = secure_admin
    assert s.service is not None and s.service.server_tls is not None
    tls = s.service.server_tls
    new_ca = trustme.CA()
    cert = new_ca.issue_cert("127.0.0.1", "localhost")
    old_cert, old_key = s.certs.certificate_file.read_bytes(), s.certs.key_file.read_bytes()
    try:
        cert.cert_chain_pems[0].write_to_path(str(s.certs.certificate_file))
        cert.private_key_pem.write_to_path(str(s.certs.key_file))
        assert s.call_sync(tls.reload)
        trusting_new = ssl.create_default_context()
        new_ca.configure_trust(trusting_new)
        status, _, _ = s.http_call("GET", "/openapi.json", https=True, context=trusting_new)
        assert status == 200
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            s.http_call("GET", "/openapi.json", https=True)  # the old CA
    finally:
        s.certs.certificate_file.write_bytes(old_cert)
        s.certs.key_file.write_bytes(old_key)
        assert s.call_sync(tls.reload)
    assert s.http_call("GET", "/openapi.json", https=True)[0] == 200


def test_a_client_offering_h2_gets_http_1_1(secure_admin: SecureAdminStandalone) -> None:
    context = secure_admin.certs.client_tls_context()
    context.set_alpn_protocols(["h2", "http/1.1"])
    status, _, _ = secure_admin.http_call("GET", "/openapi.json", https=True, context=context)
    assert status == 200


def test_plaintext_and_bad_handshakes_do_not_stop_the_https_listener(
    secure_admin: SecureAdminStandalone,
) -> None:
    import socket

    assert secure_admin.https is not None
    port = secure_admin.https[1]
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x16\x03\x01\x00\x05hello", b""):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(junk)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(10)
            while sock.recv(4096):  # the server closes the connection
                pass
    assert secure_admin.http_call("GET", "/openapi.json", https=True)[0] == 200
